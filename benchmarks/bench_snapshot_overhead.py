#!/usr/bin/env python
"""Failure-free step time with a checkpoint every iteration (issue "memory tiers").

GPT small (~25M) and medium (~125M), DeepSpeed ZeRO-3 fp32 with torch Adam, 4 CPU ranks (torchrun), the same
byte-level data as the pretraining loop. One job per model size runs every mode side by side, interleaved
(A/B): each round runs a block of N steps of every mode, in an order that rotates from round to round, so
slow drift of the machine (other users, page cache, thermal) hits all modes alike. Modes:

* ``none``          no checkpointing (snapshot manager present but ``active = False``);
* ``deadpool``      deadpool_ext snapshots every step: tier 1 (two /dev/shm slots per rank, background copy)
                    and tier 2 (one replica on the other simulated node; ``simulate_nodes: 2``, factor 1);
* ``ds_default``    ``engine.save_checkpoint`` every step to local disk through DeepSpeed's
                    ``TorchCheckpointEngine`` (swapped into ``engine.checkpoint_engine``); older tags deleted;
* ``ds_decoupled``  the same call through DeepSpeed's ``DecoupledCheckpointEngine`` (a writer process per
                    rank; the engine commits the previous save inside the next ``engine.step``);
* ``dcp_async``     ``torch.distributed.checkpoint.async_save`` of the rank's state tensors (the same tensors
                    deadpool snapshots), waiting on the previous save's future first, as users do;
* ``dlrover_flash`` DLRover flash checkpoint into shared memory (``DeepSpeedCheckpointer``,
                    ``StorageType.MEMORY``; needs ``pip install dlrover==0.6.1``, else reported as not run).

CPU: per block, the process's CPU time (every thread: training, snapshot worker, gloo's threads) and the main
(training) thread's alone. After the interleaved run every rank measures the *floor* of a snapshot's CPU in the
same job: one plain copy of its captured tensors, one checksum pass over the copy, and one exchange of that many
bytes with its replica holder and source over a gloo group (the process's CPU, so gloo's threads count), all
ranks at once as in training. deadpool's extra CPU per step (its blocks' CPU minus ``none``'s) is reported beside
that floor.

Per step the wall time around forward + backward + ``engine.step`` (+ the save call) is taken on every rank;
the job's step time is the slowest rank's. At the end of each block the mode's outstanding work is drained
outside the step timer (deadpool ``wait_idle``, the decoupled commit, the DCP future, then ``os.sync``) and
timed separately, so it neither hides in nor leaks into another mode's block; the "amortized" figures add it
back. The first round(s) are warm-up and discarded.

Usage::

    python benchmarks/bench_snapshot_overhead.py --quick                      # tiny model, ~1 minute
    python benchmarks/bench_snapshot_overhead.py --sizes small,medium         # the real run (~20 min, 2 cores)

Writes ``benchmarks/results/snapshot_overhead.json`` and ``.md`` (``snapshot_overhead_quick.*`` for --quick).
The file runs itself under torchrun in ``--worker`` mode; don't call that mode by hand.
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
    bootstrap_median_ci,
    bootstrap_ratio_ci,
    dir_bytes,
    fmt_bytes,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    machine_info,
    md_table,
    median,
    process_memory,
    ratio,
    summarize,
    write_json,
    write_text,
)

MODES = ("none", "deadpool", "ds_default", "ds_decoupled", "dcp_async", "dlrover_flash")
# Diagnostic, not in the default set: deadpool with tier 2 switched off for the block (tier-1 cost alone), and
# deadpool with its worker thread at normal CPU priority for the block (snapshot.worker_priority: normal; the
# benchmark's deadpool section sets auto, idle with a boost while the step waits, so the two are compared).
EXTRA_MODES = ("deadpool_t1", "deadpool_normal")
NPROC = 4
REPLICATION_FACTOR = 1
SIMULATE_NODES = 2
BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")

# Per model size: micro-batch per rank, measured rounds, steps per block, warm-up steps per block, job deadline.
# Chosen from measured step times on the 2-core machine (4 ranks share 2 cores): see benchmarks/README.md.
# ``zero``: overrides of the ZeRO section. DeepSpeed's default reduce bucket (5e8 elements = 2 GB in fp32) and
# live-parameter budget (1e9) let a medium rank grow past 4 GB; 4 such ranks plus 1.5 GB of snapshots each
# did not fit in 24 GiB (a rank was OOM-killed), so medium uses smaller buckets (memory only, same math) and
# activation checkpointing (~1.3 GB less per rank, one extra forward per step: longer steps, which lowers every
# mode's ratio; reported in the results).
DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"micro_batch": 4, "rounds": 2, "steps": 2, "warmup_steps": 2, "timeout_s": 600, "zero": {},
             "activation_checkpointing": False},
    "small": {"micro_batch": 2, "rounds": 3, "steps": 4, "warmup_steps": 2, "timeout_s": 1500, "zero": {},
              "activation_checkpointing": False},
    "medium": {"micro_batch": 1, "rounds": 2, "steps": 2, "warmup_steps": 1, "timeout_s": 2400,
               "zero": {"reduce_bucket_size": 50_000_000, "stage3_max_live_parameters": 100_000_000},
               "activation_checkpointing": True},
}
TARGET_RATIO = 1.01
TARGET_CI_UPPER = 1.03
TARGET_CPU_OVER_FLOOR = 1.20
FLOOR_REPEATS = 5
TARGET_BLOCKING_FRACTION = 0.05


# ==================================================================================================
# worker (one per rank, under torchrun)
# ==================================================================================================
def _thread_cpu_s(native_id: int | None) -> float:
    if not native_id:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _system_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [float(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _remove_tags(directory: str, keep: set[str]) -> None:
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def worker(args: argparse.Namespace) -> int:
    import logging

    import psutil
    import torch
    import torch.distributed as dist

    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.training.data import ByteLMData, seed_everything
    from deadpool_ext.training.models import build_gpt, count_parameters, seq_len_for

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed()
    import torch.distributed.checkpoint as dcp
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine, create_checkpoint_engine
    from deepspeed.utils import groups as ds_groups
    from deepspeed.utils import logger as ds_logger

    from deadpool_ext import deepspeed as dpx

    ds_logger.setLevel(logging.WARNING)  # DeepSpeed logs every save at INFO; keep the job log readable
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = [m for m in args.modes.split(",") if m]

    with open(BASE_CONFIG) as fh:
        config = json.load(fh)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = 1
    config["zero_optimization"].update(json.loads(args.zero_overrides or "{}"))
    config["deadpool"] = {
        "enabled": True,
        "job_id": args.job_id,
        # the 20-pair results were measured at auto (idle with a boost), deadpool_normal beside it
        "snapshot": {"interval": 1, "worker_priority": "auto"},
        "replication": {"factor": REPLICATION_FACTOR},
        "local": {"shm_root": args.shm_root, "simulate_nodes": SIMULATE_NODES},
        "recovery": {"restore_on_start": False},
    }
    _deep_merge(config["deadpool"], json.loads(args.deadpool_overrides or "{}"))
    seed_everything(args.seed)
    model = build_gpt(args.size)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()  # recompute activations in backward: less memory, more compute
    n_params = count_parameters(model)
    t_init = time.perf_counter()
    engine, _, _, _ = dpx.initialize(model=model, config=config, model_parameters=model.parameters())
    init_s = time.perf_counter() - t_init
    runtime = engine.deadpool
    snaps = runtime.snapshots
    snaps.active = False
    adapter = runtime.adapter
    deadpool_ckpt_engine = engine.checkpoint_engine
    data = ByteLMData(seq_len=seq_len_for(args.size), seed=args.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    dp, dp_rank = engine.dp_world_size, dist.get_rank(group=engine.data_parallel_group)
    scratch = args.scratch
    notes: dict[str, str] = {}

    # -- mode setup ------------------------------------------------------------------------------------
    torch_ckpt_engine = TorchCheckpointEngine(engine._config)
    decoupled = None
    decoupled_info: dict[str, Any] = {}
    if "ds_decoupled" in modes:
        decoupled, decoupled_info = _make_decoupled(engine, args, create_checkpoint_engine, ds_groups, dist)
        ok = torch.tensor([1 if decoupled is not None else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok.item()):
            reasons = [None] * world
            dist.all_gather_object(reasons, decoupled_info.get("error"))
            notes["ds_decoupled"] = "not run: " + "; ".join(sorted({f"{r}" for r in reasons if r}))
            modes.remove("ds_decoupled")
            if decoupled is not None:
                decoupled.cleanup()
                decoupled = None
    dcp_group = dist.new_group(backend="gloo") if "dcp_async" in modes else None
    dlrover = None
    if "dlrover_flash" in modes:
        error = None
        try:
            from common import make_dlrover_checkpointer

            dlrover, notes["dlrover_flash_shim"] = make_dlrover_checkpointer(
                engine, os.path.join(scratch, "dlrover_flash"))
        except Exception as exc:  # noqa: BLE001 - recorded in the results instead of a number
            error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok.item()):
            reasons = [None] * world
            dist.all_gather_object(reasons, error)
            notes["dlrover_flash"] = "not run: " + "; ".join(sorted({f"{r}" for r in reasons if r}))
            modes.remove("dlrover_flash")
            dlrover = None
    commit_times: list[float] = []
    if decoupled is not None:
        original_commit = engine._commit_decoupled_checkpoint

        def timed_commit() -> None:
            t0 = time.perf_counter()
            original_commit()
            commit_times.append(time.perf_counter() - t0)

        engine._commit_decoupled_checkpoint = timed_commit  # the engine calls it inside step(); we time it

    dirs = {m: os.path.join(scratch, m) for m in ("ds_default", "ds_decoupled", "dcp_async", "dlrover_flash")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    dcp_state = {"future": None, "ids": []}
    tags: dict[str, list[str]] = {"ds_default": [], "ds_decoupled": [], "dlrover_flash": []}

    peers_factor = snaps.peers.factor
    default_priority = snaps.priority.level

    def begin(mode: str) -> None:
        if mode == "deadpool":
            snaps.active = True
        elif mode == "deadpool_t1":
            snaps.active = True
            snaps.peers.factor = 0  # PeerReplicator.replicate returns at once: tier 1 (+ commit) only
        elif mode == "deadpool_normal":
            snaps.active = True
            snaps.priority.set_level("normal")
        elif mode in ("ds_default", "dlrover_flash"):
            # DLRover's checkpointer calls engine.save_checkpoint with torch.save redirected to shared memory,
            # so the engine must write through torch.save (the stock engine), not deadpool's.
            engine.checkpoint_engine = torch_ckpt_engine
        elif mode == "ds_decoupled":
            engine.checkpoint_engine = decoupled

    def save(mode: str, step: int) -> tuple[float, float]:
        """The checkpoint call of one step, inside the step timer: (save call seconds, wait seconds)."""
        if mode in ("ds_default", "ds_decoupled"):
            tag = f"global_step{step}"
            t0 = time.perf_counter()
            engine.save_checkpoint(dirs[mode], tag=tag)
            tags[mode].append(tag)
            return time.perf_counter() - t0, 0.0
        if mode == "dlrover_flash":
            from common import dlrover_save_memory

            tag = f"global_step{step}"
            t0 = time.perf_counter()
            dlrover_save_memory(dlrover, dirs[mode], tag)
            return time.perf_counter() - t0, 0.0
        if mode == "dcp_async":
            t0 = time.perf_counter()
            if dcp_state["future"] is not None:
                dcp_state["future"].result()
            t1 = time.perf_counter()
            sd = {f"r{rank}.{name}": t for name, t in adapter.tensors()}
            ckpt_id = os.path.join(dirs[mode], f"step{step}")
            dcp_state["future"] = dcp.async_save(sd, checkpoint_id=ckpt_id, process_group=dcp_group)
            dcp_state["ids"].append(ckpt_id)
            return time.perf_counter() - t1, t1 - t0
        return 0.0, 0.0

    def housekeeping(mode: str) -> None:
        """Outside the step timer: bound disk use (rank 0 deletes versions that are complete everywhere)."""
        if rank != 0:
            return
        if mode == "ds_default":
            _remove_tags(dirs[mode], set(tags[mode][-1:]))
        elif mode == "ds_decoupled":
            _remove_tags(dirs[mode], set(tags[mode][-2:]))  # newest is in flight, the one before just committed
        elif mode == "dcp_async":
            for old in dcp_state["ids"][:-2]:  # the previous save's future completed on rank 0: older are done
                shutil.rmtree(old, ignore_errors=True)
            dcp_state["ids"] = dcp_state["ids"][-2:]

    def drain(mode: str) -> float:
        t0 = time.perf_counter()
        if mode in ("deadpool", "deadpool_t1", "deadpool_normal"):
            snaps.wait_idle()
        elif mode == "ds_decoupled":
            original_commit()
        elif mode == "dcp_async" and dcp_state["future"] is not None:
            dcp_state["future"].result()
            dcp_state["future"] = None
        if mode in ("ds_default", "ds_decoupled", "dcp_async"):
            os.sync()  # dirty pages of this block's files must not be written back during another mode's block
        return time.perf_counter() - t0

    def end(mode: str) -> None:
        if mode in ("deadpool", "deadpool_t1", "deadpool_normal"):
            snaps.active = False
            snaps.peers.factor = peers_factor
            if mode == "deadpool_normal":
                snaps.priority.set_level(default_priority)
        elif mode in ("ds_default", "ds_decoupled", "dlrover_flash"):
            engine.checkpoint_engine = deadpool_ckpt_engine
        if rank == 0 and mode in ("ds_default", "ds_decoupled"):
            _remove_tags(dirs[mode], set(tags[mode][-1:]))

    def train_step() -> float:
        first = int(engine.global_samples) + dp_rank * micro
        ids, labels = data.gpt_batch(first, micro)
        loss = engine(input_ids=ids.to(engine.device), labels=labels.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach().item())

    def children_rss() -> int:
        total = 0
        pids = {decoupled.ckpt_process.pid} if decoupled is not None and decoupled.ckpt_process is not None else set()
        for p in psutil.Process().children(recursive=True):
            if p.pid in pids:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        return total

    # -- the interleaved run ---------------------------------------------------------------------------
    engine.train()
    blocks: list[dict[str, Any]] = []
    n_rounds = args.warmup_rounds + args.rounds
    snap_thread = getattr(snaps, "_thread", None)
    snap_tid = snap_thread.native_id if snap_thread is not None else None
    dist.barrier()
    t_run = time.perf_counter()
    for r in range(n_rounds):
        warm = r < args.warmup_rounds
        n_steps = args.warmup_steps if warm else args.steps_per_block
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            begin(mode)
            blk: dict[str, Any] = {"round": r, "mode": mode, "warmup": warm, "step_s": [], "save_s": [], "wait_s": [],
                                   "loss": [], "first_step": int(engine.global_steps) + 1}
            snap_i0 = len(snaps._stats["blocking_s"])
            commit_i0 = len(commit_times)
            cpu0, thr0, sys0, wall0 = time.process_time(), _thread_cpu_s(snap_tid), _system_cpu(), time.perf_counter()
            main0 = time.thread_time()
            for _ in range(n_steps):
                t0 = time.perf_counter()
                loss = train_step()
                save_s, wait_s = save(mode, int(engine.global_steps))
                dt = time.perf_counter() - t0
                blk["step_s"].append(dt)
                blk["save_s"].append(save_s)
                blk["wait_s"].append(wait_s)
                blk["loss"].append(loss)
                housekeeping(mode)
            blk["drain_s"] = drain(mode)
            wall1, sys1 = time.perf_counter(), _system_cpu()
            blk["block_wall_s"] = wall1 - wall0
            blk["cpu_s"] = time.process_time() - cpu0
            blk["main_thread_cpu_s"] = time.thread_time() - main0
            blk["snapshot_thread_cpu_s"] = _thread_cpu_s(snap_tid) - thr0
            blk["machine_busy_fraction"] = (sys1[0] - sys0[0]) / max(1e-9, sys1[1] - sys0[1])
            blk["snap_range"] = [snap_i0, len(snaps._stats["blocking_s"])]
            # The engine calls the commit inside every step() while the decoupled engine is in place: step i
            # commits save i-1 (step 1 of a block finds nothing to commit: the previous block was drained).
            blk["commit_s"] = commit_times[commit_i0:]
            if mode == "ds_decoupled":
                for i, c in enumerate(blk["commit_s"][:n_steps]):  # one call per step; the first is a no-op
                    blk["wait_s"][i] += c
            blk["memory"] = dict(process_memory(), children_rss=children_rss())
            end(mode)
            blocks.append(blk)
            if rank == 0:
                _progress(args, f"[bench] {args.size} round {r}{' (warm-up)' if warm else ''} {mode:>12}: "
                      f"median step {median(blk['step_s']):.3f} s, drain {blk['drain_s']:.3f} s, "
                      f"loss {blk['loss'][-1]:.3f}, rank-0 RSS {blk['memory'].get('rss', 0) / 2**30:.2f} GiB "
                      f"(peak {blk['memory'].get('hwm', 0) / 2**30:.2f}), "
                      f"machine busy {blk['machine_busy_fraction']:.0%}")
    run_s = time.perf_counter() - t_run
    floor = _cpu_floor(snaps, adapter, dist, torch)
    if rank == 0:
        _progress(args, f"[bench] {args.size} floor (rank 0): copy {floor['copy_cpu_s'] * 1e3:.1f} ms, checksum "
                        f"{floor['checksum_cpu_s'] * 1e3:.1f} ms, exchange {floor['exchange_cpu_s'] * 1e3:.1f} ms CPU")

    # Per-snapshot stats are appended by the manager (blocking_s of a snapshot grows when the *next* step
    # waits for its copy), so they are read only now.
    st = snaps._stats
    state_tensors = adapter.tensors()  # after training: torch Adam creates exp_avg/exp_avg_sq at the first step
    state_bytes = sum(t.numel() * t.element_size() for _, t in state_tensors)
    for blk in blocks:
        a, b = blk.pop("snap_range")
        blk["snapshots"] = {k: list(st[k][a:b]) for k in ("blocking_s", "copy_s", "seal_s", "replicate_s", "commit_s")}
    rank_info = {
        "rank": rank, "node": snaps.node, "state_bytes": state_bytes, "state_tensors": len(state_tensors),
        "captured_bytes": sum(t.numel() * t.element_size() for _, t in adapter.captured()),
        "shm_bytes": snaps.memory_bytes(), "slot_bytes": [s.nbytes for s in snaps.slots if s is not None],
        "replica_bytes": snaps.peers.held_nbytes(), "replica_sources": list(snaps.peers.sources),
        "replica_buffers_per_source": getattr(snaps.peers, "nbuf", 1),
        "holders": list(snaps.peers.holders.get(rank, ())) if snaps.peers.factor else [],
        "init_s": init_s, "memory_end": process_memory(), "blocks": blocks, "cpu_floor": floor,
        "checksum_fused": bool(st.get("checksum_fused")),
        "decoupled": decoupled_info,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rank_info)
    shm_job_bytes = dir_bytes(args.shm_root) if rank == 0 else None

    if decoupled is not None:
        engine.checkpoint_engine = deadpool_ckpt_engine
        decoupled.cleanup()
    runtime.close()
    if rank == 0:
        result = {
            "size": args.size, "params": n_params, "seq_len": seq_len_for(args.size), "micro_batch": micro,
            "world_size": world, "dp": dp, "zero_stage": adapter.zero_stage, "dtype": "fp32",
            "activation_checkpointing": bool(args.activation_checkpointing),
            "optimizer": "torch Adam (torch_adam: true)",
            "layout": {"nproc": world, "simulated_nodes": SIMULATE_NODES, "replication_factor": REPLICATION_FACTOR,
                       "nodes": {str(g["rank"]): g["node"] for g in gathered}},
            "schedule": {"modes": modes, "warmup_rounds": args.warmup_rounds, "warmup_steps": args.warmup_steps,
                         "rounds": args.rounds, "steps_per_block": args.steps_per_block,
                         "order": "rotating: round r starts with modes[r % len(modes)]"},
            "run_s": run_s, "shm_job_bytes_end": shm_job_bytes, "notes": notes,
            "deepspeed_config": {k: v for k, v in config.items() if k != "deadpool"},
            "deadpool_config": config["deadpool"],
            "deadpool_config_effective": runtime.config.to_dict(),  # with defaults, e.g. replica double-buffering
            "machine": machine_info(), "ranks": gathered,
        }
        write_json(args.result_file, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _cpu_floor(snaps: Any, adapter: Any, dist: Any, torch: Any) -> dict[str, Any]:
    """The CPU a snapshot cannot avoid, measured on this rank with every rank doing the same at once: one plain
    copy of the captured tensors into one buffer, one xxh3 pass over that buffer, and one exchange of that many
    bytes with this rank's replica holder(s) and source(s) over a gloo group (process CPU: gloo's threads and the
    kernel's work on its sockets count). Medians over FLOOR_REPEATS; collective (every rank calls it)."""
    from deadpool_ext.snapshot import format as fmt

    captured = [t for _, t in adapter.captured()]
    nbytes = sum(t.numel() * t.element_size() for t in captured)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    flat = [fmt._byte_view(t) for t in captured]
    holders = list(snaps.peers.holders.get(snaps.rank, ())) if snaps.peers.factor else []
    sources = list(snaps.peers.sources) if snaps.peers.factor else []
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, nbytes)
    group = dist.new_group(backend="gloo")
    inbox = {src: torch.empty(sizes[src], dtype=torch.uint8) for src in sources}
    out: dict[str, Any] = {"captured_bytes": nbytes, "holders": holders, "sources": sources}
    copy_s, hash_s, xchg_s = [], [], []
    for _ in range(FLOOR_REPEATS):
        dist.barrier()
        t0 = time.thread_time()
        pos = 0
        for u8 in flat:
            buf[pos:pos + u8.numel()].copy_(u8)
            pos += u8.numel()
        t1 = time.thread_time()
        fmt.bytes_checksum(buf.numpy())
        copy_s.append(t1 - t0)
        hash_s.append(time.thread_time() - t1)
        dist.barrier()
        c0 = time.process_time()
        ops = [dist.P2POp(dist.isend, buf, h, group) for h in holders]
        ops += [dist.P2POp(dist.irecv, inbox[src], src, group) for src in sources]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        xchg_s.append(time.process_time() - c0)
    dist.destroy_process_group(group)
    out.update(copy_cpu_s=median(copy_s), checksum_cpu_s=median(hash_s), exchange_cpu_s=median(xchg_s),
               copy_cpu_s_all=copy_s, checksum_cpu_s_all=hash_s, exchange_cpu_s_all=xchg_s)
    out["total_cpu_s"] = out["copy_cpu_s"] + out["checksum_cpu_s"] + out["exchange_cpu_s"]
    return out


