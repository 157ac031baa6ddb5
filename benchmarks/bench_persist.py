#!/usr/bin/env python
"""Tier 3 (TierCheck base checkpoints persisted in the background): bandwidth, time to a persisted base,
foreground overhead, storage overhead.

GPT small (and medium with ``--sizes small,medium``), DeepSpeed ZeRO-3 fp32 with torch Adam, 4 CPU ranks under
torchrun. One job per size, in three phases:

1. **disk bandwidth, same run**: every rank writes as many bytes as its share of a base, in 8 MiB chunks from a
   pre-touched buffer, fsyncs and renames (what the writer does, minus serialisation); bandwidth = all bytes /
   slowest rank's time (``dd``-like, ``conv=fsync``). ``--pairs`` times (default 3).
2. **persist throughput, idle**: a base captured and persisted with training paused, right after each phase-1
   measurement (paired, because the shared machine's load drifts by 2-5x within minutes); throughput = base
   bytes / (commit record written - capture start). Target: median of the paired ratios >= 80%.
3. **A/B interleaved**: rounds of two blocks of ``steps`` steps each, ``none`` (no tier 3) and ``tier3`` (a base
   captured at the block's first step, persisted in the background with the adaptive throttle while the block's
   steps run), order alternating per round. Step time = slowest rank's wall time around forward + backward +
   ``engine.step`` (the capture call itself is timed separately: that is what blocks the training thread).
   The base must be published before the block ends or the block waits for it outside the step timer (logged).

Usage::

    python benchmarks/bench_persist.py --quick            # tiny model, ~1 minute
    python benchmarks/bench_persist.py                    # GPT small (~5-8 min on 2 shared cores)

Writes ``benchmarks/results/persist.json`` and ``persist.md`` (``persist_quick.*`` for --quick). The file runs
itself under torchrun in ``--worker`` mode.
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
    fmt_bytes,
    fmt_ratio,
    fmt_s,
    machine_info,
    md_table,
    median,
    ratio,
    summarize,
    write_json,
    write_text,
)

NPROC = 4
BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"micro_batch": 4, "rounds": 2, "steps": 4, "timeout_s": 400},
    "small": {"micro_batch": 2, "rounds": 3, "steps": 3, "timeout_s": 900},
    "medium": {"micro_batch": 1, "rounds": 2, "steps": 2, "timeout_s": 1500},
}
TARGET_THROUGHPUT_FRACTION = 0.80


# ==================================================================================================
# worker (one per rank, under torchrun)
# ==================================================================================================
def worker(args: argparse.Namespace) -> int:
    import logging

    import torch
    import torch.distributed as dist

    from deadpool_ext.config import PersistConfig
    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.integrations.deepspeed.tier3 import Tier3Persister
    from deadpool_ext.persist.layout import COMMIT, version_tag
    from deadpool_ext.training.data import ByteLMData, seed_everything
    from deadpool_ext.training.models import build_gpt, count_parameters, seq_len_for

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed()
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    logging.getLogger("deadpool_ext").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(BASE_CONFIG) as fh:
        config = json.load(fh)
    config.pop("deadpool", None)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    seed_everything(args.seed)
    model = build_gpt(args.size)
    n_params = count_parameters(model)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    url = os.path.join(args.scratch, "tier3")
    persister = Tier3Persister(engine, PersistConfig(url=url, interval=0, keep_last=2, adaptive=not args.no_adaptive,
                                                     max_mb_s=args.max_mb_s, timeout_s=600))
    data = ByteLMData(seq_len=seq_len_for(args.size), seed=args.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    dp_rank = dist.get_rank(group=engine.data_parallel_group)

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def progress(line: str) -> None:
        if rank == 0:
            print(f"[bench_persist] {line}", flush=True)

    def train_step() -> float:
        t0 = time.perf_counter()
        first = int(engine.global_samples) + dp_rank * micro
        ids, labels = data.gpt_batch(first, micro)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        persister.throttle.observe_step(dt)  # the adaptive throttle's input, as after_step() would feed it
        return slowest(dt)

    def base_now() -> tuple[float, dict[str, Any]]:
        """Capture a base at the current step (collective); returns (slowest capture time, coordinator job)."""
        t0 = time.perf_counter()
        assert persister.save(int(engine.global_steps)), "writer still busy"
        return slowest(time.perf_counter() - t0), {"t0_wall": time.time() - (time.perf_counter() - t0)}

    def wait_published(step: int, timeout_s: float = 600) -> float:
        """Block until the base of ``step`` is published (polls the commit record); returns its wall time."""
        path = os.path.join(url, version_tag(step), COMMIT)
        deadline = time.time() + timeout_s
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"base {step} not published in {timeout_s}s")
            time.sleep(0.01)
        persister.writer.wait_idle(timeout_s)
        t = torch.tensor([os.path.getmtime(path)], dtype=torch.float64)
        dist.broadcast(t, src=0)
        return float(t.item())

    # warm-up: two steps (first steps allocate everything)
    for _ in range(2):
        train_step()

    # -- phases 1 + 2, paired: disk bandwidth right before each idle base (the machine's load drifts) -----
    persister.save(int(engine.global_steps))  # one base to learn its size (also warms the staging pool)
    wait_published(int(engine.global_steps))
    rank_bytes = int(persister.writer.history[-1]["rank_bytes"])
    buf = os.urandom(8 << 20)
    disk, idle = [], []
    for attempt in range(args.pairs):
        dist.barrier()
        path = os.path.join(args.scratch, f"dd.{rank}.{attempt}")
        t0 = time.perf_counter()
        with open(path + ".tmp", "wb") as fh:
            left = rank_bytes
            while left > 0:
                n = min(left, len(buf))
                fh.write(buf[:n])
                left -= n
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
        dt = slowest(time.perf_counter() - t0)
        disk.append(rank_bytes * world / dt)
        os.unlink(path)
        progress(f"disk write bandwidth {disk[-1] / 1e6:.0f} MB/s ({world} parallel writers x "
                 f"{rank_bytes / 1e6:.0f} MB, fsync)")
        train_step()
        step = int(engine.global_steps)
        t_start = time.time()
        cap, _ = base_now()
        published = wait_published(step)
        hist = persister.writer.history[-1] if rank == 0 else {}
        total = int(hist.get("total_bytes", 0))
        t_start = slowest(-t_start) * -1  # earliest capture start across ranks
        idle.append({"step": step, "capture_s": cap, "time_to_persist_s": published - t_start,
                     "total_bytes": total, "verify_s": hist.get("verify_s"), "disk_B_s": disk[-1]})
        progress(f"idle base {step}: {total / 1e6:.0f} MB persisted in {published - t_start:.2f} s "
                 f"({total / max(published - t_start, 1e-9) / 1e6:.0f} MB/s, "
                 f"{total / max(published - t_start, 1e-9) / disk[-1] * 100:.0f}% of the disk just before), "
                 f"capture {cap * 1000:.0f} ms")

    # -- phase 3: A/B interleaved --------------------------------------------------------------------------
    blocks: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ["none", "tier3"] if rnd % 2 == 0 else ["tier3", "none"]
        for mode in order:
            steps, capture, t_persist, waited = [], None, None, 0.0
            start_step = int(engine.global_steps) + 1
            t_start = 0.0
            for i in range(args.steps_per_block):
                steps.append(train_step())
                if mode == "tier3" and i == 0:
                    t_start = time.time()
                    capture, _ = base_now()
            if mode == "tier3":
                t_wait = time.perf_counter()
                published = wait_published(start_step)
                waited = slowest(time.perf_counter() - t_wait)
                t_persist = published - t_start
            blocks.append({"round": rnd, "mode": mode, "step_times_s": steps, "capture_s": capture,
                           "time_to_persist_s": t_persist, "waited_after_block_s": waited,
                           "throttle": persister.throttle.stats()})
            progress(f"round {rnd} {mode}: median step {median(steps):.3f} s"
                     + (f", capture {capture * 1000:.0f} ms, base persisted {t_persist:.2f} s after capture"
                        f" (block waited {waited:.2f} s)" if mode == "tier3" else ""))

    hist = persister.writer.history
    persister.close()
    if rank == 0:
        version_dir = os.path.join(url, sorted(d for d in os.listdir(url) if d.startswith("global_step"))[-1])
        on_disk = sum(os.path.getsize(os.path.join(version_dir, f)) for f in os.listdir(version_dir))
        state_bytes = sum(c["bytes"] for c in persister.captures[-1:]) * world
        result = {"size": args.size, "params": n_params, "world_size": world, "micro_batch": micro,
                  "rank_bytes": rank_bytes, "disk_bw_B_s": disk, "idle": idle, "blocks": blocks,
                  "on_disk_bytes": on_disk, "state_bytes_handed_to_save": state_bytes,
                  "adam_fp32_state_bytes": 12 * n_params, "writer_history": hist,
                  "staging_bytes_per_rank": persister.pool.allocated_bytes}
        with open(args.result_file, "w") as fh:
            json.dump(result, fh, default=str)
    dist.barrier()
    return 0


# ==================================================================================================
# analysis and report
# ==================================================================================================
def analyze(res: dict[str, Any]) -> dict[str, Any]:
    bw = median(res["disk_bw_B_s"])
    idle_tp = [i["total_bytes"] / i["time_to_persist_s"] for i in res["idle"] if i["time_to_persist_s"]]
    paired = [i["total_bytes"] / i["time_to_persist_s"] / i["disk_B_s"] for i in res["idle"] if i["time_to_persist_s"]]
    none = [t for b in res["blocks"] if b["mode"] == "none" for t in b["step_times_s"]]
    t3 = [t for b in res["blocks"] if b["mode"] == "tier3" for t in b["step_times_s"]]
    caps = [b["capture_s"] for b in res["blocks"] if b["mode"] == "tier3"]
    ttp = [b["time_to_persist_s"] for b in res["blocks"] if b["mode"] == "tier3"]
    base_bytes = res["idle"][-1]["total_bytes"]
    return {
        "disk_bw_MB_s": bw / 1e6,
        "persist_idle_MB_s": median(idle_tp) / 1e6 if idle_tp else None,
        "persist_fraction_of_disk": median(paired) if paired else None,
        "persist_fraction_of_disk_pairs": paired,
        "disk_bw_MB_s_all": [b / 1e6 for b in res["disk_bw_B_s"]],
        "persist_training_MB_s": median(base_bytes / t for t in ttp if t) / 1e6 if ttp else None,
        "time_to_persisted_base_idle_s": median(i["time_to_persist_s"] for i in res["idle"]),
        "time_to_persisted_base_training_s": median(ttp) if ttp else None,
        "capture_s": summarize(caps),
        "step_none_s": summarize(none), "step_tier3_s": summarize(t3),
        "step_ratio": ratio(median(t3), median(none)),
        "step_ratio_ci90": bootstrap_ratio_ci(t3, none),
        # mean step with each block's capture spread over its steps, vs mean step without tier 3
        "step_ratio_amortized_mean": ratio((sum(t3) + sum(caps)) / max(1, len(t3)), sum(none) / max(1, len(none))),
        "base_bytes": base_bytes, "on_disk_bytes": res["on_disk_bytes"],
        "storage_overhead_vs_handed": res["on_disk_bytes"] / max(1, res["state_bytes_handed_to_save"]) - 1,
        "on_disk_per_param_B": res["on_disk_bytes"] / res["params"],
        "waited_after_blocks_s": [b["waited_after_block_s"] for b in res["blocks"] if b["mode"] == "tier3"],
    }


def render_markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    out = ["# Tier 3: base checkpoints persisted in the background\n",
           f"Command: `{doc['command']}`  \nMachine: {m.get('cpu_model')}, {m.get('cpu_count')} CPUs, load "
           f"{m.get('loadavg')}; git {m.get('git', {}).get('commit', '?')[:10]}; shared with other engineers' "
           f"tests (noisy). 4 ranks (torchrun), ZeRO-3 fp32, torch Adam, tier 3 on local disk (fsync).\n"]
    rows = []
    for size, e in doc["sizes"].items():
        a = e.get("analysis")
        if not a:
            rows.append([size, "failed: see JSON"] + [""] * 9)
            continue
        ci = a["step_ratio_ci90"]
        rows.append([size, f"{e['result']['params'] / 1e6:.1f}M", f"{a['disk_bw_MB_s']:.0f}",
                     f"{a['persist_idle_MB_s']:.0f} ({a['persist_fraction_of_disk'] * 100:.0f}%)",
                     f"{a['persist_training_MB_s']:.0f}" if a["persist_training_MB_s"] else None,
                     fmt_s(a["time_to_persisted_base_idle_s"], 2), fmt_s(a["time_to_persisted_base_training_s"], 2),
                     fmt_s(a["capture_s"]["median"]),
                     f"{fmt_ratio(a['step_ratio'])}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""),
                     fmt_bytes(a["on_disk_bytes"]), f"{a['storage_overhead_vs_handed'] * 100:+.2f}%"])
    out.append(md_table(["model", "params", "disk MB/s (same run)", "persist MB/s idle (median % of paired disk)",
                         "persist MB/s while training", "time to persisted base, idle",
                         "time to persisted base, training", "capture (blocks step)", "step ratio tier3/none [90% CI]",
                         "base on disk", "on disk vs bytes handed to save"], rows))
    out.append(f"\nTarget: persist throughput >= {TARGET_THROUGHPUT_FRACTION:.0%} of the disk bandwidth measured in "
               "the same run (idle case: nothing else competes for the writer).\n")
    out.append("How to read it: *disk MB/s* is 4 parallel writers writing the same bytes as a base with fsync "
               "(no serialisation). *Persist MB/s idle* is a whole base from capture to commit record (torch.save "
               "streaming, xxh3, fsync, rename, manifests, coordinator publish) with training paused. *While "
               "training* the adaptive throttle deliberately slows the writer when it stretches the step, so that "
               "number is lower by design. *Capture* is the only time the training thread blocks: DeepSpeed's "
               "save_checkpoint with the state copied into reused host buffers. The step ratio excludes the "
               "capture (reported separately) and compares steps taken while a base was being written against "
               "steps without tier 3, interleaved in one run. On-disk overhead: torch.save zip framing plus our "
               "JSON manifests over the tensor bytes DeepSpeed hands to save (ZeRO-3 fp32: fp32 master + two "
               "Adam moments + partitioned params = 16 B/param).\n")
    for size, e in doc["sizes"].items():
        if e.get("analysis"):
            a = e["analysis"]
            out.append(f"\n## {size}\n\n```json\n{json.dumps(a, indent=1, default=str)}\n```\n")
    return "\n".join(out)


def launcher(args: argparse.Namespace) -> int:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port, run_job

    sizes = ["tiny"] if args.quick else [s for s in args.sizes.split(",") if s]
    stem = "persist_quick" if args.quick else "persist"
    out_dir = os.path.abspath(args.out)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    command = shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])
    doc: dict[str, Any] = {"benchmark": "persist", "command": command, "machine": machine_info(),
                           "targets": {"persist_fraction_of_disk": TARGET_THROUGHPUT_FRACTION}, "sizes": {}}
    rc = 0
    for size in sizes:
        d = dict(DEFAULTS[size])
        if args.rounds:
            d["rounds"] = args.rounds
        if args.steps_per_block:
            d["steps"] = args.steps_per_block
        scratch = tempfile.mkdtemp(prefix=f"bench_persist.{size}.", dir=args.scratch_root)
        result_file = os.path.join(scratch, "result.json")
        wargs = ["--worker", "--size", size, "--micro-batch", str(d["micro_batch"]), "--rounds", str(d["rounds"]),
                 "--steps-per-block", str(d["steps"]), "--scratch", scratch, "--result-file", result_file,
                 "--seed", str(args.seed), "--max-mb-s", str(args.max_mb_s), "--pairs", str(args.pairs)]
        if args.no_adaptive:
            wargs.append("--no-adaptive")
        cmd = Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=args.nproc, port=free_port(),
                  args=tuple(wargs)).argv()
        print(f"[bench_persist] {size}: {shlex.join(cmd)}", flush=True)
        t0 = time.time()

        job = run_job(cmd, timeout_s=d["timeout_s"], env=base_env())
        entry: dict[str, Any] = {"torchrun_cmd": shlex.join(cmd), "job_wall_s": time.time() - t0,
                                 "returncode": job.returncode, "timed_out": job.timed_out}
        write_text(os.path.join(out_dir, f"{stem}_{size}.log"), job.output)
        log_lines = [line for line in job.output.splitlines()
                     if line.startswith("[bench_persist]") or "Error" in line]
        entry["progress"] = log_lines[-60:]
        print("\n".join(log_lines), flush=True)
        if job.returncode == 0 and os.path.exists(result_file):
            with open(result_file) as fh:
                entry["result"] = json.load(fh)
            entry["analysis"] = analyze(entry["result"])
        else:
            rc = 1
            entry["error"] = "\n".join(job.output.splitlines()[-40:])
            print(entry["error"], flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
        doc["sizes"][size] = entry
        write_json(json_path, doc)
        write_text(md_path, render_markdown(doc))
    print(f"[bench_persist] wrote {os.path.relpath(json_path, REPO)} and {os.path.relpath(md_path, REPO)}", flush=True)
    return rc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="tiny model, a minute")
    p.add_argument("--sizes", default="small", help="comma list of tiny,small,medium")
    p.add_argument("--nproc", type=int, default=NPROC)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps-per-block", type=int, default=None)
    p.add_argument("--pairs", type=int, default=3, help="paired (disk bandwidth, idle base) measurements")
    p.add_argument("--max-mb-s", type=float, default=0.0, help="persist.max_mb_s for the run")
    p.add_argument("--no-adaptive", action="store_true", help="persist.adaptive false")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--scratch-root", default=None, help="where tier 3 writes (default: the temp dir's disk)")
    # worker-only
    p.add_argument("--size", default="tiny")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--scratch", default=None)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launcher(args)


if __name__ == "__main__":
    sys.exit(main())
