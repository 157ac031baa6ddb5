"""A campaign: scenarios run one after another, each checked against its layout's fault-free baseline.

With a :class:`~deadpool_ext.chaos.journal.Journal` the campaign runs in pieces: trials the journal holds are
skipped, its baselines reused, each finished trial appended; ``stop_after_s`` stops starting new trials once that
much time has passed (what is left is counted as ``pending``)."""
from __future__ import annotations

import os
import tempfile
import time

from .check import check_trial
from .journal import Journal, Pieces
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
                 journal: Journal | None = None, stop_after_s: float | None = None,
                 replay_failed: bool = False) -> dict:
    """Run the scenarios one after another (baselines first, once per layout); returns rows + summary (every
    trial of the journal when one is given)."""
    workdir = workdir or tempfile.mkdtemp(prefix="deadpool-chaos-")
    runner = Runner(workdir, job_timeout_s=job_timeout_s, log=log)
    t0 = time.time()
    pieces = Pieces(journal, stop_after_s, log, "[chaos]", clock=lambda: time.time(), replay_failed=replay_failed)
    try:
        for sc in pieces.select(scenarios):
            base = _baseline(runner, journal, sc.layout, sc.iters, log)
            log(f"[chaos] trial {sc.trial} ({sc.layout}, {sc.fault.value}): {sc.describe()}")
            start = time.time()
            tr = runner.run_trial(sc)
            verdict = check_trial(tr, base.metrics)
            log(f"[chaos] trial {sc.trial}: {verdict.status}" + (f" - {verdict.problems}" if verdict.problems else ""))
            pieces.record(sc, {"scenario": sc.to_json(), "verdict": verdict.to_json(),
                               "elapsed_s": time.time() - start, "injected": tr.injected, "workdir": tr.workdir})
    finally:
        runner.close()
    every, counts = pieces.finish()
    return {"rows": every, "summary": {**summarize(every), **counts},
            "workdir": os.path.abspath(workdir), "elapsed_s": time.time() - t0,
            "baselines": {f"{k[0]}/{k[1]}": {"elapsed_s": b.elapsed_s} for k, b in runner.baselines.items()}}
