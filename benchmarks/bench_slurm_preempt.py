#!/usr/bin/env python
"""Preempted under a real Slurm, then requeued: deadpool-run's drain to tier 3 against the plain relaunch that Slurm
users get today, side by side in one run (issue 47, "Measure").

The Slurm bed of ``bench_slurm.py`` (``deadpool_ext/testing/slurm.py``: munged and slurmctld on a control host, one
slurmd per namespace host, a 3-member etcd on the bridge; partition ``urgent`` preempts ``main`` with
``PreemptMode=REQUEUE``); GPT (``--size``), DeepSpeed ZeRO-3, 3 nodes x 1 process. In each run, once step
``--preempt-step`` is logged, a job of partition ``urgent`` that needs every node is submitted: Slurm SIGTERMs the
training job, SIGKILLs what is left ``KillWait`` later, requeues it, runs the urgent job (``true``) and then starts
the requeued one again, which holds it ``cred_expire`` first (``--cred-expire-s``; Slurm's default is 120 s). Modes:

* ``deadpool``  ``sbatch --nodes 4 scripts/slurm/deadpool.sbatch`` (docs/slurm.md, unchanged: 3 nodes + 1 spare,
                snapshots every step), the script given ``--save DIR --load DIR``: on the SIGTERM every rank stops at
                its next step boundary, the newest step is persisted to tier 3 and verified within the grace
                (``--preempt-grace-s``, under KillWait), and the requeued run, the same command line, resumes from it;
* ``relaunch``  ``sbatch --nodes 3 benchmarks/slurm/relaunch.sbatch`` (``--requeue``; srun torchrun per node), the
                script persisting a checkpoint every step (``--save --save-interval 1``) and resuming from the newest
                (``--load``): the SIGTERM ends it where it is.

Measured per run (wall clock of this host): **signal** = when the urgent job was submitted; for deadpool, when the
launchers heard the SIGTERM (the ``drain`` event's ``requested_at``) and when rank 0's newest step was persisted and
verified on tier 3 (its ``drained`` event), against the grace; **trained** = the last step logged before the requeued
run started; **resumed from** = the step before the requeued run's first; **steps lost** = trained - resumed from
(steps trained twice); **requeued run started** (Slurm's ``RUNNING`` with ``Restarts=1``) and **its first step**,
from the signal. Losses (both runs' together, each step's last) against a fault-free run of the deadpool script,
bit for bit. Modes alternate repeat by repeat, each on a fresh bed.

    flock /tmp/deadpool-bench.lock python benchmarks/bench_slurm_preempt.py       # GPT small, 1 repeat (~12 min)

Needs root and slurm-wlm + munge. Writes ``benchmarks/results/slurm_preempt.json`` and ``.md`` (``--name``) and the
measured block of ``docs/slurm.md`` (``--no-docs``: not).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from bench_slurm import RELAUNCH_SCRIPT, _med, records, replace_doc_block, write_config  # noqa: E402
from common import add_output_args, machine_info, render_only, save_result  # noqa: E402

from deadpool_ext.testing.hosts import HostBed, missing_requirements  # noqa: E402
from deadpool_ext.testing.slurm import SCHEDULER_PARAMETERS, SLURM_TIMERS, SlurmBed, missing_slurm  # noqa: E402
from deadpool_ext.testing.slurmjob import SlurmRun, run_sbatch  # noqa: E402

MODES = ("deadpool", "relaunch")
NNODES = 3
DOC = os.path.join(REPO, "docs", "slurm.md")
DOC_BEGIN = ("<!-- bench_slurm_preempt:begin (rendered by benchmarks/bench_slurm_preempt.py from "
             "benchmarks/results/slurm_preempt.json) -->")
DOC_END = "<!-- bench_slurm_preempt:end -->"
END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def requeued(recs: list[dict[str, Any]], t_fault: float, t_started: float | None) -> dict[str, Any]:
    """Pure: from the metrics records of both runs (one file, in order) and when the requeued run started, the last
    step trained before it, the step it resumed after, the steps trained twice, and when its first step was logged
    (seconds from ``t_fault``)."""
    first_run = [r for r in recs if t_started is None or r["time"] < t_started]
    second = [r for r in recs if t_started is not None and r["time"] >= t_started]
    trained = max((r["step"] for r in first_run), default=0)
    resumed = (min(r["step"] for r in second) - 1) if second else None
    return {"trained": trained, "resumed_from": resumed,
            "steps_lost": trained - resumed if resumed is not None else None,
            "trained_before_signal": max((r["step"] for r in recs if r["time"] <= t_fault), default=0),
            "first_step_s": round(min(r["time"] for r in second) - t_fault, 3) if second else None,
            "started_s": round(t_started - t_fault, 3) if t_started is not None else None}


def drain_times(events: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
    """Pure: from the deadpool job's timeline, when the launchers heard the SIGTERM and when rank 0's newest step was
    persisted and verified (seconds from ``t_fault``), and which step."""
    heard = [e.get("requested_at") or e["time"] for e in events if e.get("event") == "drain"]
    done = [e for e in events if e.get("event") == "drained" and e.get("source") != "launcher"
            and e.get("persisted") is not None]
    return {"heard_s": round(min(heard) - t_fault, 3) if heard else None,
            "persisted_s": round(min(e["time"] for e in done) - t_fault, 3) if done else None,
            "persisted_step": done[0]["persisted"] if done else None,
            "persist_took_s": done[0].get("seconds") if done else None}


def one_run(mode: str, workdir: str, args: argparse.Namespace, tag: str, *, fault: bool) -> dict[str, Any]:
    nodes = NNODES + (1 if mode == "deadpool" else 0)
    bed = HostBed(NNODES + 2, workdir=workdir, shm_size="6g")
    bed.start()
    slurm = SlurmBed(bed, nodes=NNODES + 1, workdir=workdir, cred_expire_s=args.cred_expire_s)
    try:
        bed.start_etcd(secrets.token_urlsafe(24), members=3)
        slurm.start()
        cfg = os.path.join(workdir, f"{tag}.ds.json")
        write_config(cfg, args.micro_batch, deadpool=mode == "deadpool")
        metrics = os.path.join(workdir, f"{tag}.jsonl")
        ckpt = os.path.join(workdir, f"{tag}.ckpt")
        script = ["scripts/pretrain_gpt.py", "--deepspeed_config", cfg, "--model-size", args.size,
                  "--train-iters", str(args.steps), "--metrics-out", metrics, "--seed", str(args.seed)]
        states: list[tuple[float, str]] = []

        def preempt(s: SlurmBed, run: SlurmRun) -> None:
            s.cmd("sbatch", "--parsable", "--partition", "urgent", "--nodes", str(NNODES + 1), "--output",
                  "/dev/null", "--wrap", "true")
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline:  # the job's states as Slurm moves it: requeued, held, started again
                info = s.job(run.job_id)
                state = f"{info.get('JobState')} restarts={info.get('Restarts')} reason={info.get('Reason')}"
                if not states or states[-1][1] != state:
                    states.append((time.time(), state))
                if info.get("JobState") == "RUNNING" and info.get("Restarts") == "1" or info.get("JobState") in \
                        END_STATES:
                    return
                time.sleep(0.1)

        if mode == "deadpool":
            run = run_sbatch(slurm, workdir, [*script, "--save", ckpt, "--load", ckpt], metrics, nodes=nodes,
                             spares=1, name=tag, fault=preempt if fault else None, fault_step=args.preempt_step,
                             launcher_flags=("--leader-ttl-s", str(args.leader_ttl_s), "--preempt-grace-s",
                                             str(args.preempt_grace_s)),
                             timeout_s=args.timeout_s, end_states=END_STATES)
        else:
            run = run_sbatch(slurm, workdir, [*script, "--save", ckpt, "--save-interval", "1", "--load", ckpt],
                             metrics, nodes=nodes, spares=0, name=tag, batch_script=RELAUNCH_SCRIPT,
                             fault=preempt if fault else None, fault_step=args.preempt_step,
                             timeout_s=args.timeout_s, end_states=END_STATES)
        recs = records(metrics)
        losses: dict[str, float] = {}
        for r in recs:  # each step's last loss: a step trained twice keeps the requeued run's
            losses[str(r["step"])] = r["loss"]
        out: dict[str, Any] = {"mode": mode, "tag": tag, "job_state": run.job.get("JobState"),
                               "restarts": run.job.get("Restarts"), "losses": losses,
                               "steps_seen": [r["step"] for r in recs],
                               "step_time_s": statistics.median([r["step_time_s"] for r in recs if r["step"] > 1])
                               if len(recs) > 1 else None}
        if run.t_fault is not None:
            started = next((t for t, st in states if st.startswith("RUNNING") and "restarts=1" in st), None)
            out.update(requeued(recs, run.t_fault, started))
            out["slurm_states"] = [(round(t - run.t_fault, 3), st) for t, st in states]
            if mode == "deadpool":
                out.update(drain_times(run.events, run.t_fault))
        return out
    finally:
        slurm.stop()
        bed.close()


def table(doc: dict[str, Any]) -> list[str]:
    ref = doc["reference"]["losses"]
    lines = ["| mode | SIGTERM heard (s) | newest step verified on tier 3 (s) | steps trained | resumed after step | "
             "steps lost | requeued run started (s) | its first step (s) | losses identical | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in doc["modes"]:
        runs = doc["runs"][mode]
        ident = sum(1 for r in runs if r["losses"] == ref)
        cells = [_med([r.get(k) for r in runs], 0 if k in ("trained", "resumed_from", "steps_lost") else 2)
                 for k in ("heard_s", "persisted_s", "trained", "resumed_from", "steps_lost", "started_s",
                           "first_step_s")]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {ident}/{len(runs)} | {len(runs)} |")
    return lines


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    timers = ", ".join(f"{k}={v}" for k, v in doc["slurm_timers"].items())
    step = doc["reference"].get("step_time_s") or 0.0
    lines = [f"# Preempted under Slurm, then requeued: deadpool's drain vs requeue + relaunch (GPT {doc['size']})", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {m.get('cpu_count')} CPUs, git {(m.get('git') or {}).get('commit', '')[:10]}, "
             f"{m.get('time_utc')}; total wall {doc['wall_s']:.0f} s.", "",
             f"Setup: Slurm 22.05 on the namespace bed ({timers}; SchedulerParameters {doc.get('scheduler')}; "
             f"cred_expire {doc.get('cred_expire_s') or 120} s: how long Slurm holds a requeued job); GPT "
             f"{doc['size']}, ZeRO-3, 3 nodes x 1 process, micro-batch {doc['micro_batch']}, {doc['steps']} steps; a "
             f"job of partition `urgent` (PreemptMode=REQUEUE) that needs every node submitted once step "
             f"{doc['preempt_step']} is logged; deadpool-run's drain budget `--preempt-grace-s "
             f"{doc['preempt_grace_s']}` (KillWait {doc['slurm_timers'].get('KillWait')} s). Times from that "
             f"submission; medians with each run in brackets; the modes alternated, each on a fresh bed. Fault-free "
             f"step time {step:.2f} s.", "", *table(doc), "",
             "deadpool: `sbatch --nodes 4 scripts/slurm/deadpool.sbatch` (3 nodes + 1 spare, snapshots every step, "
             "`--save DIR --load DIR`: tier 3 written by the drain, no base on a schedule); relaunch: `sbatch --nodes "
             "3 --requeue benchmarks/slurm/relaunch.sbatch` (torchrun per node, a checkpoint every step, `--load` on "
             "restart). Steps lost: trained before the requeue and trained again after it. Both wait the same "
             "cred_expire before the requeued run may start."]
    return "\n".join(lines) + "\n"


def write_doc_block(doc: dict[str, Any]) -> None:
    """The measured block of docs/slurm.md, between its markers, rendered from ``doc`` (never typed)."""
    replace_doc_block(DOC, DOC_BEGIN, DOC_END, [
        f"Measured {doc['machine'].get('time_utc')} (GPT {doc['size']}, git "
        f"{(doc['machine'].get('git') or {}).get('commit', '')[:10]}, cred_expire {doc.get('cred_expire_s') or 120} "
        f"s; `benchmarks/results/{doc['name']}.md`):", "", *table(doc)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--preempt-step", type=int, default=3)
    p.add_argument("--preempt-grace-s", type=int, default=6,
                   help="deadpool-run's drain budget (under the bed's KillWait of 10 s)")
    p.add_argument("--cred-expire-s", type=int, default=None,
                   help="Slurm's credential lifetime, also its hold on a requeued job (default: Slurm's, 120 s)")
    p.add_argument("--leader-ttl-s", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--no-docs", action="store_true",
                   help="do not rewrite the measured block of docs/slurm.md (with --render-only: from that JSON)")
    add_output_args(p, "slurm_preempt")
    args = p.parse_args(argv)
    if args.render_only:
        render_only(args.render_only, render)
        if not args.no_docs:
            with open(args.render_only) as fh:
                write_doc_block(json.load(fh))
        return 0
    if not 1 <= args.preempt_step < args.steps - 1 or args.repeats < 1:
        p.error("--preempt-step must be within 1 .. --steps - 2, and --repeats >= 1")
    why = missing_requirements() or missing_slurm()
    if why is not None:
        raise SystemExit(f"bench_slurm_preempt: {why}")
    t0 = time.time()
    doc: dict[str, Any] = {"name": args.name, "command": "python " + " ".join(["benchmarks/bench_slurm_preempt.py",
                                                                               *(argv or sys.argv[1:])]),
                           "machine": machine_info(), "size": args.size, "micro_batch": args.micro_batch,
                           "steps": args.steps, "preempt_step": args.preempt_step,
                           "preempt_grace_s": args.preempt_grace_s, "slurm_timers": dict(SLURM_TIMERS),
                           "scheduler": SCHEDULER_PARAMETERS, "cred_expire_s": args.cred_expire_s,
                           "modes": list(MODES), "runs": {m: [] for m in MODES}}
    with tempfile.TemporaryDirectory(prefix="bench_slurm_preempt_") as work:
        print("[bench] reference (deadpool script, no fault)", flush=True)
        doc["reference"] = one_run("deadpool", work, args, "ref", fault=False)
        for i in range(args.repeats):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                rec = one_run(mode, work, args, f"{mode}{i}", fault=True)
                doc["runs"][mode].append(rec)
                print(f"[bench] {mode} #{i}: " + json.dumps({k: rec.get(k) for k in (
                    "job_state", "restarts", "heard_s", "persisted_s", "persisted_step", "trained", "resumed_from",
                    "steps_lost", "started_s", "first_step_s")}) + f", losses identical "
                    f"{rec['losses'] == doc['reference']['losses']}", flush=True)
    doc["wall_s"] = time.time() - t0
    print(save_result(args.out, args.name, doc, render))
    if not args.no_docs:
        write_doc_block(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
