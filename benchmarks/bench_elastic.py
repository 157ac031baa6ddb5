#!/usr/bin/env python
"""Elastic shrink against the baseline users have: a node of two ranks SIGKILLed with no spare left, dp 4 -> 2.

Modes (GPT, DeepSpeed ZeRO-1 and ZeRO-3, 2 nodes x 2 processes, snapshots every step, replication factor 1,
global batch 8 = micro 2 x accumulation 1 x dp 4, dropout 0), interleaved per repeat, one machine:

* ``shrink``   ``deadpool-run --spare-nodes 0 --no-spare-policy shrink``: the survivors rebuild on 2 ranks and
               reshard every partition from memory (accumulation 1 -> 2);
* ``relaunch`` the same job with ``--no-spare-policy fail`` and tier 3 (``--save`` every step): it stops; the
               job is started again on one node of 2 ranks with ``--load`` (DeepSpeed's universal checkpoint
               conversion, ``integrations/deepspeed/reshard.py``), what a team does today.

Measured from the SIGKILL (t = 0) to the first step the job completes after it (rank 0's metrics line): for
shrink the first line after the restore, the recovery's phases from the timeline; for relaunch the failed job's
exit, the relaunch's start and its first line (it resumed from the newest tier-3 base, written every step).
Also: the losses after the shrink against the uninterrupted dp-4 run (max relative difference; reduction order
differs), and the peak RSS of the job's processes.

    python benchmarks/bench_elastic.py                       # GPT small, ZeRO-1 and 3, 2 repeats (~15 min)
    python benchmarks/bench_elastic.py --size tiny --repeats 1   # smoke run (~3 min)

Writes ``benchmarks/results/elastic.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from common import machine_info, md_table, write_json, write_text  # noqa: E402

from deadpool_ext.recovery.timeline import read_events  # noqa: E402
from deadpool_ext.testing.jobs import Job  # noqa: E402
from deadpool_ext.testing.launch import read_metrics, run_job, wait_for_step  # noqa: E402

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def _config(path: str, stage: int, shm_root: str, dp: int = 4) -> None:
    with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        cfg = json.load(fh)
    cfg.update(BATCH)
    cfg["gradient_accumulation_steps"] = BATCH["train_batch_size"] // (BATCH["train_micro_batch_size_per_gpu"] * dp)
    cfg["zero_optimization"] = {"stage": stage}
    cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1}, "local": {"shm_root": shm_root}}
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def _times(path: str) -> list[tuple[int, float]]:
    """(step, wall time) of every metrics line, in file order (a redone step appears twice)."""
    out: list[tuple[int, float]] = []
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                rec = json.loads(line)
                out.append((int(rec["step"]), float(rec["time"])))
    return out


def _first_after(times: list[tuple[int, float]], t: float) -> float:
    return min(tt for _, tt in times if tt > t)


def _workers(launcher: int, node: str) -> list[psutil.Process]:
    deadline = time.time() + 120
    while time.time() < deadline:
        found = []
        for p in psutil.Process(launcher).children(recursive=True):
            try:
                if p.environ().get("DEADPOOL_WORKER_ID", "").startswith(node + "."):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if len(found) == 2:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"workers of {node} under launcher {launcher}")


def _job(wd: str, name: str, *, nnodes: int, policy: str, args: argparse.Namespace, cfg: str, shm_root: str,
         extra: list[str], kill: bool) -> dict[str, Any]:
    metrics = os.path.join(wd, f"{name}.jsonl")
    timeline = os.path.join(wd, f"{name}.timeline.jsonl")
    job = Job(script="scripts/pretrain_gpt.py", nnodes=nnodes, nproc_per_node=2, spare_nodes=0, no_spare_policy=policy,
              shm_root=shm_root, timeline=timeline, config=cfg, metrics=metrics,
              args=("--train-iters", str(args.iters), "--dropout", "0", "--model-size", args.size, *extra))
    out: dict[str, Any] = {}
    peak: dict[int, int] = {}

    def inject(proc: Any) -> None:
        if kill:
            victims = _workers(proc.pid, "node1")
            wait_for_step(metrics, args.kill_step, timeout_s=args.timeout_s, proc=proc)
            out["kill_at"] = time.time()
            for v in victims:
                v.send_signal(signal.SIGKILL)
        while proc.poll() is None:  # peak RSS of every worker, sampled
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        peak[p.pid] = max(peak.get(p.pid, 0), p.memory_info().rss)
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)

    t0 = time.time()
    res = run_job(job.argv(), timeout_s=args.timeout_s, while_running=inject, env=job.env())
    out.update(rc=res.returncode, started=t0, ended=time.time(), metrics=read_metrics(metrics), times=_times(metrics),
               events=read_events(timeline) if os.path.exists(timeline) else [], peak_rss=max(peak.values(), default=0))
    with open(os.path.join(wd, f"{name}.log"), "w") as fh:
        fh.write(res.output)
    if res.returncode != 0 and policy != "fail":
        raise RuntimeError(f"{name} exited {res.returncode}: {res.output[-3000:]}")
    return out


def _rel(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def one_repeat(stage: int, rep: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    wd = os.path.join(root, f"z{stage}r{rep}")
    os.makedirs(wd)
    shm = tempfile.mkdtemp(prefix="dp-el-", dir="/dev/shm")
    cfg = os.path.join(wd, "ds.json")
    _config(cfg, stage, shm)
    row: dict[str, Any] = {"stage": stage, "repeat": rep}
    # the uninterrupted run (its losses are the reference)
    base = _job(wd, "base", nnodes=2, policy="fail", args=args, cfg=cfg, shm_root=shm, extra=[], kill=False)
    # shrink
    s = _job(wd, "shrink", nnodes=2, policy="shrink", args=args, cfg=cfg, shm_root=shm, extra=[], kill=True)
    rec = [e for e in s["events"] if e.get("event") == "recover" and e.get("role") == "survivor"]
    first = min(rec, key=lambda e: e["rank"])
    row["shrink"] = {"to_next_step_s": _first_after(s["times"], first["restored_at"]) - s["kill_at"],
                     "assigned_s": first["assigned_at"] - s["kill_at"],
                     "pg_ready_s": first["pg_ready_at"] - s["kill_at"],
                     "engine_ready_s": first["engine_ready_at"] - s["kill_at"],
                     "restored_s": first["restored_at"] - s["kill_at"], "restored_version": first["restored_version"],
                     "loss_rel_diff_max": _rel(s["metrics"], base["metrics"]), "peak_rss": s["peak_rss"]}
    # relaunch with fewer ranks + universal checkpoint
    save = os.path.join(wd, "ckpt")
    failed = _job(wd, "failed", nnodes=2, policy="fail", args=args, cfg=cfg, shm_root=shm,
                  extra=["--save", save, "--save-interval", "1"], kill=True)
    cfg2 = os.path.join(wd, "ds_dp2.json")  # what the user edits for the relaunch: accumulation 2 at dp 2
    _config(cfg2, stage, shm, dp=2)
    again = _job(wd, "relaunch", nnodes=1, policy="fail", args=args, cfg=cfg2, shm_root=shm,
                 extra=["--save", save, "--save-interval", "0", "--load", save], kill=False)
    assert again["rc"] == 0, again
    first_new = _first_after(again["times"], 0.0)
    row["relaunch"] = {"to_next_step_s": first_new - failed["kill_at"],
                       "failed_job_exit_s": failed["ended"] - failed["kill_at"],
                       "relaunch_to_step_s": first_new - again["started"],
                       "resumed_from_step": min(st for st, _ in again["times"]) - 1,
                       "loss_rel_diff_max": _rel(again["metrics"], {s_: v for s_, v in base["metrics"].items()
                                                                    if s_ in again["metrics"]}),
                       "peak_rss": again["peak_rss"]}
    row["speedup"] = row["relaunch"]["to_next_step_s"] / row["shrink"]["to_next_step_s"]
    print(f"[elastic] ZeRO-{stage} repeat {rep}: shrink {row['shrink']['to_next_step_s']:.2f} s, relaunch "
          f"{row['relaunch']['to_next_step_s']:.2f} s ({row['speedup']:.1f}x); shrink losses within "
          f"{row['shrink']['loss_rel_diff_max']:.1e}", file=sys.stderr, flush=True)
    return row


def render(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    lines = [f"# Elastic shrink vs relaunch at fewer ranks (GPT {doc['size']}, dp 4 -> 2)", "",
             "A node of two ranks SIGKILLed after step "
             f"{doc['kill_step']} with no spare left. `shrink`: the survivors continue on 2 ranks, state resharded "
             "from memory. `relaunch`: the job stops, and is started again on 2 ranks with `--load` from tier 3 "
             "(DeepSpeed's universal checkpoint conversion, the newest base of tier 3, written every step). Time from "
             "the SIGKILL to the first step completed after it. Written by `benchmarks/bench_elastic.py`.", ""]
    table = []
    for stage in sorted({r["stage"] for r in rows}):
        rs = [r for r in rows if r["stage"] == stage]
        sh = [r["shrink"]["to_next_step_s"] for r in rs]
        rl = [r["relaunch"]["to_next_step_s"] for r in rs]
        sp = [r["speedup"] for r in rs]
        table.append([f"ZeRO-{stage}", len(rs), f"{statistics.median(sh):.2f} ({min(sh):.2f}-{max(sh):.2f})",
                      f"{statistics.median(rl):.2f} ({min(rl):.2f}-{max(rl):.2f})",
                      f"{statistics.median(sp):.1f}x ({min(sp):.1f}-{max(sp):.1f})",
                      f"{max(r['shrink']['loss_rel_diff_max'] for r in rs):.1e}",
                      f"{max(r['shrink']['peak_rss'] for r in rs) / 2**20:.0f} / "
                      f"{max(r['relaunch']['peak_rss'] for r in rs) / 2**20:.0f}"])
    lines += [md_table(["stage", "repeats", "shrink s (median, range)", "relaunch s", "speed-up",
                        "shrink loss rel. diff (max)", "peak RSS MiB shrink / relaunch"], table), "",
              "Phases of the shrink (s after the SIGKILL, rank 0, median): "
              + ", ".join(f"{k} {statistics.median(r['shrink'][k] for r in rows):.2f}"
                          for k in ("assigned_s", "pg_ready_s", "engine_ready_s", "restored_s", "to_next_step_s")),
              "Relaunch phases (median): failed job's exit "
              f"{statistics.median(r['relaunch']['failed_job_exit_s'] for r in rows):.2f} s after the SIGKILL, "
              "relaunch start to the step "
              f"{statistics.median(r['relaunch']['relaunch_to_step_s'] for r in rows):.2f} s "
              "(a scheduler's requeue time not included).", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    p.add_argument("--stages", default="1,3")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--name", default="elastic")
    args = p.parse_args(argv)
    if not 2 <= args.kill_step < args.iters:
        p.error("--kill-step must be in 2 .. iters-1")
    root = tempfile.mkdtemp(prefix="deadpool-elastic-")
    rows = [one_repeat(int(st), rep, args, root) for rep in range(args.repeats) for st in args.stages.split(",")]
    doc = {"command": " ".join(["python", "benchmarks/bench_elastic.py", *(argv or sys.argv[1:])]),
           "size": args.size,
           "kill_step": args.kill_step, "iters": args.iters, "rows": rows, "machine": machine_info()}
    out = os.path.join(HERE, "results")
    write_json(os.path.join(out, f"{args.name}.json"), doc)
    write_text(os.path.join(out, f"{args.name}.md"), render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
