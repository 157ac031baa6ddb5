"""Monte Carlo evaluation of a policy and the interval search behind the recommendation.

:func:`evaluate` runs one policy over ``sim.trials`` seeded failure traces (the same traces for every policy)
and summarizes goodput (mean, standard deviation, 5th and 95th percentiles) and where the lost time went.
:func:`search` tries each policy over a grid of intervals, centred where an analytic estimate puts the optimum
(Young/Daly for persistent checkpoints), refines around the best grid point, and keeps each policy's best.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .analytic import daly_interval
from .costs import Derived, derive
from .engine import CATEGORIES, run_trial
from .failures import Failure, sample_trace
from .params import Params, SimParamError
from .policies import POLICY_NAMES, Policy, make_policy

Progress = Callable[[str], None]


@dataclass(slots=True)
class Summary:
    """One policy with fixed intervals over all trials."""

    policy: str
    intervals: dict[str, int]
    goodput_mean: float
    goodput_std: float
    goodput_p5: float
    goodput_p95: float
    breakdown: dict[str, float]
    """Mean fraction of wall time per category (sums to 1)."""
    failures_mean: float
    restores_mean: dict[str, float]
    waits_mean: float
    memory_bytes_per_node: float
    fits_memory: bool
    trials: int
    shrinks_mean: float = 0.0
    """Replicas that left the job per trial (``cluster.no_spare_policy = shrink``)."""
    capacity_mean: float = 1.0
    """Mean time-average fraction of the replicas in the job (an upper bound on goodput)."""
    stopped_share: float = 0.0
    """Share of the trials in which the job stopped for want of a spare (``fail``)."""
    stopped_day_mean: float | None = None
    """Mean day on which those trials stopped; None when none did."""
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _pct(values: Sequence[float], q: float) -> float:
    vals = sorted(values)
    pos = (len(vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


class Evaluator:
    """Holds one cluster's derived times and its failure traces, so every policy sees the same traces."""

    def __init__(self, params: Params) -> None:
        self.params = params
        self.d: Derived = derive(params)
        self.horizon_s = params.sim.horizon_days * 86_400.0
        self.traces: list[list[Failure]] = [
            sample_trace(self.d, self.horizon_s, seed=params.sim.seed, trial=i) for i in range(params.sim.trials)]
        self.evaluations = 0

    def evaluate(self, policy: Policy) -> Summary:
        self.evaluations += 1
        results = [run_trial(policy, self.d, tr, self.horizon_s) for tr in self.traces]
        goodputs = [r.goodput for r in results]
        n = len(results)
        breakdown = {c: sum(r.breakdown[c] for r in results) / n / self.horizon_s for c in CATEGORIES}
        mem = policy.memory_bytes_per_node(self.d)
        stops = [r.stopped_s / 86_400.0 for r in results if r.stopped_s is not None]
        return Summary(
            policy=policy.name, intervals=policy.intervals(), goodput_mean=statistics.fmean(goodputs),
            goodput_std=statistics.pstdev(goodputs) if n > 1 else 0.0, goodput_p5=_pct(goodputs, 0.05),
            goodput_p95=_pct(goodputs, 0.95), breakdown=breakdown,
            failures_mean=sum(r.failures for r in results) / n,
            restores_mean={k: sum(r.restores[k] for r in results) / n for k in ("local", "peer", "storage")},
            waits_mean=sum(r.waits for r in results) / n, memory_bytes_per_node=mem,
            fits_memory=mem <= self.d.host_memory_bytes, trials=n, shrinks_mean=sum(r.shrinks for r in results) / n,
            capacity_mean=statistics.fmean(r.capacity for r in results), stopped_share=len(stops) / n,
            stopped_day_mean=statistics.fmean(stops) if stops else None)


