#!/usr/bin/env python
"""The overhead users meet: ``deadpool-run`` with one spare against plain DeepSpeed, whole process tree (issue 45).

    flock /tmp/deadpool-bench.lock python benchmarks/bench_recommended.py            # 10 rounds, GPT small, 2 ranks
    python benchmarks/bench_recommended.py --quick                                  # 2 rounds, tiny, 2 + 2 steps

Each round runs one job per mode (``--modes``, the order rotating from round to round), each a fresh launch of this
file as the training script: ``plain`` (torchrun, ``deepspeed.initialize``, no deadpool import), ``off`` (torchrun
``-m deadpool_ext.run``: attached, snapshots inactive), ``recommended`` (``deadpool-run --nnodes 2 --nproc-per-node 1
--spare-nodes 1``: the spare built ahead, a snapshot every step, the replica on the other node), and on request
``on_torchrun``. Every job runs in a cgroup made for it (``job_cpu.py``), so the kernel counts the CPU of every
process in it; rank 0 reads it (and each process's share) at the barriers that open and close its measured window.
Writes ``<out>/<name>.json`` and ``.md`` (``recommended_analyse.py``).
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

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, machine_info, write_json, write_text  # noqa: E402
from job_cpu import CGROUP_ENV, JobCgroup, read_role_cpu, role_file  # noqa: E402
from recommended_analyse import MODES, analyze, render_markdown  # noqa: E402

BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
ALL_MODES = (*MODES, "on_torchrun")
PHASE_STATS = ("copy_cpu_s", "seal_cpu_s", "replicate_cpu_s", "commit_cpu_s", "blocking_s")
SIZES = {"small": {"micro_batch": 2, "rounds": 10, "steps": 8, "warmup_steps": 3, "job_timeout_s": 420},
         "tiny": {"micro_batch": 4, "rounds": 2, "steps": 2, "warmup_steps": 2, "job_timeout_s": 300}}


# ==================================================================================================
# the training script (one per rank, and the spare), launched by the modes' launchers
# ==================================================================================================
def worker(args: argparse.Namespace) -> int:
    role_dir = args.role_dir
    with open(role_file(role_dir, os.getpid()), "w") as fh:
        fh.write("script")  # a spare never gets past deepspeed.initialize while nothing fails
    import deepspeed
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    from deadpool_ext.training.data import ByteLMData, seed_everything  # model and data code, no attach
    from deadpool_ext.training.models import build_gpt, count_parameters, seq_len_for

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    with open(args.deepspeed_config) as fh:
        config = json.load(fh)
    seed_everything(args.seed)
    model = build_gpt(args.size)
    n_params = count_parameters(model)  # before ZeRO-3 partitions them (a rank then holds empty placeholders)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    rank = dist.get_rank()
    with open(role_file(role_dir, os.getpid()), "w") as fh:
        fh.write(f"rank{rank}")
    runtime = getattr(engine, "deadpool", None)
    attached = runtime is not None
    if attached and args.mode == "off":
        runtime.snapshots.active = False
    data = ByteLMData(seq_len=seq_len_for(args.size), seed=args.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    dp_rank = dist.get_rank(group=engine.data_parallel_group) if engine.data_parallel_group else rank
    engine.train()

    def step() -> float:
        t0 = time.perf_counter()
        first = int(engine.global_samples) + dp_rank * micro
        ids, labels = data.gpt_batch(first, micro)
        loss = engine(input_ids=ids.to(engine.device), labels=labels.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup_steps):
        step()
    if attached and runtime.snapshots.active:
        runtime.snapshots.wait_idle()
    cgroup = JobCgroup.from_env()
    snapping = bool(attached and runtime.snapshots.active)
    n_snaps = len(runtime.snapshots.timings.copy_s) if snapping else 0
    dist.barrier()
    cpu0, roles0, t0 = cgroup.usage_s(), read_role_cpu(cgroup, role_dir), time.perf_counter()
    steps = [step() for _ in range(args.steps)]
    if attached and runtime.snapshots.active:
        runtime.snapshots.wait_idle()  # the window's last snapshot committed inside it
    dist.barrier()
    t1, cpu1, roles1 = time.perf_counter(), cgroup.usage_s(), read_role_cpu(cgroup, role_dir)
    phases: dict[str, float | None] = {}
    floor = None
    if snapping:
        # where a rank's snapshot CPU goes (the worker thread's phases, medians over the window's snapshots), and
        # the floor: one copy, one checksum pass, one replica exchange of the same bytes (collective, after the
        # window: outside what was counted)
        from bench_snapshot_overhead import _cpu_floor
        from common import median

        st = runtime.snapshots.timings
        phases = {k: median(list(getattr(st, k))[n_snaps:]) for k in PHASE_STATS}
        floor = _cpu_floor(runtime.snapshots, runtime.adapter, dist, torch)
    if rank == 0:
        result = {"mode": args.mode, "attached": attached, "world_size": dist.get_world_size(),
                  "params": n_params, "steps": args.steps, "step_s": steps, "window_s": t1 - t0,
                  "cpu_s": cpu1 - cpu0, "cpu_by_role_s": {k: roles1.get(k, 0.0) - roles0.get(k, 0.0)
                                                          for k in set(roles0) | set(roles1)},
                  "snapshots_active": snapping, "snapshot_phases_rank0": phases,
                  "cpu_floor_rank0": floor}
        with open(args.result_file, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    return 0


# ==================================================================================================
# the launcher: rounds of one job per mode
# ==================================================================================================
def _config(mode: str, size: dict[str, Any], shm_root: str, path: str) -> str:
    with open(BASE_CONFIG) as fh:
        cfg = json.load(fh)
    cfg["train_micro_batch_size_per_gpu"] = size["micro_batch"]
    cfg.pop("deadpool", None)
    if mode in ("off", "on_torchrun"):
        cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1},
                           "local": {"shm_root": shm_root, "simulate_nodes": 2},
                           "recovery": {"restore_on_start": False}}
    elif mode == "recommended":
        cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1}}
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def job_argv(mode: str, config: str, wargs: list[str], shm_root: str, port: int) -> list[str]:
    """The command line of one mode's job (``testing.jobs.Job``)."""
    from deadpool_ext.testing.jobs import Job

    script = os.path.abspath(__file__)
    if mode == "recommended":
        job = Job(script=script, args=tuple(wargs), config=config, nnodes=2, nproc_per_node=1, spare_nodes=1,
                  shm_root=shm_root)
    else:
        job = Job(script=script, args=tuple(wargs), config=config, launcher="torchrun", nproc_per_node=2, port=port,
                  wrap=None if mode == "plain" else "deadpool_ext.run")
    return job.argv()