def _deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def _make_decoupled(engine: Any, args: argparse.Namespace, create_checkpoint_engine: Any, groups: Any,
                    dist: Any) -> tuple[Any, dict[str, Any]]:
    """DeepSpeed's DecoupledCheckpointEngine, built by DeepSpeed's own factory with a writer config, then probed
    with a one-tensor save + commit so that a writer process that cannot start is found before the benchmark."""
    import copy

    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
    from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config

    info: dict[str, Any] = {"env": {k: os.environ.get(k) for k in ("CROSS_SIZE", "CROSS_RANK", "LOCAL_SIZE")}}
    writer = args.decoupled_writer
    if writer == "auto":
        if AsyncIOBuilder().is_compatible(verbose=False):
            writer = "fast"
        else:
            writer = "python"
            info["writer_note"] = ("DeepSpeed's default writer type FAST needs the async_io op, which is not "
                                   "compatible here (libaio-dev missing); used writer type PYTHON")
    info["writer_type"] = writer
    try:
        missing = [k for k in ("CROSS_SIZE", "CROSS_RANK", "LOCAL_SIZE") if k not in os.environ]
        if missing:
            raise RuntimeError(f"environment variables {missing} not set (the decoupled writer reads them)")
        cfg = copy.copy(engine._config)
        cfg.checkpoint_config = get_checkpoint_config({"checkpoint": {"writer": {"type": writer, "decoupled": True}}})
        t0 = time.perf_counter()
        eng = create_checkpoint_engine(config_params=cfg, groups=groups, zero_stage=engine.zero_optimization_stage(),
                                       has_moe_layers=engine.has_moe_layers,
                                       optimize_dp_state=not engine.zero_optimization_partition_weights())
        info["engine"] = type(eng).__name__
        if not eng.is_decoupled():
            raise RuntimeError(f"create_checkpoint_engine returned {type(eng).__name__}, not a decoupled engine")
        probe_dir = os.path.join(args.scratch, "decoupled_probe")
        probe = CheckpointCommitInfo(tag="probe", save_dir=probe_dir, save_latest=False)
        os.makedirs(os.path.join(probe_dir, "probe"), exist_ok=True)
        eng.create(probe)
        eng.save({"x": torch.zeros(4)}, os.path.join(probe_dir, "probe", f"rank{dist.get_rank()}.pt"))
        eng.commit(probe)
        info["start_and_probe_s"] = time.perf_counter() - t0
        info["writer_pid"] = eng.ckpt_process.pid if eng.ckpt_process is not None else None
        return eng, info
    except Exception as exc:  # noqa: BLE001 - recorded in the results instead of a number
        info["error"] = f"{type(exc).__name__}: {exc}"
        return None, info


