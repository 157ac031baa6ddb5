"""A campaign: scenarios run one after another, each checked against its layout's fault-free baseline."""
from __future__ import annotations

import os
import tempfile
import time

from .check import check_trial
from .report import summarize
from .runner import Runner


def run_campaign(scenarios, *, workdir: str | None = None, job_timeout_s: float = 480.0, log=print) -> dict:
    """Run the scenarios one after another (baselines first, once per layout); returns rows + summary."""
    workdir = workdir or tempfile.mkdtemp(prefix="deadpool-chaos-")
    runner = Runner(workdir, job_timeout_s=job_timeout_s, log=log)
    rows = []
    t0 = time.time()
    try:
        for sc in scenarios:
            base = runner.baseline(sc.layout, sc.iters)
            log(f"[chaos] trial {sc.trial} ({sc.layout}, {sc.fault.value}): {sc.describe()}")
            start = time.time()
            tr = runner.run_trial(sc)
            verdict = check_trial(tr, base.metrics)
            log(f"[chaos] trial {sc.trial}: {verdict.status}" + (f" - {verdict.problems}" if verdict.problems else ""))
            rows.append({"scenario": sc.to_json(), "verdict": verdict.to_json(), "elapsed_s": time.time() - start,
                         "injected": tr.injected, "workdir": tr.workdir})
    finally:
        runner.close()
    return {"rows": rows, "summary": summarize(rows), "workdir": os.path.abspath(workdir),
            "elapsed_s": time.time() - t0,
            "baselines": {f"{k[0]}/{k[1]}": {"elapsed_s": b.elapsed_s} for k, b in runner.baselines.items()}}