def run_one(args: argparse.Namespace, size: dict[str, Any], rnd: int, mode: str, scratch: str) -> dict[str, Any]:
    from deadpool_ext.testing.launch import base_env, free_port, run_job

    tag = f"{os.getpid()}_{rnd}_{mode}"
    job_dir = os.path.join(scratch, tag)
    role_dir = os.path.join(job_dir, "roles")
    os.makedirs(role_dir)
    shm_root = os.path.join("/dev/shm", f"bench_recommended.{tag}")
    os.makedirs(shm_root, exist_ok=True)
    result_file = os.path.join(job_dir, "result.json")
    wargs = ["--worker", "--mode", mode, "--size", args.size, "--steps", str(size["steps"]), "--warmup-steps",
             str(size["warmup_steps"]), "--role-dir", role_dir, "--result-file", result_file, "--seed",
             str(args.seed)]
    config = _config(mode, size, shm_root, os.path.join(job_dir, "ds_config.json"))
    cmd = job_argv(mode, config, wargs, shm_root, free_port())
    entry: dict[str, Any] = {"round": rnd, "mode": mode, "command": shlex.join(cmd)}
    t0 = time.time()
    try:
        with JobCgroup.create(f"deadpool_bench_{tag}") as cg:
            # no LOCAL_SIZE: DeepSpeed's CPU shared-memory allreduce stays off in every mode (deadpool-run does not
            # set it), so all modes reduce over gloo alike; and its /dev/shm buffers are not there for another
            # job's cleanup to remove mid-run (testing.launch.sweep_deepspeed_shm unlinks every new deepspeed_*)
            env = base_env({CGROUP_ENV: cg.path})
            for key in ("LOCAL_SIZE", "CROSS_SIZE", "CROSS_RANK"):
                env.pop(key, None)
            res = run_job(cg.wrap(cmd), timeout_s=size["job_timeout_s"], env=env)
            entry["cpu_source"] = cg.source
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    entry["job_wall_s"] = time.time() - t0
    if res.returncode == 0 and os.path.exists(result_file):
        with open(result_file) as fh:
            entry["result"] = json.load(fh)
    else:
        how = "timed out" if res.timed_out else f"exited rc={res.returncode}"
        entry["error"] = f"{how}; last lines: " + " | ".join(res.output.splitlines()[-15:])
    with open(os.path.join(args.log_dir, f"{tag}.log"), "w") as fh:
        fh.write(res.output)
    return entry