# ==================================================================================================
# analysis (rank 0's result file -> summary)
# ==================================================================================================
def analyze(res: dict[str, Any]) -> dict[str, Any]:
    ranks = res["ranks"]
    modes = res["schedule"]["modes"]
    n_blocks = len(ranks[0]["blocks"])
    # Job step time = slowest rank's time for that step (ranks are in lock-step through ZeRO-3 collectives).
    blocks = []
    for i in range(n_blocks):
        per_rank = [rk["blocks"][i] for rk in ranks]
        b0 = per_rank[0]
        steps = [max(vals) for vals in zip(*(b["step_s"] for b in per_rank))]
        blocks.append({
            "round": b0["round"], "mode": b0["mode"], "warmup": b0["warmup"], "step_s": steps,
            "drain_s": max(b["drain_s"] for b in per_rank),
            "blocking_s": [max(v) for v in zip(*([s + w for s, w in zip(b["save_s"], b["wait_s"])] for b in per_rank))],
            "per_rank": per_rank,
        })
    measured = [b for b in blocks if not b["warmup"]]

    def steps_of(mode: str) -> list[float]:
        return [s for b in measured if b["mode"] == mode for s in b["step_s"]]

    def amortized(mode: str) -> list[float]:
        return [(sum(b["step_s"]) + b["drain_s"]) / len(b["step_s"]) for b in measured if b["mode"] == mode]

    base = summarize(steps_of("none"))
    base_amort = median(amortized("none"))
    rounds = sorted({b["round"] for b in measured})
    out: dict[str, Any] = {"modes": {}}
    for mode in modes:
        s = summarize(steps_of(mode))
        paired = []
        for r in rounds:
            mb = [b for b in measured if b["round"] == r and b["mode"] == mode]
            nb = [b for b in measured if b["round"] == r and b["mode"] == "none"]
            if mb and nb:
                paired.append(median(mb[0]["step_s"]) / median(nb[0]["step_s"]))
        per_rank_blocks = [pb for b in measured if b["mode"] == mode for pb in b["per_rank"]]
        m: dict[str, Any] = {
            "step_s": s,
            "ratio_to_none": ratio(s["median"], base["median"]),
            "ratio_ci90": bootstrap_ratio_ci(steps_of(mode), steps_of("none")) if mode != "none" else None,
            "ratio_p90_to_none_median": ratio(s["p90"], base["median"]),
            "paired_round_ratios": paired,
            "paired_ratio_median": median(paired),
            "paired_ratio_ci90": bootstrap_median_ci(paired) if mode != "none" else None,
            "amortized_step_s_median": median(amortized(mode)),
            "amortized_ratio_to_none": ratio(median(amortized(mode)), base_amort),
            "drain_s": summarize([b["drain_s"] for b in measured if b["mode"] == mode]),
            "cpu_s_per_step_per_rank": median([pb["cpu_s"] / len(pb["step_s"]) for pb in per_rank_blocks]),
            "main_thread_cpu_s_per_step_per_rank": median(
                [pb["main_thread_cpu_s"] / len(pb["step_s"]) for pb in per_rank_blocks if "main_thread_cpu_s" in pb]),
            "cpu_s_per_step_by_rank": [median([b["per_rank"][i]["cpu_s"] / len(b["step_s"]) for b in measured
                                               if b["mode"] == mode]) for i in range(len(ranks))],
            "machine_busy_fraction": median([pb["machine_busy_fraction"] for pb in per_rank_blocks]),
            "rank_rss_bytes_max": max((pb["memory"]["rss"] for pb in per_rank_blocks), default=None),
            "rank_rss_shmem_bytes_max": max((pb["memory"].get("rss_shmem", 0) for pb in per_rank_blocks), default=None),
            "children_rss_bytes_max": max((pb["memory"]["children_rss"] for pb in per_rank_blocks), default=None),
            "steps_measured": s["n"],
        }
        if mode in ("deadpool", "deadpool_t1", "deadpool_normal"):
            snap = {k: [v for pb in per_rank_blocks for v in pb["snapshots"][k]]
                    for k in ("blocking_s", "copy_s", "seal_s", "replicate_s", "commit_s")}
            blocking = summarize(snap["blocking_s"])
            m["blocking_s"] = blocking
            m["background_s"] = {k: summarize(v) for k, v in snap.items() if k != "blocking_s"}
            m["snapshot_thread_cpu_s_per_snapshot"] = median(
                [pb["snapshot_thread_cpu_s"] / max(1, len(pb["snapshots"]["copy_s"])) for pb in per_rank_blocks])
            m["snapshots_measured_per_rank"] = len(snap["blocking_s"]) // max(1, len(ranks))
        elif mode != "none":
            vals = [v for pb in per_rank_blocks for v in (s_ + w for s_, w in zip(pb["save_s"], pb["wait_s"]))]
            m["blocking_s"] = summarize(vals)
            m["save_call_s"] = summarize([v for pb in per_rank_blocks for v in pb["save_s"]])
            m["wait_prev_s"] = summarize([v for pb in per_rank_blocks for v in pb["wait_s"]])
        if "blocking_s" in m:
            m["blocking_fraction_of_step"] = ratio(m["blocking_s"]["median"], base["median"])
            m["blocking_max_fraction_of_step"] = ratio(m["blocking_s"]["max"], base["median"])
        out["modes"][mode] = m

    mem = []
    for rk in ranks:
        mem.append({"rank": rk["rank"], "node": rk["node"], "state_bytes": rk["state_bytes"],
                    "shm_bytes": rk["shm_bytes"], "slot_bytes": rk["slot_bytes"], "replica_bytes": rk["replica_bytes"],
                    "replica_sources": rk["replica_sources"], "holders": rk["holders"],
                    # runs before this field existed: infer it from the bytes (replicas are slot-sized)
                    "replica_buffers_per_source": rk.get("replica_buffers_per_source") or (
                        round(rk["replica_bytes"] / (len(rk["replica_sources"]) * rk["slot_bytes"][0]))
                        if rk["replica_sources"] and rk["slot_bytes"] else 0),
                    "ratio": rk["shm_bytes"] / rk["state_bytes"], "rss_end": rk["memory_end"].get("rss"),
                    # the tensor bytes alone: every buffer holds the captured state (runs before derive_params
                    # captured all of it)
                    "captured_bytes": rk.get("captured_bytes", rk["state_bytes"]),
                    "data_ratio": (len(rk["slot_bytes"]) + rk["replica_bytes"] // max(rk["slot_bytes"][0], 1)
                                   if rk["slot_bytes"] else 0) * rk.get("captured_bytes", rk["state_bytes"])
                    / rk["state_bytes"],
                    "hwm": rk["memory_end"].get("hwm")})
    bound = 2 + res["layout"]["replication_factor"]
    out["memory"] = {"per_rank": mem, "bound_ratio": bound, "max_ratio": max(x["ratio"] for x in mem),
                     "max_data_ratio": max(x["data_ratio"] for x in mem),
                     "shm_job_bytes_end": res.get("shm_job_bytes_end")}
    dp = out["modes"].get("deadpool", {})
    out["targets"] = {
        # the paired ratio (each round's deadpool block against that round's none block) cancels the machine's
        # drift between rounds; its CI is a bootstrap over the rounds
        "ratio": {"target": TARGET_RATIO, "value": dp.get("paired_ratio_median"), "ci90": dp.get("paired_ratio_ci90"),
                  "met": dp.get("paired_ratio_median") is not None and dp["paired_ratio_median"] <= TARGET_RATIO,
                  # resolved: the whole 90% interval is on one side of the target
                  "resolved": bool(dp.get("paired_ratio_ci90")) and not (dp["paired_ratio_ci90"][0] <= TARGET_RATIO
                                                                         < dp["paired_ratio_ci90"][1])},
        "blocking": {"target": TARGET_BLOCKING_FRACTION, "value": dp.get("blocking_fraction_of_step"),
                     "met": dp.get("blocking_fraction_of_step") is not None
                     and dp["blocking_fraction_of_step"] <= TARGET_BLOCKING_FRACTION},
        # The bound counts copies of the state's tensors; every buffer also carries its header and the small
        # non-tensor state (tens of KiB: layout, checksums, counters, RNG), reported beside it.
        "memory": {"target": bound, "value": out["memory"]["max_data_ratio"],
                   "with_headers": out["memory"]["max_ratio"],
                   # at the precision reported: Adam's 4-byte step counter per group is state too (+4e-8)
                   "met": round(out["memory"]["max_data_ratio"], 4) <= bound},
    }
    out["cpu"] = _cpu_analysis(ranks, out["modes"])
    if out["cpu"]:
        out["targets"]["ratio_ci_upper"] = {
            "target": TARGET_CI_UPPER, "value": (dp.get("paired_ratio_ci90") or [None, None])[1],
            "met": bool(dp.get("paired_ratio_ci90")) and dp["paired_ratio_ci90"][1] <= TARGET_CI_UPPER}
        out["targets"]["cpu_over_floor"] = {
            "target": TARGET_CPU_OVER_FLOOR, "value": out["cpu"]["extra_over_floor"],
            "met": out["cpu"]["extra_over_floor"] is not None
            and out["cpu"]["extra_over_floor"] <= TARGET_CPU_OVER_FLOOR}
    out["blocks"] = [{k: v for k, v in b.items() if k != "per_rank"} for b in blocks]
    return out


