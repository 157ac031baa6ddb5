#!/usr/bin/env python
"""Checkpoint blocking time and step-time ratio of deadpool_ext against what users run today, side by side in one
job (A/B interleaved), at one or more checkpoint intervals.

Modes (each "mode@k" checkpoints after every k-th step):

* ``none``          no checkpointing (deadpool runtime attached, snapshots inactive: the baseline);
* ``deadpool``      deadpool_ext snapshot: background copy into /dev/shm ping-pong slots + a replica on the other
                    simulated node (the "deadpool" config section, as configs/ and training/pretrain.py use it);
* ``ds_default``    ``engine.save_checkpoint`` to local disk through DeepSpeed's ``TorchCheckpointEngine``;
* ``ds_decoupled``  the same through DeepSpeed 0.19's ``DecoupledCheckpointEngine``
                    (``"checkpoint": {"writer": {"decoupled": true}}``; one writer process per rank);
* ``dcp_async``     ``torch.distributed.checkpoint.async_save`` of the rank's state tensors, waiting on the
                    previous save's future first;
* ``dlrover_flash`` DLRover flash checkpoint (``DeepSpeedCheckpointer.save_checkpoint(storage_type=MEMORY)``:
                    the engine's state copied into shared memory; its saver process persists on request).

Usage::

    python benchmarks/bench_peers.py --quick       # tiny GPT, 2 ranks, intervals 1,2 (~2-4 min on 2 cores)
    python benchmarks/bench_peers.py               # GPT small, 4 ranks, intervals 1,4 (~25 min)

Writes ``peers.json`` / ``peers.md`` (``peers_quick.*`` with --quick) into ``--out``. A peer that cannot start
here is reported with the reason instead of a number. The file runs itself under torchrun in ``--worker`` mode.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    REPO,
    bootstrap_ratio_ci,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    machine_info,
    md_table,
    median,
    process_memory,
    summarize,
    write_json,
    write_text,
)
from file_sync import fsync_tree  # noqa: E402

MODES = ("none", "deadpool", "ds_default", "ds_decoupled", "dcp_async", "dlrover_flash")
BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
PRESETS = {
    "quick": {"size": "tiny", "nproc": 2, "micro_batch": 4, "intervals": "1,2", "rounds": 2, "steps": 4,
              "warmup_steps": 2, "timeout_s": 900},
    "full": {"size": "small", "nproc": 4, "micro_batch": 2, "intervals": "1,4", "rounds": 2, "steps": 4,
             "warmup_steps": 2, "timeout_s": 3600},
}


# ==================================================================================================
# worker (one per rank, under torchrun)
# ==================================================================================================
class _Peers:
    """Sets up every mode once and runs one checkpoint of a mode; modes that cannot start are dropped with the
    reason (agreed by all ranks, so the interleaving stays in lockstep)."""

    def __init__(self, engine: Any, args: argparse.Namespace, modes: list[str], dist: Any) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.engine, self.args, self.dist = engine, args, dist
        self.rank = dist.get_rank()
        self.snaps = engine.deadpool.snapshots
        self.adapter = engine.deadpool.adapter
        self.own_engine = engine.checkpoint_engine
        self.torch_engine = TorchCheckpointEngine(engine._config)
        self.notes: dict[str, str] = {}
        self.dirs = {m: os.path.join(args.scratch, m) for m in MODES if m not in ("none", "deadpool")}
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        self.decoupled = self.dlrover = self.dcp_group = self.dcp_future = None
        self.commit_s: list[float] = []
        self.modes = [m for m in modes if self._setup(m)]

    def _agree(self, mode: str, error: str | None) -> bool:
        import torch

        ok = torch.tensor([0 if error else 1])
        self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN)
        if int(ok.item()):
            return True
        errors: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(errors, error)
        self.notes[mode] = "not run: " + "; ".join(sorted({e for e in errors if e}))
        return False

    def _setup(self, mode: str) -> bool:
        error = None
        try:
            if mode == "ds_decoupled":
                from bench_snapshot_overhead import _make_decoupled
                from deepspeed.runtime.checkpoint_engine import create_checkpoint_engine
                from deepspeed.utils import groups

                self.decoupled, info = _make_decoupled(self.engine, self.args, create_checkpoint_engine, groups,
                                                       self.dist)
                error = info.get("error")
                if info.get("writer_note"):
                    self.notes["ds_decoupled_writer"] = info["writer_note"]
                if self.decoupled is not None:
                    original = self.engine._commit_decoupled_checkpoint

                    def timed_commit() -> None:  # the engine commits the previous save inside step(): time it
                        t0 = time.perf_counter()
                        original()
                        self.commit_s.append(time.perf_counter() - t0)

                    self.engine._commit_decoupled_checkpoint = timed_commit
            elif mode == "dcp_async":
                self.dcp_group = self.dist.new_group(backend="gloo")
            elif mode == "dlrover_flash":
                from common import make_dlrover_checkpointer

                self.dlrover, self.notes["dlrover_flash_shim"] = make_dlrover_checkpointer(
                    self.engine, self.dirs["dlrover_flash"])
        except Exception as exc:  # noqa: BLE001 - recorded in the results instead of a number
            error = f"{type(exc).__name__}: {exc}"
        return self._agree(mode, error)

    def begin(self, mode: str) -> None:
        if mode in ("ds_default", "dlrover_flash"):
            # DLRover's checkpointer calls engine.save_checkpoint with torch.save redirected to shared memory,
            # so the engine must write through torch.save (the stock engine), not deadpool's engine.
            self.engine.checkpoint_engine = self.torch_engine
        elif mode == "ds_decoupled":
            self.engine.checkpoint_engine = self.decoupled

    def before_step(self, mode: str, step: int, k: int) -> None:
        self.snaps.active = mode == "deadpool" and step % k == 0

    def save(self, mode: str, step: int) -> tuple[float, float]:
        """One checkpoint inside the step timer: (call seconds, seconds waiting for the previous one)."""
        tag = f"global_step{step}"
        t0 = time.perf_counter()
        if mode in ("ds_default", "ds_decoupled"):
            self.engine.save_checkpoint(self.dirs[mode], tag=tag)
        elif mode == "dcp_async":
            import torch.distributed.checkpoint as dcp

            if self.dcp_future is not None:
                self.dcp_future.result()
            t1 = time.perf_counter()
            sd = {f"r{self.rank}.{name}": t for name, t in self.adapter.tensors()}
            self.dcp_future = dcp.async_save(sd, checkpoint_id=os.path.join(self.dirs[mode], tag),
                                             process_group=self.dcp_group)
            return time.perf_counter() - t1, t1 - t0
        elif mode == "dlrover_flash":
            from common import dlrover_save_memory

            dlrover_save_memory(self.dlrover, self.dirs[mode], tag)
        return time.perf_counter() - t0, 0.0

    def drain(self, mode: str) -> float:
        t0 = time.perf_counter()
        if mode == "deadpool":
            self.snaps.wait_idle()
        elif mode == "ds_decoupled":
            self.engine._commit_decoupled_checkpoint()
        elif mode == "dcp_async" and self.dcp_future is not None:
            self.dcp_future.result()
            self.dcp_future = None
        if mode not in ("none", "deadpool") and mode in self.dirs:
            fsync_tree(self.dirs[mode])  # this block's files durable inside it, and only those (not os.sync())
        return time.perf_counter() - t0

    def end(self, mode: str) -> None:
        self.snaps.active = False
        self.engine.checkpoint_engine = self.own_engine
        if self.rank == 0 and mode in self.dirs:  # bound disk use: versions of this block are complete now
            for name in os.listdir(self.dirs[mode]):
                shutil.rmtree(os.path.join(self.dirs[mode], name), ignore_errors=True)

    def close(self) -> None:
        if self.decoupled is not None:
            self.decoupled.cleanup()


def worker(args: argparse.Namespace) -> int:
    import logging

    import torch.distributed as dist

    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.training.data import ByteLMData, seed_everything
    from deadpool_ext.training.models import build_gpt, count_parameters, seq_len_for

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed()
    from deepspeed.utils import logger as ds_logger

    from deadpool_ext import deepspeed as dpx

    ds_logger.setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(BASE_CONFIG) as fh:
        config = json.load(fh)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = 1
    config["deadpool"] = {"enabled": True, "job_id": args.job_id, "snapshot": {"interval": 1},
                          "replication": {"factor": 1},
                          "local": {"shm_root": args.shm_root, "simulate_nodes": 2},
                          "recovery": {"restore_on_start": False}}
    seed_everything(args.seed)
    model = build_gpt(args.size)
    n_params = count_parameters(model)  # before ZeRO-3 partitions the parameters (then they read as empty)
    engine, _, _, _ = dpx.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.deadpool.snapshots.active = False
    peers = _Peers(engine, args, [m for m in args.modes.split(",") if m], dist)
    data = ByteLMData(seq_len=seq_len_for(args.size), seed=args.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    dp_rank = dist.get_rank(group=engine.data_parallel_group)
    intervals = [int(k) for k in args.intervals.split(",")]
    variants = [(m, 1) for m in peers.modes if m == "none"] + [(m, k) for k in intervals for m in peers.modes
                                                               if m != "none"]
    snaps = engine.deadpool.snapshots
    engine.train()
    blocks: list[dict[str, Any]] = []
    dist.barrier()
    for r in range(args.warmup_rounds + args.rounds):
        warm = r < args.warmup_rounds
        n = args.warmup_steps if warm else args.steps_per_block
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for mode, k in order:
            peers.begin(mode)
            blk: dict[str, Any] = {"round": r, "mode": mode, "interval": k, "warmup": warm, "step_s": [],
                                   "ckpt_step_s": [], "blocking_s": [], "loss": []}
            snap0, commit0 = len(snaps.timings.blocking_s), len(peers.commit_s)
            for _ in range(n):
                step = int(engine.global_steps) + 1
                peers.before_step(mode, step, k)
                t0 = time.perf_counter()
                ids, labels = data.gpt_batch(int(engine.global_samples) + dp_rank * micro, micro)
                loss = engine(input_ids=ids, labels=labels).loss
                engine.backward(loss)
                engine.step()
                call_s = wait_s = 0.0
                if mode not in ("none", "deadpool") and step % k == 0:
                    call_s, wait_s = peers.save(mode, step)
                    blk["blocking_s"].append(call_s + wait_s)
                dt = time.perf_counter() - t0
                blk["step_s"].append(dt)
                if step % k == 0:
                    blk["ckpt_step_s"].append(dt)
                blk["loss"].append(float(loss.detach().item()))
            blk["drain_s"] = peers.drain(mode)
            if mode == "deadpool":
                blk["blocking_s"] = list(snaps.timings.blocking_s[snap0:])
            elif mode == "ds_decoupled":  # the commit of save i-1 runs inside step i: it is blocking time too
                blk["blocking_s"] = [b + c for b, c in zip(blk["blocking_s"], peers.commit_s[commit0 + 1:] + [0.0] * n)]
            blk["memory"] = process_memory()
            peers.end(mode)
            blocks.append(blk)
            if rank == 0:
                print(f"[peers] round {r}{' (warm-up)' if warm else ''} {mode}@{k}: median step "
                      f"{median(blk['step_s']):.3f} s, blocking {median(blk['blocking_s']) or 0:.4f} s", flush=True)
    state_bytes = sum(t.numel() * t.element_size() for _, t in peers.adapter.tensors())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "state_bytes": state_bytes, "blocks": blocks,
                                      "shm_bytes": snaps.memory_bytes()})
    peers.close()
    engine.deadpool.close()
    if rank == 0:
        write_json(args.result_file, {"size": args.size, "params": n_params, "world_size": world,
                                      "micro_batch": micro, "zero_stage": 3, "modes": peers.modes,
                                      "intervals": intervals, "notes": peers.notes, "ranks": gathered,
                                      "layout": {"nproc": world, "simulated_nodes": 2, "replication_factor": 1}})
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ==================================================================================================
# analysis and launcher
# ==================================================================================================
def analyze(res: dict[str, Any]) -> dict[str, Any]:
    """Per mode@interval: job step time (slowest rank per step), ratio to ``none``, blocking per checkpoint."""
    ranks = res["ranks"]
    keyed: dict[str, dict[str, list[float]]] = {}
    for i, blk in enumerate(ranks[0]["blocks"]):
        if blk["warmup"]:
            continue
        key = f"{blk['mode']}@{blk['interval']}"
        e = keyed.setdefault(key, {"step": [], "blocking": [], "drain": [], "rss": []})
        per_rank = [r["blocks"][i] for r in ranks]
        e["step"] += [max(vals) for vals in zip(*(b["step_s"] for b in per_rank))]
        e["blocking"] += [v for b in per_rank for v in b["blocking_s"]]
        e["drain"].append(max(b["drain_s"] for b in per_rank))
        e["rss"].append(max(b["memory"].get("rss", 0) for b in per_rank))
    base = keyed.get("none@1", {}).get("step", [])
    base_med = median(base)
    out = {}
    for key, e in keyed.items():
        med = median(e["step"])
        blocking = summarize(e["blocking"])
        out[key] = {"mode": key.split("@")[0], "interval": int(key.split("@")[1]), "step_s": summarize(e["step"]),
                    "ratio_to_none": med / base_med if med and base_med else None,
                    "ratio_ci90": bootstrap_ratio_ci(e["step"], base) if key != "none@1" else None,
                    "blocking_s": blocking, "drain_s": summarize(e["drain"]),
                    "blocking_fraction_of_step": (blocking["median"] / base_med
                                                  if blocking["median"] is not None and base_med else None),
                    "rank_rss_bytes_max": max(e["rss"]) if e["rss"] else None}
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# Peers: checkpoint cost side by side", "",
             f"Command: `{doc['command']}`. Machine: {doc['machine'].get('cpu_model')}, "
             f"{doc['machine'].get('cpu_count')} "
             "cores, shared with other engineers' test runs while this ran (loaded; ratios come from one A/B-"
             "interleaved job, absolute times are noisy).", ""]
    res = doc.get("result")
    if not res:
        return "\n".join(lines + [f"No result: {doc.get('error')}"])
    lines += [f"Model: GPT {res['size']} ({res['params'] / 1e6:.1f}M parameters), DeepSpeed ZeRO-3 fp32, "
              f"{res['world_size']} CPU ranks as 2 simulated nodes, micro-batch {res['micro_batch']}.", ""]
    rows = []
    for _key, a in sorted(doc["analysis"].items(), key=lambda kv: (kv[1]["interval"], MODES.index(kv[1]["mode"]))):
        ci = a["ratio_ci90"]
        rows.append([a["mode"], a["interval"], fmt_s(a["step_s"]["median"]), fmt_ratio(a["ratio_to_none"]),
                     f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else None, fmt_s(a["blocking_s"]["median"]),
                     fmt_pct(a["blocking_fraction_of_step"]), fmt_s(a["drain_s"]["median"]),
                     a["step_s"]["n"]])
    lines.append(md_table(["mode", "interval", "median step", "ratio to none", "90% CI", "blocking / ckpt",
                           "blocking / step", "drain per block", "steps"], rows))
    wide = [k for k, a in doc["analysis"].items()
            if a["ratio_ci90"] and a["ratio_ci90"][0] <= 1.0 <= a["ratio_ci90"][1]]
    below = [k for k, a in doc["analysis"].items() if a["ratio_ci90"] and a["ratio_ci90"][1] < 1.0]
    if below:
        lines += ["", f"Ratios below 1 ({', '.join(below)}): no checkpoint makes a step faster; these blocks ran while "
                  "other jobs on the machine eased off. Load drift of this size swamps the step-time ratios here."]
    if wide:
        lines += ["", "Step-time ratios whose 90% interval includes 1.0 (not resolved by this run): "
                  f"{', '.join(wide)}. "
                  "On a shared, loaded machine the blocking time per checkpoint is the robust comparison; the ratios "
                  "need more steps or a quiet machine."]
    if res.get("notes"):
        lines += ["", "Notes:"] + [f"- `{k}`: {v}" for k, v in res["notes"].items()]
    lines += ["", "Blocking per checkpoint: deadpool = the snapshot manager's `blocking_s` (hook + any wait for "
              "the previous copy); others = the save call plus the wait for the previous save (DCP future, "
              "decoupled commit inside the next step). Drain = work outstanding at the end of a block, done "
              "outside the step timer."]
    return "\n".join(lines)


def launcher(args: argparse.Namespace) -> int:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port, run_job

    preset = dict(PRESETS["quick" if args.quick else "full"])
    for key in ("size", "nproc", "micro_batch", "intervals", "rounds", "steps", "timeout_s"):
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    stem = args.name or ("peers_quick" if args.quick else "peers")
    out_dir = os.path.abspath(args.out)
    command = shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])
    tag = f"{os.getpid()}_{int(time.time())}"
    shm_root = os.path.join("/dev/shm", f"bench_peers.{tag}")
    scratch = tempfile.mkdtemp(prefix="bench_peers.", dir=args.scratch_root)
    result_file = os.path.join(scratch, "result.json")
    wargs = ["--worker", "--size", preset["size"], "--micro-batch", str(preset["micro_batch"]),
             "--intervals", str(preset["intervals"]), "--rounds", str(preset["rounds"]),
             "--steps-per-block", str(preset["steps"]), "--warmup-steps", str(preset["warmup_steps"]),
             "--modes", args.modes, "--shm-root", shm_root, "--scratch", scratch, "--result-file", result_file,
             "--job-id", f"peers{tag}", "--seed", str(args.seed), "--decoupled-writer", "auto"]
    cmd = Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=int(preset["nproc"]),
              port=free_port(), args=tuple(wargs)).argv()
    env = base_env({"CROSS_SIZE": "1", "CROSS_RANK": "0", "LOCAL_SIZE": str(preset["nproc"])})
    print(f"[peers] {shlex.join(cmd)}", flush=True)
    doc: dict[str, Any] = {"benchmark": "peers", "command": command, "machine": machine_info(), "settings": preset}
    t0 = time.time()
    os.makedirs(shm_root, exist_ok=True)
    try:
        job = run_job(cmd, timeout_s=float(preset["timeout_s"]), env=env)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    doc["job_wall_s"] = time.time() - t0
    log = os.path.join(out_dir, f"{stem}.log")
    write_text(log, job.output)
    doc["log"] = os.path.relpath(log, REPO)
    rc = 0
    if job.returncode == 0 and os.path.exists(result_file):
        with open(result_file) as fh:
            doc["result"] = json.load(fh)
        doc["analysis"] = analyze(doc["result"])
    else:
        rc = 1
        doc["error"] = (f"job {'timed out' if job.timed_out else f'exited rc={job.returncode}'}; log {doc['log']}: "
                        + " | ".join(job.output.splitlines()[-8:]))
        print(doc["error"], flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    write_json(os.path.join(out_dir, f"{stem}.json"), doc)
    write_text(os.path.join(out_dir, f"{stem}.md"), render_markdown(doc))
    print(f"[peers] wrote {stem}.json and {stem}.md in {out_dir}", flush=True)
    return rc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny GPT, 2 ranks, intervals 1,2")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--name", default=None, help="file stem (default peers[_quick])")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--intervals", default=None, help="checkpoint intervals, e.g. 1,4")
    p.add_argument("--size", default=None, choices=("tiny", "small", "medium"))
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per block")
    p.add_argument("--timeout-s", type=float, default=None)
    p.add_argument("--scratch-root", default=None, help="parent of the checkpoint directories (a real disk)")
    p.add_argument("--seed", type=int, default=1234)
    # worker mode (set by the launcher)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--shm-root", "--scratch", "--result-file", "--job-id", "--decoupled-writer"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--steps-per-block", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--warmup-steps", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--warmup-rounds", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m and m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launcher(args)


if __name__ == "__main__":  # the decoupled writer and DLRover's saver are spawned processes: keep this guard
    sys.exit(main())
