"""Megatron-Core path: snapshot overhead (A/B interleaved in one run) and hot-swap recovery time.

    nice -n 10 python benchmarks/bench_megatron.py            # both parts, ~5-10 min on 2 cores
    nice -n 10 python benchmarks/bench_megatron.py --quick    # fewer steps

Part 1, overhead: one torchrun job (4 ranks, PP2 x DP2, GPT ``--size``, default small ~25M) alternates blocks
of steps with snapshots on (tier 1 + tier 2 replica on the other simulated node) and off
(``SnapshotManager.active``); ratio = median step time on / off with a bootstrap 90% CI. One run, so machine
load drifts hit both sides alike.

Part 2, recovery: ``deadpool-run --nnodes 2 --nproc-per-node 2 --spare-nodes 1`` (TP2 x DP2, tiny), one worker
SIGKILLed at step 5; per-phase times from the recovery timeline (detect / agree / rebuild / restore /
recompute), and losses compared with an uninterrupted torchrun run.

Results: benchmarks/results/megatron.json and megatron.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402
    RESULTS_DIR,
    bootstrap_ratio_ci,
    fmt_ratio,
    fmt_s,
    git_info,
    machine_info,
    md_table,
    median,
    summarize,
    write_json,
    write_text,
)


# -- part 1: worker (runs under torchrun) ----------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from deadpool_ext.config import DeadpoolConfig
    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.integrations.megatron import parallel
    from deadpool_ext.integrations.megatron.layout import Layout, coordinates
    from deadpool_ext.integrations.megatron.runtime import MegatronRuntime
    from deadpool_ext.training.data import ByteLMData
    from deadpool_ext.training.megatron.model import ModelSpec, build, count_parameters
    from deadpool_ext.training.megatron.step import forward_backward, global_mean_loss, microbatches

    parallel.apply_cpu_shims()
    init_distributed()
    layout = Layout(world_size=dist.get_world_size(), tp=args.tp, pp=args.pp)
    total = args.warmup + 2 * args.blocks * args.block
    spec = ModelSpec(size=args.size, train_iters=total, num_microbatches=max(args.pp, 1))
    cfg = DeadpoolConfig.from_dict({"local": {"simulate_nodes": 2, "shm_root": args.shm_root},
                                    "recovery": {"restore_on_start": False}})
    parallel.initialize(layout, 1234)
    gb = spec.micro_batch * spec.num_microbatches * layout.dp
    rt = MegatronRuntime(build(spec, 1234), cfg, layout, coordinates(dist.get_rank(), layout), seed=1234,
                         global_batch=gb, micro_batch=spec.micro_batch)
    data = ByteLMData(seq_len=spec.seq_len + 1, seed=1234)
    times: dict[str, list[float]] = {"on": [], "off": []}
    plan = ["warm"] * args.warmup + [m for _ in range(args.blocks) for m in ("on", "off") for _ in range(args.block)]
    for mode in plan:
        rt.snapshots.active = mode != "off"
        t0 = time.perf_counter()
        b = microbatches(data, rt.progress.consumed_samples, spec.micro_batch, spec.num_microbatches, layout.dp,
                         rt.coords.dp)
        out = forward_backward(rt.built.chunks, rt.built.optimizer, b, spec.seq_len, spec.micro_batch)
        rt.step()
        global_mean_loss(out, spec.num_microbatches)
        dt = time.perf_counter() - t0
        if mode in times:
            times[mode].append(dt)
    st = rt.stats()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"times": times, "params_rank0": count_parameters(rt.built.chunks),
                                      "snapshot_stats": st}), flush=True)
    rt.close()
    dist.barrier()


def overhead(args: argparse.Namespace) -> dict:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, run_job

    shm = f"/dev/shm/dp-bench-mg-{os.getpid()}"
    os.makedirs(shm, exist_ok=True)
    try:
        cmd = Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=4, port=free_port(),
                  args=("--worker", "--tp", "1", "--pp", "2", "--size", args.size, "--blocks", str(args.blocks),
                        "--block", str(args.block), "--warmup", "2", "--shm-root", shm)).argv()
        t0 = time.time()
        res = run_job(cmd, timeout_s=900)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    line = [ln for ln in res.output.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not line:
        raise SystemExit(f"overhead run failed (rc {res.returncode}):\n{res.output[-3000:]}")
    r = json.loads(line[0][len("RESULT "):])
    on, off = r["times"]["on"], r["times"]["off"]
    lo, hi = bootstrap_ratio_ci(on, off)
    return {"layout": "PP2 x DP2 (4 ranks, 2 simulated nodes)", "model_size": args.size,
            "params_rank0": r["params_rank0"], "on": summarize(on), "off": summarize(off),
            "ratio_median": median(on) / median(off), "ratio_ci90": [lo, hi], "wall_s": time.time() - t0,
            "snapshot_blocking_s_median": r["snapshot_stats"].get("blocking_s_median"),
            "snapshot_copy_s_median": r["snapshot_stats"].get("copy_s_median"),
            "snapshot_replicate_s_median": r["snapshot_stats"].get("replicate_s_median"),
            "memory_bytes_rank0": r["snapshot_stats"].get("memory_bytes")}


# -- part 2: recovery ------------------------------------------------------------------------------------
def recovery(args: argparse.Namespace, workdir: str) -> dict:
    from deadpool_ext.recovery.timeline import phases, read_events
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, read_metrics, run_job, wait_for_step
    from tests.integration.helpers import worker_proc

    iters = 12
    layout = ["--tensor-model-parallel-size", "2", "--model-size", "tiny", "--train-iters", str(iters)]
    base_m = os.path.join(workdir, "base.jsonl")
    res = run_job(Job(launcher="torchrun", script="scripts/pretrain_gpt_megatron.py", nproc_per_node=4,
                      port=free_port(), args=(*layout, "--metrics-out", base_m)).argv(), timeout_s=600)
    if res.returncode != 0:
        raise SystemExit(f"baseline failed:\n{res.output[-3000:]}")
    m = os.path.join(workdir, "swap.jsonl")
    tl = os.path.join(workdir, "swap.timeline.jsonl")
    job = Job(script="scripts/pretrain_gpt_megatron.py", nnodes=2, nproc_per_node=2, spare_nodes=1, timeline=tl,
              args=tuple(layout), metrics=m)
    fault: dict = {}

    def inject(proc):
        wait_for_step(m, 5, timeout_s=600, proc=proc)
        fault["time"] = time.time()
        with open(tl, "a") as fh:
            fh.write(json.dumps({"event": "fault", "time": fault["time"], "worker": "node1.1", "signal": 9,
                                 "source": "injector"}) + "\n")
        worker_proc(proc.pid, "node1.1").send_signal(signal.SIGKILL)

    res = run_job(job.argv(), timeout_s=600, while_running=inject, env=job.env())
    if res.returncode != 0:
        raise SystemExit(f"hot-swap run failed:\n{res.output[-3000:]}")
    rows = phases(read_events(tl))
    return {"layout": "TP2 x DP2, 2 nodes x 2 + 1 spare node (deadpool-run)", "model_size": "tiny",
            "phases": rows, "losses_identical": read_metrics(m) == read_metrics(base_m),
            "swap_wall_s": res.elapsed_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--size", default="small")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--shm-root", default="/dev/shm")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-recovery", action="store_true")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.blocks, args.block = 2, 3
    os.chdir(os.path.dirname(HERE))
    workdir = os.path.join(RESULTS_DIR, "megatron_logs")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    result = {"benchmark": "megatron",
              "command": " ".join(["python", "benchmarks/bench_megatron.py", *(argv or sys.argv[1:])]),
              "machine": machine_info(("torch", "megatron.core", "numpy")), "git": git_info(),
              "overhead": overhead(args)}
    if not args.skip_recovery:
        result["recovery"] = recovery(args, workdir)
    result["wall_s"] = time.time() - t0
    write_json(os.path.join(RESULTS_DIR, "megatron.json"), result)
    o = result["overhead"]
    lines = ["# Megatron-Core path: snapshot overhead and hot-swap recovery", "",
             f"Command: `{result['command']}` (wall {result['wall_s']:.0f} s). Machine: "
             f"{result['machine'].get('cpu_count', '?')} CPUs, shared and noisy; see megatron.json.", "",
             f"## Snapshot every iteration: {o['layout']}, GPT {o['model_size']} ({o['params_rank0']/1e6:.1f}M params "
             "on rank 0)", "",
             md_table(["", "median step", "p90", "n"],
                      [["snapshots on", fmt_s(o["on"]["median"]), fmt_s(o["on"]["p90"]), o["on"]["n"]],
                       ["snapshots off", fmt_s(o["off"]["median"]), fmt_s(o["off"]["p90"]), o["off"]["n"]]]), "",
             f"Step-time ratio on/off: **{fmt_ratio(o['ratio_median'])}** (90% CI {fmt_ratio(o['ratio_ci90'][0])} - "
             f"{fmt_ratio(o['ratio_ci90'][1])}), A/B blocks interleaved in one run. Training thread blocked "
             f"{fmt_s(o['snapshot_blocking_s_median'])} per snapshot (median); background copy "
             f"{fmt_s(o['snapshot_copy_s_median'])}, replica {fmt_s(o['snapshot_replicate_s_median'])}.", ""]
    if "recovery" in result:
        r = result["recovery"]
        lines += [f"## Hot-swap recovery: {r['layout']}, GPT {r['model_size']}, SIGKILL at step 5", "",
                  md_table(["detect", "agree", "rebuild", "restore", "recompute", "total"],
                           [[fmt_s(row.get(k)) for k in ("detect_s", "agree_s", "rebuild_s", "restore_s",
                                                         "recompute_s", "total_s")] for row in r["phases"]]), "",
                  f"Losses after recovery identical to an uninterrupted run: **{r['losses_identical']}**.", ""]
    write_text(os.path.join(RESULTS_DIR, "megatron.md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
