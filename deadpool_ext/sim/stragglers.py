"""Stragglers and preemptions at scale (issue 46, part 5): what evicting stragglers and draining on SIGTERM buy.

Pure Python (no torch), beside the failure engine (``engine.py``): a job of ``cluster.gpus`` on ``cluster.nodes``
nodes over ``sim.horizon_days``, Monte Carlo over ``sim.trials`` seeded traces.

**Stragglers** (:class:`StragglerModel`). Episodes start as a Poisson process at ``rate_per_node_day`` x nodes; each
makes one node ``slowdown`` times slower for an exponential duration of mean ``duration_h`` (until it recovers on
its own or is repaired). Training is synchronous, so while episodes overlap the job runs at the pace of the slowest:
its useful work per wall second is ``1 / max(slowdown)``. Two policies run against the same trace:

- ``keep``: the straggler stays until its episode ends (what every framework that only *detects* does);
- ``evict`` (``deadpool-run --straggler-action swap``): an episode whose slowdown reaches ``factor`` is named
  ``detect_s`` after its onset and its node swapped for a spare: the job stops for one hot-swap (``swap_s``:
  the calibrated hot-swap and restore from memory of :mod:`costs`, the lost node's share fetched from its peer and
  the interrupted iteration done again), then runs at full pace. The guards of ``launcher/straggler.py`` hold:
  no eviction with no spare in the pool (each evicted node is away ``cluster.node_repair_h``), at most one per
  ``detect_s`` window; a slowdown below ``factor`` is never seen.

**Preemptions** (:class:`PreemptionModel`). SIGTERMs to the whole job at ``rate_per_day``; each costs the
scheduler's requeue and the start-up (``costs.scheduler_s + costs.startup_s``) and the newest persisted state
read back, plus either

- ``kill``: the work since the last tier-3 base (``persist_interval_min`` apart: half of it in expectation), or
- ``drain`` (the default of deadpool-run): the newest in-memory version written to storage within the grace
  budget (one node's share over its storage bandwidth, plus the drain's fixed cost), nothing recomputed.

Goodput = useful seconds / wall seconds, per policy; the figures are the means over trials. The sources of every
default are in :data:`SOURCES` (typed-in assumptions are labelled as such) and ``docs/simulator.md``.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from .costs import Derived, derive
from .params import Params, SimParamError

SOURCES: dict[str, str] = {
    "stragglers.rate_per_node_day": "ASSUMPTION (typed in): no public per-node rate; ByteRobust and the Llama 3 "
                                    "report count stragglers among their events without a rate per node. Swept in "
                                    "benchmarks/bench_simulate_stragglers.py",
    "stragglers.slowdown": "ASSUMPTION (typed in): a throttled GPU or a degraded NIC (2: a GPU at half its clock); "
                           "swept 1.5-4",
    "stragglers.duration_h": "ASSUMPTION (typed in): an episode lasts until its node is drained and repaired",
    "stragglers.factor": "deadpool.straggler.factor's default (launcher/straggler.py)",
    "stragglers.detect_s": "deadpool.straggler.window_s's default, 30 s (uncalibrated: an upper bound; calibrated: "
                           "x the fraction of the window benchmarks/results/straggler.json measured to the naming)",
    "swap_s": "derived: costs.hotswap_fixed_s/hotswap_unready_s + costs.restore_fixed_s (calibrated from "
              "benchmarks/results/recovery.json) + the peer fetch of one node's share (bandwidth.peer_network_gbs) "
              "+ one iteration (workload.iteration_s)",
    "preemption.rate_per_day": "ASSUMPTION (typed in): a spot / preemptible partition; swept in the benchmark",
    "preemption.persist_interval_min": "ASSUMPTION (typed in): a tier-3 base every 30 minutes",
    "preemption.drain_fixed_s": "benchmarks/results/preempt.json: SIGTERM -> verified commit record p50 0.11 s "
                                "(tiny state: the drain's fixed cost; the bytes are priced by storage bandwidth)",
    "restart": "costs.scheduler_s + costs.startup_s (startup calibrated from benchmarks/results/recovery.json) + "
               "one node's share read from storage (bandwidth.storage_read_gbs)",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerModel:
    rate_per_node_day: float = 0.002
    """Straggler episodes per node per day (ASSUMPTION, see :data:`SOURCES`)."""
    slowdown: float = 2.0
    """How many times slower the job steps while the episode lasts (ASSUMPTION: a GPU at half its clock)."""
    duration_h: float = 6.0
    """Mean duration of an episode left alone, hours (ASSUMPTION)."""
    factor: float = 2.0
    """The eviction rule's factor: a slowdown below it is never named."""
    detect_s: float = 30.0
    """Onset -> eviction decision (the rule's window)."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("rate_per_node_day", 0.0, 100.0), ("slowdown", 1.0, 1000.0),
                             ("duration_h", 1e-6, 1e4), ("factor", 1.0, 1000.0), ("detect_s", 0.0, 86400.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise SimParamError(f"stragglers.{name}: must be a number in [{lo:g}, {hi:g}], got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionModel:
    rate_per_day: float = 1.0
    """SIGTERMs to the whole job per day (ASSUMPTION)."""
    persist_interval_min: float = 30.0
    """Minutes between tier-3 bases (ASSUMPTION): a preemption without a drain loses half of it on average."""
    drain_fixed_s: float = 0.11
    """The drain's fixed cost (measured: ``benchmarks/results/preempt.json``)."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("rate_per_day", 0.0, 1000.0), ("persist_interval_min", 0.0, 1e5),
                             ("drain_fixed_s", 0.0, 3600.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise SimParamError(f"preemption.{name}: must be a number in [{lo:g}, {hi:g}], got {v!r}")


STRAGGLER_FILE = "straggler.json"
"""The measured straggler benchmark (``benchmarks/bench_straggler.py``) in the results directory."""


def measured_detect_fraction(results_dir: str) -> tuple[float, str] | None:
    """Onset -> named over the rule's window, as ``straggler.json`` measured it (the median over its rounds), and
    where it came from; None when the file or its figures are absent."""
    import json
    import os

    path = os.path.join(results_dir, STRAGGLER_FILE)
    try:
        with open(path) as fh:
            doc = json.load(fh)
        named, window = float(doc["summary"]["named_s"]), float(doc["args"]["window"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (math.isfinite(named) and math.isfinite(window) and 0 < named and 0 < window):
        return None
    return min(1.0, named / window), f"benchmarks/results/{STRAGGLER_FILE}: summary.named_s / args.window"


def calibrated(m: StragglerModel, results_dir: str | None) -> tuple[StragglerModel, str]:
    """``m`` with ``detect_s`` = the window x the measured fraction (when measured), and the source said."""
    got = measured_detect_fraction(results_dir) if results_dir else None
    if got is None:
        return m, SOURCES["stragglers.detect_s"]
    fraction, source = got
    return (dataclasses.replace(m, detect_s=m.detect_s * fraction),
            f"{m.detect_s:g} s window x {fraction:.2f} measured ({source})")


def swap_s(d: Derived) -> float:
    """One eviction's stop: the hot-swap (in expectation over whether the spare built ahead for the node), the
    restore from memory, the lost node's share fetched from its peer, the interrupted iteration again."""
    return d.hotswap_s + d.restore_fixed_s + d.peer_fetch_s + d.iteration_s


def episodes(rng: random.Random, nodes: int, horizon_s: float, m: StragglerModel) -> list[tuple[float, float]]:
    """(onset, end) of every episode of one trial, in onset order."""
    rate = m.rate_per_node_day * nodes / 86_400.0
    out: list[tuple[float, float]] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        out.append((t, t + rng.expovariate(1.0 / (m.duration_h * 3600.0))))
    return out


def straggler_trial(eps: list[tuple[float, float]], horizon_s: float, m: StragglerModel, d: Derived,
                    repair_s: float, evict: bool) -> dict[str, float]:
    """Useful, slowed and swap seconds of one trace under one policy."""
    stop = swap_s(d)
    seen = evict and m.slowdown >= m.factor
    intervals: list[tuple[float, float]] = []
    stops: list[float] = []
    pool: list[float] = []   # when each spare in use comes back
    spares = d.spares
    last_eviction = -math.inf
    evictions = kept = 0
    for onset, end in eps:
        # named one window after the onset, evicted then, or once the last eviction is a window old and a spare
        # is back in the pool
        decide = max(onset, last_eviction) + m.detect_s
        busy = sorted(t for t in pool if t > decide)
        if spares <= 0:
            decide = math.inf
        elif len(busy) >= spares:
            decide = busy[len(busy) - spares]
        if seen and decide < end and decide < horizon_s:
            pool = [t for t in pool if t > decide]
            intervals.append((onset, decide))
            stops.append(decide)
            pool.append(decide + repair_s)
            last_eviction = decide
            evictions += 1
        else:
            intervals.append((onset, min(end, horizon_s)))
            kept += 1 if seen else 0
    # the job runs at 1/slowdown while any episode is on (all episodes have the same slowdown here)
    covered = _union(intervals)
    slowed = sum(b - a for a, b in covered)
    swap_total = min(len(stops) * stop, horizon_s)
    useful = (horizon_s - slowed) + slowed / m.slowdown - swap_total
    return {"useful_s": max(0.0, useful), "slowed_s": slowed, "swap_s": swap_total, "evictions": evictions,
            "kept_no_spare": kept, "episodes": len(eps)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def preemption_cost_s(d: Derived, p: PreemptionModel, drain: bool) -> float:
    """Wall seconds one preemption costs the job: requeue, start-up, load, and the drain's write or the work
    since the last base."""
    restart = d.restart_s + d.storage_read_s
    return restart + (p.drain_fixed_s + d.storage_write_s if drain else p.persist_interval_min * 60.0 / 2.0)


def simulate(params: Params, m: StragglerModel, p: PreemptionModel, *,
             detect_source: str | None = None) -> dict[str, Any]:
    """Both policies of each, over ``params.sim.trials`` traces of ``params.sim.horizon_days``. ``detect_source``:
    where ``m.detect_s`` came from, when not the default (:func:`calibrated`)."""
    d = derive(params)
    horizon = params.sim.horizon_days * 86_400.0
    repair_s = params.cluster.node_repair_h * 3600.0
    keep, evict = [], []
    counts = {"episodes": 0.0, "evictions": 0.0, "kept_no_spare": 0.0}
    for trial in range(params.sim.trials):
        rng = random.Random(f"stragglers:{params.sim.seed}:{trial}")
        eps = episodes(rng, d.nodes, horizon, m)
        k = straggler_trial(eps, horizon, m, d, repair_s, evict=False)
        e = straggler_trial(eps, horizon, m, d, repair_s, evict=True)
        keep.append(k["useful_s"] / horizon)
        evict.append(e["useful_s"] / horizon)
        for key in counts:
            counts[key] += e[key] / params.sim.trials
    per_day = p.rate_per_day / 86_400.0
    kill, drain = preemption_cost_s(d, p, drain=False), preemption_cost_s(d, p, drain=True)
    mean = sum(keep) / len(keep), sum(evict) / len(evict)
    return {
        "gpus": params.cluster.gpus, "nodes": d.nodes, "spares": d.spares,
        "stragglers": {**dataclasses.asdict(m), "swap_s": swap_s(d), "goodput_keep": mean[0],
                       "goodput_evict": mean[1], "gained": mean[1] - mean[0], **counts},
        "preemption": {**dataclasses.asdict(p), "cost_kill_s": kill, "cost_drain_s": drain,
                       "goodput_kill": max(0.0, 1.0 - per_day * kill), "goodput_drain": max(0.0, 1.0 - per_day * drain),
                       "gained": per_day * (kill - drain)},
        "sources": {**SOURCES, **({"stragglers.detect_s": detect_source} if detect_source else {})},
    }


__all__ = ["PreemptionModel", "SOURCES", "StragglerModel", "calibrated", "episodes", "measured_detect_fraction",
           "preemption_cost_s", "simulate", "straggler_trial", "swap_s"]