def _cpu_analysis(ranks: list[dict[str, Any]], modes: dict[str, Any]) -> dict[str, Any] | None:
    """deadpool's extra CPU per step per rank (its blocks' process CPU minus ``none``'s, rank by rank, median over
    ranks) beside the floor measured in the same job; bytes moved through memory per snapshot beside the floor's."""
    if "deadpool" not in modes or not all("cpu_floor" in rk for rk in ranks):
        return None
    dp, base = modes["deadpool"]["cpu_s_per_step_by_rank"], modes["none"]["cpu_s_per_step_by_rank"]
    extra = median([a - b for a, b in zip(dp, base) if a is not None and b is not None])
    floors = [rk["cpu_floor"] for rk in ranks]
    floor = median([f["total_cpu_s"] for f in floors])
    captured = median([f["captured_bytes"] for f in floors]) or 0
    replicas = median([len(f["holders"]) for f in floors]) or 0
    fused = all(rk.get("checksum_fused") for rk in ranks)
    # Memory traffic per snapshot per rank: the copy reads and writes the captured bytes once; a checksum pass
    # of its own reads them again (none when hashed in the copy's pass, from cache); each replica sent reads them
    # once more (from the sealed slot: no staging copy). The floor: one copy plus one send per replica.
    touched = captured * (2 + (0 if fused else 1) + replicas)
    floor_bytes = captured * (2 + replicas)
    return {
        "extra_cpu_s_per_step_per_rank": extra,
        "cpu_ratio_to_none": ratio(modes["deadpool"]["cpu_s_per_step_per_rank"],
                                   modes["none"]["cpu_s_per_step_per_rank"]),
        "floor_cpu_s": floor,
        "floor_parts_s": {k: median([f[k] for f in floors]) for k in ("copy_cpu_s", "checksum_cpu_s",
                                                                       "exchange_cpu_s")},
        "extra_over_floor": ratio(extra, floor),
        "checksum_fused": fused,
        "bytes_touched_per_snapshot": touched,
        "bytes_floor_per_snapshot": floor_bytes,
        "bytes_over_floor": ratio(touched, floor_bytes),
        "main_thread_extra_cpu_s": (modes["deadpool"]["main_thread_cpu_s_per_step_per_rank"] or 0)
        - (modes["none"]["main_thread_cpu_s_per_step_per_rank"] or 0),
    }


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# Snapshot overhead: failure-free step time, checkpoint every iteration", ""]
    lines.append(f"Command: `{doc['command']}`  ")
    m = doc.get("machine", {})
    v = m.get("versions", {})
    lines.append(f"Machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model')}), "
                 f"{fmt_bytes(m.get('mem_total_bytes'))} RAM, load at start {m.get('loadavg')}; "
                 f"torch {v.get('torch')}, deepspeed {v.get('deepspeed')}, transformers {v.get('transformers')}; "
                 f"git {str((m.get('git') or {}).get('commit'))[:10]}"
                 f"{' (dirty)' if (m.get('git') or {}).get('dirty') else ''}; "
                 f"{m.get('time_utc')}.")
    lines.append("")
    lines.append("Step time = slowest rank's wall time around forward + backward + `engine.step` (+ the save call), "
                 "median over the measured steps; modes interleaved in rotating rounds inside one job, warm-up round "
                 "discarded. *Ratio* = median / `none` median. *Paired* = median over rounds of the per-round ratio. "
                 "*90% CI*: percentile bootstrap over the steps of the mode and of `none` (how well so few steps "
                 "resolve the ratio). "
                 "*Amortized* adds each block's drain (outstanding save work + `os.sync`, taken outside the step "
                 "timer) back, spread over the block's steps. *Blocking* = time the training thread waits per "
                 "checkpoint (deadpool: `blocking_s` of the snapshot manager; others: the save call + the wait for "
                 "the previous save), as a fraction of the `none` median step.")
    lines.append("")
    for size, entry in doc["sizes"].items():
        if "error" in entry:
            lines += [f"## {size}: FAILED", "", f"```\n{entry['error']}\n```", ""]
            continue
        res, an = entry["result"], entry["analysis"]
        sch = res["schedule"]
        lines.append(f"## {size}: {res['params'] / 1e6:.1f}M params, seq {res['seq_len']}, "
                     f"micro-batch {res['micro_batch']}"
                     f"/rank, {res['world_size']} ranks ZeRO-{res['zero_stage']} {res['dtype']}, "
                     f"{res['layout']['simulated_nodes']} simulated nodes, replication factor "
                     f"{res['layout']['replication_factor']}")
        lines.append("")
        zero = {k: v for k, v in res["deepspeed_config"]["zero_optimization"].items() if k != "stage"}
        lines.append(f"ZeRO overrides: {zero or 'none'}; activation checkpointing: "
                     f"{'on' if res.get('activation_checkpointing') else 'off'}; deadpool section: "
                     f"`{json.dumps({k: v for k, v in res['deadpool_config'].items() if k != 'job_id'})}`"
                     + ("; effective replication settings "
                        f"`{json.dumps(res['deadpool_config_effective']['replication'])}`"
                        if res.get("deadpool_config_effective") else "") + ".")
        lines.append("")
        lines.append(f"{sch['rounds']} measured rounds x {sch['steps_per_block']} steps per mode "
                     f"(+ {sch['warmup_rounds']} "
                     f"warm-up round x {sch['warmup_steps']} steps); job wall time {entry.get('job_wall_s', 0):.0f} s.")
        lines.append("")
        rows = []
        for mode, mm in an["modes"].items():
            b = mm.get("blocking_s") or {}
            rows.append([
                mode, fmt_s(mm["step_s"]["median"]), fmt_s(mm["step_s"]["p90"]), fmt_ratio(mm["ratio_to_none"]),
                "[{:.3f}, {:.3f}]".format(*mm["ratio_ci90"]) if mm.get("ratio_ci90") else None,
                fmt_ratio(mm["paired_ratio_median"]),
                "[{:.3f}, {:.3f}]".format(*mm["paired_ratio_ci90"]) if mm.get("paired_ratio_ci90") else None,
                fmt_ratio(mm["amortized_ratio_to_none"]),
                f"{fmt_s(b.get('median'))} / {fmt_s(b.get('max'))}" if b else None,
                fmt_pct(mm.get("blocking_fraction_of_step")),
                fmt_s(mm["drain_s"]["median"]), f"{mm['cpu_s_per_step_per_rank']:.3f} s",
                fmt_s(mm.get("main_thread_cpu_s_per_step_per_rank")),
                fmt_bytes(mm["rank_rss_bytes_max"]),
                fmt_bytes(mm["children_rss_bytes_max"]) if mm["children_rss_bytes_max"] else None,
            ])
        lines.append(md_table(["mode", "median step", "p90 step", "ratio", "ratio 90% CI", "paired", "paired 90% CI",
                               "amortized", "blocking med / max", "blocking % step", "drain", "CPU/step/rank",
                               "main thread CPU/step", "rank RSS max", "writer RSS"], rows))
        lines.append("")
        for mode, note in res.get("notes", {}).items():
            lines.append(f"- `{mode}`: {note}")
        dec = res["ranks"][0].get("decoupled") or {}
        if dec.get("writer_note"):
            lines.append(f"- `ds_decoupled`: {dec['writer_note']}.")
        dpm = an["modes"].get("deadpool")
        for name in ("deadpool", "deadpool_t1", "deadpool_normal"):
            if name not in an["modes"]:
                continue
            mm = an["modes"][name]
            bg = mm["background_s"]
            lines.append(f"- `{name}` background work per snapshot (medians): copy {fmt_s(bg['copy_s']['median'])}, "
                         f"seal (checksums) {fmt_s(bg['seal_s']['median'])}, "
                         f"replicate {fmt_s(bg['replicate_s']['median'])}, "
                         f"commit {fmt_s(bg['commit_s']['median'])}; snapshot thread CPU "
                         f"{fmt_s(mm['snapshot_thread_cpu_s_per_snapshot'])} per snapshot (excludes gloo's own "
                         f"threads); machine busy {fmt_pct(mm['machine_busy_fraction'], 0)} (none: "
                         f"{fmt_pct(an['modes']['none']['machine_busy_fraction'], 0)}).")
        mem = an["memory"]
        r0 = mem["per_rank"][0]
        lines.append(f"- memory per rank: state {fmt_bytes(r0['state_bytes'])} ({r0['state_bytes']} B); /dev/shm "
                     f"{fmt_bytes(r0['shm_bytes'])} = 2 slots x "
                     f"{fmt_bytes(r0['slot_bytes'][0] if r0['slot_bytes'] else None)}"
                     f" + replicas of {len(r0['replica_sources'])} source(s) x "
                     f"{r0.get('replica_buffers_per_source', 1)} "
                     f"buffer(s) {fmt_bytes(r0['replica_bytes'])}; max ratio over ranks "
                     f"{mem['max_ratio']:.4f} x state (bound {mem['bound_ratio']}); whole job's shm dir "
                     f"{fmt_bytes(mem['shm_job_bytes_end'])}. Each buffer holds the captured state, "
                     f"{fmt_bytes(r0['captured_bytes'])} ({r0['captured_bytes'] / r0['state_bytes']:.4f} of the state; "
                     f"the parameter buffers are re-derived from the masters at restore), plus header and small state "
                     f"{fmt_bytes(r0['slot_bytes'][0] - r0['captured_bytes']) if r0['slot_bytes'] else None}; "
                     f"tensor data alone: {mem['max_data_ratio']:.4f} x state.")
        cpu = an.get("cpu")
        if cpu:
            fp = cpu["floor_parts_s"]
            lines.append(f"- CPU (deadpool): {fmt_s(cpu['extra_cpu_s_per_step_per_rank'])} extra per step per rank "
                         f"(process CPU x{fmt_ratio(cpu['cpu_ratio_to_none'])} of `none`; of it the training thread "
                         f"{fmt_s(cpu['main_thread_extra_cpu_s'])}); floor measured in this job "
                         f"{fmt_s(cpu['floor_cpu_s'])} = copy {fmt_s(fp['copy_cpu_s'])} + checksum "
                         f"{fmt_s(fp['checksum_cpu_s'])} + exchange with the replica peer(s) "
                         f"{fmt_s(fp['exchange_cpu_s'])}: extra / floor = {fmt_ratio(cpu['extra_over_floor'], 2)}.")
            lines.append(f"- memory traffic per snapshot per rank: {fmt_bytes(cpu['bytes_touched_per_snapshot'])} "
                         f"(copy read + write, "
                         f"{'checksums in the copy pass' if cpu['checksum_fused'] else 'a checksum pass'}, "
                         f"one read per replica sent from the sealed slot) against the floor's "
                         f"{fmt_bytes(cpu['bytes_floor_per_snapshot'])} (one copy, one send per replica): "
                         f"x{fmt_ratio(cpu['bytes_over_floor'], 2)}.")
        lines.append("")
        lines.append("Targets (deadpool):")
        lines.append("")
        t = an["targets"]
        verdict = "met" if t["ratio"]["met"] else "not met"
        if not t["ratio"].get("resolved"):
            verdict += " (point estimate; the 90% CI straddles the target, so this run does not resolve it)"
        lines.append(f"- paired step-time ratio <= {TARGET_RATIO}: **{verdict}** "
                     f"({fmt_ratio(t['ratio']['value'])}, 90% bootstrap CI over rounds "
                     f"{'[{:.3f}, {:.3f}]'.format(*t['ratio']['ci90']) if t['ratio'].get('ci90') else None}; "
                     f"ratio of medians {fmt_ratio(dpm['ratio_to_none']) if dpm else None}, "
                     f"amortized {fmt_ratio(dpm['amortized_ratio_to_none']) if dpm else None})")
        if "ratio_ci_upper" in t:
            lines.append(f"- upper bound of that CI <= {TARGET_CI_UPPER}: "
                         f"**{'met' if t['ratio_ci_upper']['met'] else 'not met'}** "
                         f"({fmt_ratio(t['ratio_ci_upper']['value'])})")
            lines.append(f"- extra CPU within {TARGET_CPU_OVER_FLOOR - 1:.0%} of its floor: "
                         f"**{'met' if t['cpu_over_floor']['met'] else 'not met'}** "
                         f"(x{fmt_ratio(t['cpu_over_floor']['value'], 2)})")
        lines.append(f"- blocking time <= {TARGET_BLOCKING_FRACTION:.0%} of a step: "
                     f"**{'met' if t['blocking']['met'] else 'not met'}** "
                     f"({fmt_pct(t['blocking']['value'], 2)} median, "
                     f"{fmt_pct(dpm['blocking_max_fraction_of_step'], 2) if dpm else None} max)")
        lines.append(f"- memory <= (2 + {res['layout']['replication_factor']}) x state: "
                     f"**{'met' if t['memory']['met'] else 'not met'}** for the state's bytes "
                     f"({mem['max_data_ratio']:.4f} x); with each buffer's header and small state "
                     "(counters, scheduler, "
                     f"RNG: {fmt_bytes(r0['slot_bytes'][0] - r0['captured_bytes']) if r0['slot_bytes'] else None}) "
                     f"{mem['max_ratio']:.4f} x")
        lines.append("")
    return "\n".join(lines)


