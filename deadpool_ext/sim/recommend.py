"""Which policy and which intervals to choose for one cluster: the sweep's winners, put side by side.

:func:`recommend` returns a plain dict (what ``deadpool simulate --json`` prints): the parameters used, the
derived phase times, every policy's best intervals with goodput and lost-time breakdown, the recommended
policy, and optionally the self-checks of :mod:`deadpool_ext.sim.checks`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .analytic import daly_interval, young_interval
from .calibration import Calibration
from .checks import failure_rate_check, paper_checks, young_daly_checks
from .params import LLAMA3_GPUS, Params
from .policies import POLICY_NAMES
from .sweep import Evaluator, Progress, search


def recommend(params: Params, *, policies: Iterable[str] = POLICY_NAMES, checks: bool = False,
              calibration: Calibration | None = None, progress: Progress | None = None) -> dict[str, Any]:
    ev = Evaluator(params)
    d = ev.d
    found = search(ev, policies, progress)
    best = {name: s.best for name, s in found.items()}
    fits = {n: b for n, b in best.items() if b.fits_memory} or best
    winner = max(fits.values(), key=lambda s: s.goodput_mean)
    delta = d.d2h_s + d.storage_write_s
    out: dict[str, Any] = {
        "params": params.to_dict(),
        "calibration": calibration.to_dict() if calibration else None,
        "derived": dataclasses.asdict(d) | {"mtbf_s": d.mtbf_s, "snapshot_background_s": d.snapshot_background_s,
                                             "hotswap_s": d.hotswap_s,
                                             "built_ahead_fraction": d.built_ahead_fraction},
        "policies": {n: b.to_dict() for n, b in best.items()},
        "tried": {n: [t.to_dict() for t in s.tried] for n, s in found.items()},
        "recommended": {"policy": winner.policy, "intervals": winner.intervals,
                        "goodput_mean": winner.goodput_mean,
                        "gain_vs": {n: winner.goodput_mean - b.goodput_mean for n, b in best.items()}},
        "analytic": {"sync_checkpoint_cost_s": delta,
                     "young_interval_iterations": young_interval(delta, d.mtbf_s) / d.iteration_s,
                     "daly_interval_iterations": daly_interval(delta, d.mtbf_s) / d.iteration_s},
        "evaluations": ev.evaluations,
    }
    if checks:
        if progress:
            progress("checks: Young/Daly sweep, failure sampler, paper figures")
        yd, rows = young_daly_checks(ev)
        ckpt16k = None
        if params.cluster.gpus == LLAMA3_GPUS and "ckpt_sync" in best:
            ckpt16k = best["ckpt_sync"].goodput_mean
        all_checks = [failure_rate_check(params), *yd, *paper_checks(params, ckpt16k)]
        out["checks"] = [c.to_dict() for c in all_checks]
        out["young_daly_sweep"] = [{"persist_interval": r.intervals["persist_interval"],
                                    "goodput_mean": r.goodput_mean, "goodput_std": r.goodput_std} for r in rows]
    return out