def persist_center(d: Derived, asynchronous: bool) -> int:
    """Daly's optimum for a whole-job restart policy, in iterations (the async variant also needs the interval
    to cover one background write, or every checkpoint waits for the previous one)."""
    delta = d.d2h_s + d.persist_interference_s if asynchronous else d.d2h_s + d.storage_write_s
    mtbf = 1.0 / max(d.failure_rate_per_s + d.outage_rate_per_s, 1e-12)
    k = daly_interval(max(delta, 1e-6), mtbf) / d.iteration_s
    if asynchronous:
        k = max(k, d.storage_write_s / d.iteration_s)
    return max(1, round(k))


def memory_persist_center(d: Derived) -> int:
    """Persistent interval of the in-memory policies, in iterations: Young's optimum for the failures that lose
    memory (cluster outages) against the interference of one background write, and at least one write long."""
    k_min = math.ceil(d.storage_write_s / d.iteration_s)
    if d.outage_rate_per_s <= 0:
        return max(1, k_min, 10_000)
    k = daly_interval(max(d.persist_interference_s, 1e-6), 1.0 / d.outage_rate_per_s) / d.iteration_s
    return max(1, k_min, round(k))


MEMORY_GRID = (1, 2, 4, 8, 16, 32)
BASE_GRID = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
SPREAD = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)
REFINE = (0.8, 0.9, 1.12, 1.25)


def candidates(name: str, d: Derived, cap: int) -> list[dict[str, int]]:
    """First-pass interval grid of one policy."""
    if name in ("ckpt_sync", "ckpt_async"):
        c = persist_center(d, name == "ckpt_async")
        return [{"persist_interval": k} for k in sorted({min(cap, max(1, round(c * s))) for s in SPREAD})]
    if name in ("gemini", "deadpool"):
        kp = memory_persist_center(d)
        return [{"memory_interval": m, "persist_interval": p} for m in MEMORY_GRID
                for p in sorted({min(cap, max(1, round(kp * s))) for s in (0.5, 1.0, 2.0)})]
    if name == "tiercheck":
        return [{"base_interval": b} for b in BASE_GRID]
    raise SimParamError(f"unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")


def _refined(name: str, best: dict[str, int], cap: int) -> list[dict[str, int]]:
    """Second pass: the interval with the coarsest grid, around the first pass's best, others kept."""
    key = "base_interval" if name == "tiercheck" else "persist_interval"
    values = sorted({min(cap, max(1, round(best[key] * s))) for s in REFINE})
    return [{**best, key: k} for k in values if k != best[key]]


@dataclass(slots=True)
class PolicySearch:
    best: Summary
    tried: list[Summary]


def search(ev: Evaluator, names: Iterable[str] = POLICY_NAMES, progress: Progress | None = None
           ) -> dict[str, PolicySearch]:
    """Best intervals per policy by sweep (mean goodput over the trials)."""
    names = list(names)
    cap = max(1, int(ev.horizon_s / ev.d.iteration_s))
    out: dict[str, PolicySearch] = {}
    for i, name in enumerate(names):
        tried: list[Summary] = []
        grid = candidates(name, ev.d, cap)
        for j, iv in enumerate(grid):
            tried.append(ev.evaluate(make_policy(name, **iv)))
            if progress:
                progress(f"[{ev.params.cluster.gpus} GPUs] {name} ({i + 1}/{len(names)}): grid {j + 1}/{len(grid)} "
                         f"{iv} goodput {tried[-1].goodput_mean:.4f}")
        best = max(tried, key=lambda s: s.goodput_mean)
        for iv in _refined(name, best.intervals, cap):
            tried.append(ev.evaluate(make_policy(name, **iv)))
            if progress:
                progress(f"[{ev.params.cluster.gpus} GPUs] {name}: refine {iv} goodput {tried[-1].goodput_mean:.4f}")
        best = max(tried, key=lambda s: s.goodput_mean)
        out[name] = PolicySearch(best, tried)
    return out


def sweep_interval(ev: Evaluator, name: str, key: str, values: Iterable[int], fixed: dict[str, int] | None = None
                   ) -> list[Summary]:
    """Goodput of one policy along one interval (the others fixed): for plots and checks."""
    return [ev.evaluate(make_policy(name, **{**(fixed or {}), key: v})) for v in values]
