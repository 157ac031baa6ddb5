#!/usr/bin/env python
"""Node down -> every rank restored, under a real Slurm: deadpool-run's spare of the allocation against the plain
relaunch that Slurm users get today, side by side in one run.

The Slurm bed (``deadpool_ext/testing/slurm.py``: munged and slurmctld on a control host, one slurmd per namespace
host, a 3-member etcd on the bridge); GPT (``--size``), DeepSpeed ZeRO-3, 3 nodes x 1 process. In each run node 2's
slurmd and every process on it are SIGKILLed (the machine lost) after step ``--kill-step``. Modes:

* ``deadpool``  ``sbatch --nodes 4 scripts/slurm/deadpool.sbatch`` (docs/slurm.md, unchanged): 3 nodes + 1 spare,
                snapshots every step, one peer replica, the etcd store; the spare node takes node 2's rank in place;
* ``relaunch``  ``sbatch --nodes 3 benchmarks/slurm/relaunch.sbatch`` (``--requeue``; srun torchrun per node), the
                script persisting a checkpoint every step (``--save --save-interval 1``) and resuming from the newest
                (``--load``): Slurm finds the node down (``SlurmdTimeout``), ends the job, requeues it, starts it again
                on the 3 nodes left, and it resumes from its last checkpoint.

Measured per run, from the SIGKILL: **restored** = the first step after the last one logged before the kill,
completed by every rank (the job is back where it was); for relaunch also when Slurm ended the job and when it
started the requeued one, for deadpool the timeline's phases. Losses compared bit for bit with a fault-free run of
the deadpool script (``reference``). Modes alternate repeat by repeat, each on a fresh bed.

    flock /tmp/deadpool-bench.lock python benchmarks/bench_slurm.py                 # GPT small, 2 repeats (~8 min)
    flock /tmp/deadpool-bench.lock python benchmarks/bench_slurm.py --size tiny --repeats 1   # smoke (~2 min)

Needs root and slurm-wlm + munge. Writes ``benchmarks/results/slurm.json`` and ``.md`` (``--name``) and the
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

from common import add_output_args, machine_info, render_only, save_result  # noqa: E402

from deadpool_ext.recovery.timeline import phases  # noqa: E402
from deadpool_ext.testing.hosts import HostBed, missing_requirements  # noqa: E402
from deadpool_ext.testing.launch import read_metrics  # noqa: E402
from deadpool_ext.testing.slurm import SCHEDULER_PARAMETERS, SLURM_TIMERS, SlurmBed, missing_slurm  # noqa: E402
from deadpool_ext.testing.slurmjob import SlurmRun, run_sbatch  # noqa: E402

MODES = ("deadpool", "relaunch")
RELAUNCH_SCRIPT = os.path.join(REPO, "benchmarks", "slurm", "relaunch.sbatch")
DOC = os.path.join(REPO, "docs", "slurm.md")
DOC_BEGIN = "<!-- bench_slurm:begin (rendered by benchmarks/bench_slurm.py from benchmarks/results/slurm.json) -->"
DOC_END = "<!-- bench_slurm:end -->"
NNODES, VICTIM = 3, 2


def write_config(path: str, micro_batch: int, deadpool: bool) -> None:
    with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        cfg = json.load(fh)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg.pop("deadpool", None)
    if deadpool:
        cfg["deadpool"] = {"enabled": True, "snapshot": {"interval": 1}, "replication": {"factor": 1}}
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def records(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def restored_after(recs: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
    """Pure: the last step logged before the fault and when the first step past it was logged after it."""
    before = [r["step"] for r in recs if r["time"] <= t_fault]
    last = max(before, default=0)
    after = [r["time"] for r in recs if r["time"] > t_fault and r["step"] > last]
    return {"last_step_before": last, "restored_s": round(min(after) - t_fault, 3) if after else None}


def one_run(mode: str, workdir: str, args: argparse.Namespace, tag: str, *, fault: bool) -> dict[str, Any]:
    # the same 4-node cluster for both: deadpool's allocation takes all 4 (one a spare), the relaunch job 3 (the
    # fourth is where its requeued run finds a third node)
    nodes = NNODES + (1 if mode == "deadpool" else 0)
    bed = HostBed(NNODES + 2, workdir=workdir, shm_size="6g")
    bed.start()
    slurm = SlurmBed(bed, nodes=NNODES + 1, workdir=workdir)
    try:
        bed.start_etcd(secrets.token_urlsafe(24), members=3)
        slurm.start()
        cfg = os.path.join(workdir, f"{tag}.ds.json")
        write_config(cfg, args.micro_batch, deadpool=mode == "deadpool")
        metrics = os.path.join(workdir, f"{tag}.jsonl")
        script = ["scripts/pretrain_gpt.py", "--deepspeed_config", cfg, "--model-size", args.size,
                  "--train-iters", str(args.kill_step + args.steps_after), "--metrics-out", metrics,
                  "--seed", str(args.seed)]
        states: list[tuple[float, str]] = []

        def kill(s: SlurmBed, run: SlurmRun) -> None:
            s.kill_node(VICTIM)
            if mode != "relaunch":
                return
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline:   # the job's states as Slurm moves it: failed, requeued, started
                info = s.job(run.job_id)
                state = f"{info.get('JobState')} restarts={info.get('Restarts')} reason={info.get('Reason')}"
                if not states or states[-1][1] != state:
                    states.append((time.time(), state))
                if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                    return
                time.sleep(0.1)

        if mode == "deadpool":
            run = run_sbatch(slurm, workdir, script, metrics, nodes=nodes, spares=1, name=tag,
                             launcher_flags=("--leader-ttl-s", str(args.leader_ttl_s)),
                             fault=kill if fault else None, fault_step=args.kill_step, timeout_s=args.timeout_s)
        else:
            ckpt = os.path.join(workdir, f"{tag}.ckpt")
            run = run_sbatch(slurm, workdir, [*script, "--save", ckpt, "--save-interval", "1", "--load", ckpt],
                             metrics, nodes=nodes, spares=0, name=tag, batch_script=RELAUNCH_SCRIPT,
                             fault=kill if fault else None, fault_step=args.kill_step, timeout_s=args.timeout_s,
                             end_states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
        recs = records(metrics)
        out: dict[str, Any] = {"mode": mode, "tag": tag, "job_state": run.job.get("JobState"),
                               "restarts": run.job.get("Restarts"), "losses": {str(k): v for k, v in
                                                                                read_metrics(metrics).items()},
                               "step_time_s": statistics.median([r["step_time_s"] for r in recs
                                                                 if r["step"] > 1]) if len(recs) > 1 else None}
        if run.t_fault is not None:
            out.update(restored_after(recs, run.t_fault))
            out["slurm_states"] = [(round(t - run.t_fault, 3), s) for t, s in states]
            ph = phases(run.events)
            out["phases"] = ph[0] if ph else None
            out["replaced"] = [e["replaced"] for e in run.events if e.get("event") == "assignment"]
        return out
    finally:
        slurm.stop()
        bed.close()


def _med(vals: list[Any], d: int = 2) -> str:
    """The median of ``vals`` (Nones left out) with each value in brackets, ``d`` decimals; "-" for none."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    each = ", ".join(f"{v:.{d}f}" for v in vals)
    return f"{statistics.median(vals):.{d}f} ({each})" if len(vals) > 1 else f"{vals[0]:.{d}f}"