def launcher(args: argparse.Namespace) -> int:
    args.size = args.size or ("tiny" if args.quick else "small")
    size = dict(SIZES[args.size])
    if args.quick:
        size.update(rounds=2, steps=2, warmup_steps=2)
    for key in ("rounds", "steps", "warmup_steps"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES] + ([] if "plain" in modes else ["(plain is required)"])
    if bad:
        raise SystemExit(f"--modes: {', '.join(bad)}: allowed a comma-separated subset of {', '.join(ALL_MODES)} "
                         "that includes plain")
    JobCgroup.check()  # one line and exit when no cgroup can be made for the jobs
    out_dir = os.path.abspath(args.out)
    stem = args.name or ("snapshot_overhead_recommended_quick" if args.quick else "snapshot_overhead_recommended")
    args.log_dir = os.path.join(out_dir, f"{stem}_logs")
    os.makedirs(args.log_dir, exist_ok=True)
    command = shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])
    doc: dict[str, Any] = {"benchmark": "recommended", "command": command, "machine": machine_info(),
                           "size": args.size, "micro_batch": size["micro_batch"], "rounds": size["rounds"],
                           "steps": size["steps"], "warmup_steps": size["warmup_steps"], "modes": modes,
                           "rule_met": size["rounds"] >= 10 and size["steps"] >= 8, "jobs": []}
    scratch = tempfile.mkdtemp(prefix="bench_recommended.")
    t_all = time.time()
    try:
        for rnd in range(size["rounds"]):
            k = rnd % len(modes)
            for mode in modes[k:] + modes[:k]:
                entry = run_one(args, size, rnd, mode, scratch)
                doc["jobs"].append(entry)
                r = entry.get("result")
                print(f"[recommended] round {rnd + 1}/{size['rounds']} {mode}: " + (
                    f"window/step {r['window_s'] / r['steps']:.3f} s, tree CPU/step {r['cpu_s'] / r['steps']:.3f} s "
                    f"(job {entry['job_wall_s']:.0f} s)" if r else f"FAILED: {entry['error'][:300]}"), flush=True)
                _save(doc, out_dir, stem, t_all)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _save(doc, out_dir, stem, t_all)
    print(f"[recommended] wrote {os.path.join(out_dir, stem)}.json and .md", flush=True)
    return 0 if all(e.get("result") for e in doc["jobs"]) else 1


def _save(doc: dict[str, Any], out_dir: str, stem: str, t_all: float) -> None:
    doc["wall_s"] = time.time() - t_all
    doc["cpu_source"] = next((e["cpu_source"] for e in doc["jobs"] if e.get("cpu_source")), None)
    doc["params"] = next((e["result"]["params"] for e in doc["jobs"] if e.get("result")), 0)
    doc["analysis"] = analyze(doc["jobs"])
    write_json(os.path.join(out_dir, f"{stem}.json"), doc)
    write_text(os.path.join(out_dir, f"{stem}.md"), render_markdown(doc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="GPT tiny, 2 rounds x 2 steps (a few minutes)")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default small (tiny with --quick)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(ALL_MODES)}")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps in a job's measured window")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--name", default=None, help="results file stem (default snapshot_overhead_recommended)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--render-only", metavar="JSON", help="rewrite the analysis and markdown of a results file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--role-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.render_only:
        with open(args.render_only) as fh:
            doc = json.load(fh)
        doc["analysis"] = analyze(doc["jobs"])
        write_json(args.render_only, doc)
        write_text(os.path.splitext(args.render_only)[0] + ".md", render_markdown(doc))
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
