"""A campaign: scenarios run one after another, each checked against its layout's fault-free baseline.

With a :class:`~deadpool_ext.chaos.journal.Journal` the campaign runs in pieces: trials the journal holds are
skipped, its baselines reused, each finished trial appended; ``stop_after_s`` stops starting new trials once that
much time has passed (what is left is counted as ``pending``)."""
from __future__ import annotations

import os
import tempfile
import time

from .check import check_trial
from .journal import Journal
from .report import summarize
from .runner import JobRun, Runner


def _baseline(runner: Runner, journal: Journal | None, layout: str, iters: int, log) -> JobRun:
    key = (layout, iters)
    if journal is not None and key not in runner.baselines:
        rec = journal.baseline(layout, iters)
        if rec is not None:
            log(f"[chaos] baseline {layout} ({iters} steps) from the journal ({journal.path})")
            runner.baselines[key] = JobRun(returncode=0, timed_out=False, elapsed_s=rec["elapsed_s"], output="",
                                           metrics=rec["metrics"])
        else:
            base = runner.baseline(layout, iters)
            journal.add_baseline(layout, iters, base.metrics, base.elapsed_s)
    return runner.baseline(layout, iters)


def run_campaign(scenarios, *, workdir: str | None = None, job_timeout_s: float = 480.0, log=print,
                 journal: Journal | None = None, stop_after_s: float | None = None) -> dict:
    """Run the scenarios one after another (baselines first, once per layout); returns rows + summary (every
    trial of the journal when one is given)."""
    workdir = workdir or tempfile.mkdtemp(prefix="deadpool-chaos-")
    runner = Runner(workdir, job_timeout_s=job_timeout_s, log=log)
    rows = []
    t0 = time.time()
    pending = 0
    try:
        for sc in scenarios:
            key = sc.reproduce()
            if journal is not None and journal.has(key):
                continue
            if stop_after_s is not None and time.time() - t0 > stop_after_s:
                pending += 1
                continue
            base = _baseline(runner, journal, sc.layout, sc.iters, log)
            log(f"[chaos] trial {sc.trial} ({sc.layout}, {sc.fault.value}): {sc.describe()}")
            start = time.time()
            tr = runner.run_trial(sc)
            verdict = check_trial(tr, base.metrics)
            log(f"[chaos] trial {sc.trial}: {verdict.status}" + (f" - {verdict.problems}" if verdict.problems else ""))
            row = {"scenario": sc.to_json(), "verdict": verdict.to_json(), "elapsed_s": time.time() - start,
                   "injected": tr.injected, "workdir": tr.workdir}
            rows.append(row)
            if journal is not None:
                journal.add_trial(key, row)
    finally:
        runner.close()
    if pending:
        log(f"[chaos] time budget of {stop_after_s:.0f} s spent: {pending} trial(s) not started "
            "(run the same command again to continue from the journal)")
    every = journal.rows() if journal is not None else rows
    return {"rows": every, "summary": {**summarize(every), "pending": pending, "ran_now": len(rows)},
            "workdir": os.path.abspath(workdir), "elapsed_s": time.time() - t0,
            "baselines": {f"{k[0]}/{k[1]}": {"elapsed_s": b.elapsed_s} for k, b in runner.baselines.items()}}