def _state_at(run: dict[str, Any], prefix: str) -> float | None:
    """When the requeued run (restarts=1) was first in a state starting with ``prefix`` ("" : any state)."""
    for t, state in run.get("slurm_states") or []:
        if state.startswith(prefix) and "restarts=1" in state:
            return float(t)
    return None


def _pending_reasons(run: dict[str, Any]) -> list[str]:
    return sorted({s.split("reason=", 1)[1] for _, s in run.get("slurm_states") or []
                   if s.startswith("PENDING") and "reason=" in s})


def table(doc: dict[str, Any]) -> list[str]:
    """The measured table (also the block of docs/slurm.md)."""
    ref = doc["reference"]["losses"]
    lines = ["| mode | node down -> every rank restored (s) | Slurm requeued the job (s) | requeued run started (s) "
             "| losses identical | runs |", "|---|---|---|---|---|---|"]
    for mode in doc["modes"]:
        runs = doc["runs"][mode]
        ident = sum(1 for r in runs if r["losses"] == ref)
        requeued = _med([_state_at(r, "") for r in runs]) if mode == "relaunch" else "- (the job runs on)"
        again = _med([_state_at(r, "RUNNING") for r in runs]) if mode == "relaunch" else "-"
        lines.append(f"| {mode} | {_med([r.get('restored_s') for r in runs])} | {requeued} | {again} | "
                     f"{ident}/{len(runs)} | {len(runs)} |")
    reasons = sorted({x for r in doc["runs"].get("relaunch", []) for x in _pending_reasons(r)})
    if reasons:
        lines += ["", f"The requeued job waited as PENDING with Slurm's reason(s) {', '.join(reasons)}."]
    dp, rl = doc["runs"].get("deadpool"), doc["runs"].get("relaunch")
    if dp and rl:
        a = [r["restored_s"] for r in dp if r.get("restored_s")]
        b = [r["restored_s"] for r in rl if r.get("restored_s")]
        if a and b:
            lines += ["", f"Relaunch / deadpool, medians: {statistics.median(b) / statistics.median(a):.1f}x "
                      f"(relaunch {min(b):.2f}-{max(b):.2f} s, deadpool {min(a):.2f}-{max(a):.2f} s)."]
    return lines