# ==================================================================================================
# launcher
# ==================================================================================================
def reanalyze(path: str) -> int:
    """Recompute the analysis and markdown of an existing results JSON (e.g. after changing the analysis)."""
    with open(path) as fh:
        doc = json.load(fh)
    for entry in doc["sizes"].values():
        if "result" in entry:
            entry["analysis"] = analyze(entry["result"])
    write_json(path, doc)
    md_path = os.path.splitext(path)[0] + ".md"
    write_text(md_path, render_markdown(doc))
    print(f"[bench] rewrote {path} and {md_path}")
    return 0


def launcher(args: argparse.Namespace) -> int:
    from deadpool_ext.testing.launch import base_env, free_port, run_job, torchrun_cmd

    sizes = ["tiny"] if args.quick else [s for s in args.sizes.split(",") if s]
    out_dir = os.path.abspath(args.out)
    stem = args.name or ("snapshot_overhead_quick" if args.quick else "snapshot_overhead")
    if not stem.startswith("snapshot_overhead"):
        raise SystemExit("--name must start with snapshot_overhead")
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    command = shlex.join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else "python",
                          os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])
    doc: dict[str, Any] = {"benchmark": "snapshot_overhead", "command": command, "machine": machine_info(),
                           "targets": {"ratio": TARGET_RATIO, "blocking_fraction": TARGET_BLOCKING_FRACTION,
                                       "memory": "(2 + replication factor) x state"},
                           "sizes": {}}
    rc = 0
    for size in sizes:
        d = dict(DEFAULTS[size])
        if args.quick:
            d.update(rounds=2, steps=2, warmup_steps=2)
        if args.zero_overrides is not None:
            d["zero"] = json.loads(args.zero_overrides)
        if args.activation_checkpointing is not None:
            d["activation_checkpointing"] = args.activation_checkpointing
        for key, val in (("micro_batch", args.micro_batch), ("rounds", args.rounds), ("steps", args.steps_per_block),
                         ("warmup_steps", args.warmup_steps), ("timeout_s", args.timeout_s)):
            if val is not None:
                d[key] = val
        tag = f"{os.getpid()}_{int(time.time())}"
        shm_root = os.path.join("/dev/shm", f"bench_snapshot_overhead.{tag}")
        scratch = tempfile.mkdtemp(prefix=f"bench_snapshot_overhead.{size}.", dir=args.scratch_root)
        result_file = os.path.join(scratch, "result.json")
        wargs = ["--worker", "--size", size, "--micro-batch", str(d["micro_batch"]), "--rounds", str(d["rounds"]),
                 "--steps-per-block", str(d["steps"]), "--warmup-rounds", str(args.warmup_rounds),
                 "--warmup-steps", str(d["warmup_steps"]), "--modes", args.modes, "--shm-root", shm_root,
                 "--scratch", scratch, "--result-file", result_file, "--job-id", f"bench{tag}",
                 "--decoupled-writer", args.decoupled_writer, "--seed", str(args.seed),
                 "--zero-overrides", json.dumps(d["zero"]), "--deadpool-overrides", args.deadpool_overrides or "{}"]
        if d["activation_checkpointing"]:
            wargs.append("--activation-checkpointing")
        cmd = torchrun_cmd(args.nproc, os.path.abspath(__file__), wargs, port=free_port())
        env = base_env({"CROSS_SIZE": "1", "CROSS_RANK": "0", "LOCAL_SIZE": str(args.nproc)})
        print(f"[bench] {size}: {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        os.makedirs(shm_root, exist_ok=True)
        try:
            job = run_job(cmd, timeout_s=d["timeout_s"], env=env, while_running=_echo_progress(scratch, d["timeout_s"]))
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
        entry: dict[str, Any] = {"torchrun_cmd": shlex.join(cmd), "job_wall_s": time.time() - t0,
                                 "returncode": job.returncode, "timed_out": job.timed_out}
        log_path = os.path.join(out_dir, f"{stem}_{size}.log")
        write_text(log_path, job.output)
        entry["log"] = os.path.relpath(log_path, REPO)
        if job.returncode == 0 and os.path.exists(result_file):
            with open(result_file) as fh:
                res = json.load(fh)
            entry["result"] = res
            entry["analysis"] = analyze(res)
        else:
            rc = 1
            tail = "\n".join(job.output.splitlines()[-40:])
            how = ("timed out after " + str(d["timeout_s"]) + " s" if job.timed_out
                   else "exited rc=" + str(job.returncode))
            entry["error"] = (f"job {how}; "
                              f"log {entry['log']}; last lines:\n{tail}")
            print(entry["error"], flush=True)
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        doc["sizes"][size] = entry
        write_json(json_path, doc)
        write_text(md_path, render_markdown(doc))
        if "analysis" in entry:
            _print_summary(size, entry)
    print(f"[bench] wrote {os.path.relpath(json_path, REPO)} and {os.path.relpath(md_path, REPO)}", flush=True)
    return rc


def _progress(args: argparse.Namespace, line: str) -> None:
    """Rank 0's progress line: to the job log and to a file the launcher echoes while the job runs."""
    print(line, flush=True)
    with open(os.path.join(args.scratch, "progress.log"), "a") as fh:
        fh.write(line + "\n")


def _echo_progress(scratch: str, timeout_s: float):
    """run_job's ``while_running`` hook: print the worker's progress lines until the job ends or the deadline
    passes (run_job then reaps the tree)."""
    def hook(proc: Any) -> None:
        path, pos, deadline = os.path.join(scratch, "progress.log"), 0, time.time() + timeout_s
        while proc.poll() is None and time.time() < deadline:
            time.sleep(1.0)
            if os.path.exists(path):
                with open(path) as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                    pos = fh.tell()
                if chunk:
                    print(chunk, end="", flush=True)

    return hook


def _print_summary(size: str, entry: dict[str, Any]) -> None:
    an = entry["analysis"]
    print(f"[bench] {size} (job {entry['job_wall_s']:.0f} s):", flush=True)
    for mode, mm in an["modes"].items():
        b = mm.get("blocking_s") or {}
        print(f"    {mode:>12}: median {mm['step_s']['median']:.3f} s  ratio {mm['ratio_to_none']:.3f}  "
              f"paired {mm['paired_ratio_median'] or float('nan'):.3f}  "
              f"amortized {mm['amortized_ratio_to_none'] or float('nan'):.3f}"
              + (f"  blocking {b['median'] * 1000:.1f} ms ({100 * mm['blocking_fraction_of_step']:.2f}%)" if b else ""),
              flush=True)
    t = an["targets"]
    print(f"    targets: ratio {t['ratio']['value']:.3f} {'met' if t['ratio']['met'] else 'NOT met'}; "
          f"blocking {100 * t['blocking']['value']:.2f}% {'met' if t['blocking']['met'] else 'NOT met'}; "
          f"memory {t['memory']['value']:.4f}x {'met' if t['memory']['met'] else 'NOT met'}", flush=True)
    cpu = an.get("cpu")
    if cpu:
        print(f"    CPU: extra {cpu['extra_cpu_s_per_step_per_rank'] * 1e3:.1f} ms/step/rank, floor "
              f"{cpu['floor_cpu_s'] * 1e3:.1f} ms, extra/floor {cpu['extra_over_floor'] or float('nan'):.2f}",
              flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,medium", help="comma-separated model sizes (tiny, small, medium)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 rounds x 2 steps (~1 minute)")
    p.add_argument("--steps-per-block", type=int, default=None, help="steps per mode per round (default: per size)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default: per size)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds discarded as warm-up")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps per mode in a warm-up round")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (default: per size)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of " + ",".join(MODES + EXTRA_MODES) + " (must include none)")
    p.add_argument("--nproc", type=int, default=NPROC, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--decoupled-writer", choices=("auto", "fast", "python"), default="auto",
                   help="writer type of the decoupled engine; auto = fast if the async_io op works, else python")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of one size's job (default: per size)")
    p.add_argument("--name", default=None, help="results file stem (default snapshot_overhead[_quick])")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--scratch-root", default=None,
                   help="parent of the local-disk checkpoint directory (default: $TMPDIR)")
    p.add_argument("--keep-scratch", action="store_true", help="keep checkpoint directories after the run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--reanalyze", metavar="JSON", default=None,
                   help="recompute analysis and markdown of an existing results file, run nothing")
    p.add_argument("--zero-overrides", default=None,
                   help="JSON merged into the zero_optimization section (default: per size, see DEFAULTS)")
    p.add_argument("--deadpool-overrides", default=None,
                   help="JSON deep-merged into the deadpool section, "
                        'e.g. \'{"replication": {"double_buffer": false}}\'')
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward (default: per size)")
    # worker mode (set by the launcher)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--shm-root", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--job-id", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for m in args.modes.split(","):
        if m and m not in MODES + EXTRA_MODES:
            p.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES + EXTRA_MODES)}")
    if "none" not in args.modes.split(","):
        p.error("--modes must include none (the baseline every ratio is taken against)")
    if args.worker:
        if args.warmup_steps is None:
            args.warmup_steps = 2
        if args.steps_per_block is None or args.rounds is None:
            p.error("worker mode needs --steps-per-block and --rounds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyze:
        return reanalyze(args.reanalyze)
    return worker(args) if args.worker else launcher(args)


if __name__ == "__main__":  # the guard matters: the decoupled writer's spawned process re-imports this file
    sys.exit(main())
