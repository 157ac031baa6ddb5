"""Differential checkpoints (TierCheck, tiers 1 and 2): size of a differential vs a full snapshot, and replay
time fused vs stepwise, on a real 4-rank DeepSpeed job.

    python benchmarks/bench_differential.py            # GPT small, ZeRO-2 and ZeRO-3, K=10 (~10 min here)
    python benchmarks/bench_differential.py --quick    # GPT tiny, K=5 (~2 min)

For each ZeRO stage: train K + (K - 1) steps with differentials on (a base at step K, differentials K+1..2K-1
in memory and in a peer's memory), then restore that newest version in place, twice: ``stepwise`` (each
differential applied, then the parameters synced as the engine's step does: copy + all-gather under ZeRO-1/2)
and ``fused`` (all differentials replayed in cache-blocked multi-step batches, one sync). Both restores must
give the live state bit for bit (checked). Also the math alone, on one rank: stepwise whole-tensor Adam vs
the fused replay over the same differentials.

Writes differential.json and differential.md (``_quick`` with ``--quick``) into benchmarks/results, or the
directory given by ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, RESULTS_DIR, machine_info, md_table, write_json, write_text  # noqa: E402

KERNELS = {"single": "single-tensor", "fused": "fused (\"fused\": true)"}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import deadpool_ext.deepspeed as dpx
    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.recovery.replay import AdamHyper, StepDiff, replay_fused, replay_naive
    from deadpool_ext.snapshot.differential import replay_targets
    from deadpool_ext.snapshot.slots import restore_from
    from deadpool_ext.training.data import ByteLMData
    from deadpool_ext.training.models import build_gpt, count_parameters, seq_len_for

    init_distributed()
    torch.manual_seed(0)
    model = build_gpt(args.model_size)
    n_params = count_parameters(model)
    engine, *_ = dpx.initialize(model=model, config=args.config, model_parameters=model.parameters())
    data = ByteLMData(seq_len=seq_len_for(args.model_size), seed=0)
    k = args.k
    steps = 2 * k - 1
    step_times = []
    micro = engine.train_micro_batch_size_per_gpu()
    while engine.global_steps < steps:
        t0 = time.perf_counter()
        first = int(engine.global_samples) + engine.global_rank * micro
        ids, labels = data.gpt_batch(first, micro)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        step_times.append(time.perf_counter() - t0)
    mgr = engine.deadpool.snapshots
    mgr.wait_idle()
    st = mgr.stats()
    adapter = engine.deadpool.adapter
    want = {n: t.detach().clone() for n, t in adapter.tensors()}
    state_bytes = sum(t.numel() * t.element_size() for t in want.values())

    def restore(mode: str) -> float:
        mgr.config.differential.replay = mode
        with torch.no_grad():
            for _, t in adapter.tensors():
                if t.is_floating_point():
                    t.add_(1.0)
        dist.barrier()
        v = mgr.restore_latest()
        assert v == steps, (v, steps)
        got = dict(adapter.tensors())
        assert all(torch.equal(got[n], w) for n, w in want.items()), f"{mode} replay differs"
        return float(mgr.stats()["replay_s"])

    replay: dict[str, list[float]] = {"stepwise": [], "fused": []}
    for mode in ("stepwise", "fused") * (2 * args.repeats):  # alternated: the machine's load drifts
        replay[mode].append(restore(mode))
    # Math only, this rank: the same differentials on a copy of the base state.
    diffs = []
    for v in range(k + 1, steps + 1):
        grads, state, _ = restore_from(mgr.store.ring_entry(mgr.ring.index(v)).buf, verify=False)
        n = len(state["hypers"])
        diffs.append(StepDiff(grads=[grads[f"grad.{i}"] for i in range(n)],
                              hypers=[AdamHyper.from_json(state["hypers"][str(i)]) for i in range(n)]))
    math = {}
    for name, fn in (("stepwise", replay_naive), ("fused", replay_fused), ("stepwise_2", replay_naive),
                     ("fused_2", replay_fused)):
        targets = [type(t)(param=t.param.clone(), exp_avg=t.exp_avg.clone(), exp_avg_sq=t.exp_avg_sq.clone(),
                           step=t.step.clone(), max_exp_avg_sq=None) for t in replay_targets(adapter)]
        t0 = time.perf_counter()
        fn(targets, diffs)
        math[name] = time.perf_counter() - t0
    out = {"rank": engine.global_rank, "params": n_params, "state_bytes": state_bytes,
           "base_blob_bytes": st["base_nbytes"], "diff_blob_bytes": st["diff_nbytes"],
           "grad_bytes": sum(d.numel() * d.element_size() for d in diffs[0].grads),
           "step_time_s": sorted(step_times[2:])[len(step_times[2:]) // 2],
           "blocking_s_median": st["blocking_s_median"], "replicate_s_median": st["replicate_s_median"],
           "memory_bytes": st["memory_bytes"], "replay_s": replay, "math_s": math, "n_diffs": len(diffs)}
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, out)
    if engine.global_rank == 0:
        with open(args.result, "w") as fh:
            json.dump(outs, fh)
    engine.deadpool.close()
    dist.barrier()


def run_case(stage: int, size: str, k: int, repeats: int, tmp: str, kernel: str = "single") -> dict:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, run_job

    with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        cfg = json.load(fh)
    cfg["zero_optimization"] = {"stage": stage}
    cfg["optimizer"]["params"]["fused"] = kernel == "fused"
    if size == "medium":  # activations at micro-batch 4, seq 512 do not fit 4 ranks in 24 GiB (as bench_persist)
        cfg["train_micro_batch_size_per_gpu"] = 1
    shm = f"/dev/shm/dp-bench-diff-{os.getpid()}"
    os.makedirs(shm, exist_ok=True)
    cfg["deadpool"] = {"differential": {"enabled": True, "base_interval": k}, "replication": {"factor": 1},
                       "local": {"shm_root": shm, "simulate_nodes": 2}}
    path = os.path.join(tmp, f"ds_diff_{stage}_{kernel}.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    result = os.path.join(tmp, f"diff_{stage}_{kernel}.json")
    cmd = Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=4, port=free_port(),
              args=("--worker", "--config", path, "--model-size", size, "--k", str(k), "--repeats", str(repeats),
                    "--result", result)).argv()
    print(f"[bench_differential] ZeRO-{stage}, GPT {size}, K={k}, 4 ranks, {KERNELS[kernel]} ...", flush=True)
    t0 = time.time()
    res = run_job(cmd, timeout_s=1800)
    import shutil

    shutil.rmtree(shm, ignore_errors=True)
    if res.returncode != 0:
        raise SystemExit(f"ZeRO-{stage} case failed:\n{res.output[-4000:]}")
    with open(result) as fh:
        ranks = json.load(fh)
    print(f"[bench_differential] ZeRO-{stage} done in {time.time() - t0:.0f} s", flush=True)
    return {"stage": stage, "ranks": ranks, "kernel": kernel}


def summarize_case(case: dict) -> dict:
    from statistics import median

    r = case["ranks"]
    stepwise = median(x for rank in r for x in rank["replay_s"]["stepwise"])
    fused = median(x for rank in r for x in rank["replay_s"]["fused"])
    m_step = median(min(rank["math_s"]["stepwise"], rank["math_s"]["stepwise_2"]) for rank in r)
    m_fused = median(min(rank["math_s"]["fused"], rank["math_s"]["fused_2"]) for rank in r)
    base = max(rank["base_blob_bytes"] for rank in r)
    diff = max(rank["diff_blob_bytes"] for rank in r)
    return {"zero_stage": case["stage"], "adam_kernel": case["kernel"], "params": r[0]["params"],
            "n_diffs": r[0]["n_diffs"],
            "state_bytes_per_rank": max(rank["state_bytes"] for rank in r), "base_blob_bytes": base,
            "diff_blob_bytes": diff, "diff_over_base": diff / base, "step_time_s": median(x["step_time_s"] for x in r),
            "replay_stepwise_s": stepwise, "replay_fused_s": fused, "replay_speedup": stepwise / fused,
            "math_stepwise_s": m_step, "math_fused_s": m_fused, "math_speedup": m_step / m_fused,
            "memory_bytes_per_rank": max(rank["memory_bytes"] for rank in r),
            # Achievable checkpoint frequency: a base or differential is taken after every step; what the
            # training thread pays for it (median over ranks of each rank's median) against the step time.
            "blocking_s_median": median(rank["blocking_s_median"] for rank in r),
            "replicate_s_median": median(rank["replicate_s_median"] for rank in r),
            "blocking_over_step": median(rank["blocking_s_median"] for rank in r)
            / median(x["step_time_s"] for x in r)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="GPT tiny, K=5: a minute or two")
    p.add_argument("--out", default=RESULTS_DIR, help="directory for differential[_quick].json/.md (default "
                   "benchmarks/results)")
    p.add_argument("--stages", default="3")
    p.add_argument("--size", choices=["small", "medium"], default="small", help="GPT size (ignored with --quick)")
    p.add_argument("--base-interval", type=int, default=10, help="K: base every K steps, K - 1 differentials "
                   "replayed (ignored with --quick)")
    p.add_argument("--name", help="result file name (default differential[_quick], differential_<size> for "
                   "sizes other than small)")
    p.add_argument("--kernels", default="single,fused", help="torch Adam kernels to train with: single (the "
                   "single-tensor default) and/or fused (\"fused\": true); each is replayed with its own kernel")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model-size", default="small", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import tempfile

    size, k = ("tiny", 5) if args.quick else (args.size, args.base_interval)
    name = args.name or ("differential_quick" if args.quick else
                         "differential" if size == "small" else f"differential_{size}")
    os.makedirs(args.out, exist_ok=True)
    cmd = " ".join(["python benchmarks/bench_differential.py", *(argv if argv is not None else sys.argv[1:])])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in [int(s) for s in args.stages.split(",")]:
            for kernel in args.kernels.split(","):
                if kernel not in KERNELS:
                    p.error(f"--kernels: unknown kernel {kernel!r} (allowed: {', '.join(KERNELS)})")
                rows.append(summarize_case(run_case(stage, size, k, 1, tmp, kernel)))
    doc = {"benchmark": "differential", "command": cmd, "machine": machine_info(), "model": f"GPT {size}",
           "layout": "DeepSpeed ZeRO, 4 CPU ranks (gloo), 2 simulated nodes, replication factor 1", "base_interval": k,
           "results": rows}
    write_json(os.path.join(args.out, f"{name}.json"), doc)
    table = md_table(["ZeRO", "Adam kernel", "params", "diff / base", "diff MB", "base MB", "replay stepwise s",
                      "replay fused s",
                      "speedup", "math stepwise s", "math fused s", "math speedup", "step s",
                      "blocked per checkpoint", "memory / rank"],
                     [[r["zero_stage"], KERNELS[r["adam_kernel"]], f"{r['params'] / 1e6:.1f}M",
                       f"{r['diff_over_base']:.3f}",
                       f"{r['diff_blob_bytes'] / 1e6:.1f}", f"{r['base_blob_bytes'] / 1e6:.1f}",
                       f"{r['replay_stepwise_s']:.3f}", f"{r['replay_fused_s']:.3f}", f"{r['replay_speedup']:.2f}x",
                       f"{r['math_stepwise_s']:.3f}", f"{r['math_fused_s']:.3f}", f"{r['math_speedup']:.2f}x",
                       f"{r['step_time_s']:.2f}",
                       f"{r['blocking_s_median'] * 1e3:.1f} ms ({r['blocking_over_step']:.2%} of a step)",
                       f"{r['memory_bytes_per_rank'] / 2**30:.2f} GiB"] for r in rows])
    write_text(os.path.join(args.out, f"{name}.md"),
               f"# Differential checkpoints: size and replay\n\n`{cmd}` on "
               f"{doc['machine'].get('cpu', 'this machine')}; "
               f"GPT {size}, {doc['layout']}; base every {k} steps, {k - 1} differentials replayed.\n\n{table}\n\n"
               "diff / base: bytes of one differential blob over one full snapshot blob of the same rank (largest "
               "rank). Replay: restoring the newest version in place, base + differentials; stepwise syncs "
               "parameters after each step (copy, all-gather under ZeRO-1/2), fused replays cache-blocked batches "
               "and syncs once. Both give the live state bit for bit (checked in the run). Math: the Adam "
               "replay alone on one rank. Blocked per checkpoint: the training thread's median wait per snapshot "
               "(base or differential, one after every step), i.e. checkpointing every iteration costs that "
               "fraction of a step; memory / rank: snapshot memory (slots, replicas, rings). Adam kernel: the torch "
               "Adam implementation the job trained with (the "
               "single-tensor default, or `\"fused\": true`); replay runs the same kernel, so each row is bit-exact "
               "with its own training run. The machine is shared and was loaded while this ran.\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