def render(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    timers = ", ".join(f"{k}={v}" for k, v in doc["slurm_timers"].items())
    lines = [f"# Node down under Slurm: deadpool spare vs requeue + relaunch (GPT {doc['size']})", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {m.get('cpu_count')} CPUs, git {(m.get('git') or {}).get('commit', '')[:10]}, "
             f"{m.get('time_utc')}; total wall {doc['wall_s']:.0f} s.", "",
             f"Setup: Slurm 22.05 on the namespace bed ({timers}; SchedulerParameters "
             f"{doc.get('scheduler') or 'default (sched_interval=60)'}; cred_expire "
             f"{doc.get('cred_expire_s') or 'default (120 s)'}); GPT {doc['size']}, ZeRO-3, 3 nodes x 1 process, "
             f"micro-batch {doc['micro_batch']}; node {VICTIM}'s slurmd and every process on it SIGKILLed after step "
             f"{doc['kill_step']} of {doc['kill_step'] + doc['steps_after']}. Times from the SIGKILL; medians with "
             "each run in brackets; the modes alternated run by run, each on a fresh bed. Fault-free step time "
             f"{doc['reference'].get('step_time_s') or 0:.2f} s.", "", *table(doc), "",
             "deadpool: `sbatch --nodes 4 scripts/slurm/deadpool.sbatch` (3 nodes + 1 spare, snapshots every step); "
             "relaunch: `sbatch --nodes 3 --requeue benchmarks/slurm/relaunch.sbatch` (torchrun per node, a "
             "checkpoint every step, `--load` on restart). Slurm ends the relaunch job only once it finds the node "
             f"down: SlurmdTimeout is {doc['slurm_timers'].get('SlurmdTimeout')} s here (Slurm's default: 300 s)."]
    return "\n".join(lines) + "\n"


def replace_doc_block(path: str, begin: str, end: str, block: list[str]) -> None:
    """Rewrite the lines between the markers ``begin`` and ``end`` of ``path`` with ``block`` (a rendered result,
    never typed); one line naming the file and the markers when they are missing."""
    with open(path) as fh:
        text = fh.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: the markers {begin!r} ... {end!r} are missing")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as fh:
        fh.write(head + begin + "\n" + "\n".join(block) + "\n" + end + tail)


def write_doc_block(doc: dict[str, Any]) -> None:
    replace_doc_block(DOC, DOC_BEGIN, DOC_END, [
        f"Measured {doc['machine'].get('time_utc')} (GPT {doc['size']}, git "
        f"{(doc['machine'].get('git') or {}).get('commit', '')[:10]}; `benchmarks/results/{doc['name']}.md`):", "",
        *table(doc)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--steps-after", type=int, default=3)
    p.add_argument("--leader-ttl-s", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--no-docs", action="store_true",
                   help="do not rewrite the measured block of docs/slurm.md (with --render-only: from that JSON)")
    add_output_args(p, "slurm")
    args = p.parse_args(argv)
    if args.render_only:
        render_only(args.render_only, render)
        if not args.no_docs:
            with open(args.render_only) as fh:
                write_doc_block(json.load(fh))
        return 0
    why = missing_requirements() or missing_slurm()
    if why is not None:
        raise SystemExit(f"bench_slurm: {why}")
    t0 = time.time()
    doc: dict[str, Any] = {"name": args.name, "command": "python " + " ".join(["benchmarks/bench_slurm.py",
                                                                               *(argv or sys.argv[1:])]),
                           "machine": machine_info(), "size": args.size, "micro_batch": args.micro_batch,
                           "kill_step": args.kill_step, "steps_after": args.steps_after,
                           "slurm_timers": dict(SLURM_TIMERS), "scheduler": SCHEDULER_PARAMETERS,
                           "cred_expire_s": None, "modes": list(MODES),
                           "runs": {m: [] for m in MODES}}
    with tempfile.TemporaryDirectory(prefix="bench_slurm_") as work:
        print("[bench] reference (deadpool script, no fault)", flush=True)
        doc["reference"] = one_run("deadpool", work, args, "ref", fault=False)
        for i in range(args.repeats):
            for mode in MODES:
                rec = one_run(mode, work, args, f"{mode}{i}", fault=True)
                doc["runs"][mode].append(rec)
                print(f"[bench] {mode} #{i}: restored {rec.get('restored_s')} s, state {rec['job_state']}, "
                      f"restarts {rec['restarts']}, losses identical {rec['losses'] == doc['reference']['losses']}",
                      flush=True)
    doc["wall_s"] = time.time() - t0
    print(save_result(args.out, args.name, doc, render))
    if not args.no_docs:
        write_doc_block(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
