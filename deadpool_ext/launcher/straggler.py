"""Stragglers (issue 46, part 1): which node is slow, and whether it is swapped for a spare (pure: no clock, store,
process or thread; the coordinator's shell calls :func:`judge` every turn with what the heartbeats said; a worker's
pace is sampled, and the rule run, at most every ``window_s / SAMPLES_PER_WINDOW`` seconds).

What tells a straggler. In synchronous training every rank takes the same wall time per step: each waits for the
slowest in its collectives. What differs is the time a rank spends *outside* collectives, its **busy** time per
step: the slow rank computes longer and waits least, the others wait for it. Every worker reports its pace in its
heartbeat (``rebuild/progress.py``: running totals of steps, their wall seconds and the training thread's seconds
inside collectives, timed by ``rebuild/swap.py``'s gloo groups and ``rebuild/timed_work.py`` for the waits of
asynchronous ones), so over the last ``window_s`` seconds the
coordinator has each rank's busy seconds per step: ``(wall - collectives) / steps``.

The rule, per node (a node is what a spare replaces; its busy time is its slowest rank's):

1. every active rank has been heard over a whole window of this generation with at least ``min_steps`` steps in it
   (a generation starts its windows afresh: a recovery is not a pace), and every rank's collectives are timed;
2. a node is **named** when its busy time is at least ``factor`` times the median of the *other* nodes' (with two
   nodes the job's median would be the mean of both, which caps any ratio below 2), over the window and over each
   half of it (it *stays* slow: one burst, a pause of a second, does not outweigh the rest of the window);
3. **never when the whole job is slow**: a uniform slowdown raises every node's busy time together (the ratios stay
   near 1); and if half the nodes or more are named at once, the slow ones are the job, and no one is named;
4. a node is named at most once per window (each naming books the seconds the job lost waiting for it over that
   window: ``lost_s``, the ledger's ``straggler`` cause);
5. with action ``swap`` a named node is evicted (its workers fail through the failed-node path: fenced, a spare
   takes their ranks, their state from memory), but **never with no spare left** (named only, said why) and **at
   most once per window** (a second eviction within ``window_s`` of the last is named only);
6. an evicted node is fenced (its processes killed) and recorded in :attr:`StragglerState.evicted`; it is never
   taken back under its name (the coordinator refuses a join by a node name of the job). A repaired machine comes
   back as a new spare (``deadpool-run --join NEWNAME``) and is judged by this rule again once it trains.

Once per window, named or not, a ``pace`` event (:func:`pace_event`) gives the job's step and its nodes' busy
times (the metrics' ``deadpool_step_seconds``, ``deadpool_busy_seconds``, ``deadpool_slowest_node_ratio``).

Actions: ``off`` (nothing), ``report`` (the default: named in the log, the timeline's ``straggler`` event and the
metrics), ``swap`` (named, then evicted under the guards). ``deadpool-run --straggler-action/--straggler-factor/
--straggler-window`` win over the job's ``deadpool.straggler`` section (written to the store by rank 0), which wins
over the defaults (:func:`resolve`).
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import operator
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cluster.assignment import Assignment
from .actions import Action, Event, Log

ACTIONS = ("off", "report", "swap")
DEFAULT_ACTION = "report"
DEFAULT_FACTOR = 2.0
DEFAULT_WINDOW_S = 30.0
MIN_STEPS = 3
"""Steps a window must hold for a rank's busy time to be judged (fewer: too few to say anything)."""
SAMPLES_PER_WINDOW = 16
"""Pace samples kept per worker and window (one every ``window_s / 16`` seconds at most)."""
SLICES = 2
"""The window's parts a node must be slow in, each on its own (besides the whole window)."""
MAX_FACTOR = 1000.0
MAX_WINDOW_S = 604800.0
"""A week (the config's longest duration)."""


@dataclass(frozen=True, slots=True)
class StragglerSettings:
    """The rule's knobs, and where each came from (said in the lines)."""

    action: str = DEFAULT_ACTION
    factor: float = DEFAULT_FACTOR
    window_s: float = DEFAULT_WINDOW_S
    min_steps: int = MIN_STEPS
    source: str = "default"
    """Where the action came from: ``--straggler-action``, ``deadpool.straggler.action`` or ``default``."""


def setting_error(action: Any, factor: Any, window_s: Any) -> str | None:
    """Why one of these values cannot be used (``must be ..., got ...``; the caller names the knob), None when
    each can (None: not given)."""
    if action is not None and action not in ACTIONS:
        return f"must be one of {', '.join(ACTIONS)}, got {action!r}"
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not math.isfinite(factor) or not 1.0 < factor <= MAX_FACTOR):
        return f"must be a number > 1 and <= {MAX_FACTOR:g}, got {factor!r}"
    if window_s is not None and (isinstance(window_s, bool) or not isinstance(window_s, (int, float))
                                 or not math.isfinite(window_s) or not 0 < window_s <= MAX_WINDOW_S):
        return f"must be a number of seconds in (0, {MAX_WINDOW_S:g}], got {window_s!r}"
    return None


def resolve(flag_action: str | None, flag_factor: float | None, flag_window_s: float | None,
            job: Mapping[str, Any] | None) -> StragglerSettings:
    """Each knob: the flag when given, else the job's ``deadpool.straggler`` value (``job``, as rank 0 wrote it;
    None: not written, or unusable), else the default."""
    job = job or {}

    def pick(flag: Any, key: str, default: Any) -> tuple[Any, str]:
        if flag is not None:
            return flag, "--straggler-" + key.replace("_s", "").replace("_", "-")
        if job.get(key) is not None:   # rank 0 writes the whole section: its defaults are the defaults
            return job[key], f"deadpool.straggler.{key}" if job[key] != default else "default"
        return default, "default"

    action, source = pick(flag_action, "action", DEFAULT_ACTION)
    factor, _ = pick(flag_factor, "factor", DEFAULT_FACTOR)
    window, _ = pick(flag_window_s, "window_s", DEFAULT_WINDOW_S)
    return StragglerSettings(action=str(action), factor=float(factor), window_s=float(window), source=source)


@dataclass(frozen=True, slots=True)
class Sample:
    """One heartbeat's pace, at the coordinator's time of reading it."""

    at: float
    steps: int
    step_s: float
    wait_s: float
    measured: bool


@dataclass(frozen=True, slots=True)
class NodePace:
    """A node's pace over the window: its slowest rank's busy seconds per step, and what it was judged against."""

    node: str
    workers: tuple[str, ...]
    ranks: tuple[int, ...]
    busy_s: float
    step_s: float
    steps: int
    median_s: float = 0.0
    """The other nodes' median busy seconds per step."""

    @property
    def ratio(self) -> float:
        return self.busy_s / self.median_s if self.median_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class StragglerState:
    """What the rule carries from one turn to the next."""

    generation: int = -1
    history: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    """Active worker -> its pace samples of this generation, the newest last, pruned to the window (+ one older)."""
    named_at: Mapping[str, float] = field(default_factory=dict)
    """Node -> when it was last named (once per window)."""
    paced_at: float = -math.inf
    """When the last ``pace`` event was written (once per window)."""
    judged_at: float = -math.inf
    """When the rule last ran over the history (at most once per sampling gap: nothing newer to judge between)."""
    last_eviction: float = -math.inf
    evicted: frozenset[str] = frozenset()
    said: frozenset[str] = frozenset()
    """Lines said once per generation (unmeasured collectives, a slow majority)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    state: StragglerState
    actions: tuple[Action, ...] = ()
    evict: Mapping[str, str] = field(default_factory=dict)
    """Worker -> why, for the failed-node path (``decide.py``): every worker of an evicted node. The why starts
    with "straggler" (the ledger's recovery cause)."""


def observe(state: StragglerState, beats: Mapping[str, Mapping[str, Any]], a: Assignment, now: float,
            window_s: float) -> StragglerState:
    """The turn's heartbeats added to the history (a new generation starts it afresh). A worker's sample is taken
    at most every ``window_s / SAMPLES_PER_WINDOW`` seconds, and only when its pace moved: the history holds a few
    dozen samples per worker whatever the heartbeat rate, and a turn touches only the workers sampled in it."""
    if a.generation != state.generation:
        state = dataclasses.replace(state, generation=a.generation, history={}, named_at={}, said=frozenset())
    gap = window_s / SAMPLES_PER_WINDOW
    history = dict(state.history)
    for wid in a.ranks:
        pace = (beats.get(wid) or {}).get("pace")
        if not (isinstance(pace, (list, tuple)) and len(pace) == 4):
            continue
        old = history.get(wid, ())
        if old and (now - old[-1].at < gap or (old[-1].steps == int(pace[0])
                                               and old[-1].measured == bool(pace[3]))):
            continue
        new = (*old, Sample(now, int(pace[0]), float(pace[1]), float(pace[2]), bool(pace[3])))
        # keep the newest sample at or before the window's start (the baseline) and everything after it
        start = now - window_s
        base = max((i for i, x in enumerate(new) if x.at <= start), default=0)
        history[wid] = new[base:]
    return dataclasses.replace(state, history=history)


def window_pace(samples: Sequence[Sample], start: float, end: float,
                min_steps: int) -> tuple[float, float, int] | None:
    """(busy seconds per step, wall seconds per step, steps) between the newest samples at or before ``start`` and
    ``end``, or None: the history does not reach back to ``start`` yet, or holds fewer than ``min_steps`` steps
    in between."""
    at = operator.attrgetter("at")
    i, j = bisect.bisect_right(samples, start, key=at), bisect.bisect_right(samples, end, key=at)
    if i == 0 or j == 0:
        return None
    b, n = samples[i - 1], samples[j - 1]
    steps = n.steps - b.steps
    if steps < min_steps:
        return None
    wall = n.step_s - b.step_s
    busy = max(0.0, wall - (n.wait_s - b.wait_s))
    return busy / steps, wall / steps, steps


def _median_without(ordered: Sequence[float], i: int) -> float:
    """The median of ``ordered`` (sorted) less its element ``i``, in O(1)."""
    n = len(ordered) - 1

    def at(k: int) -> float:   # the k-th element of the list without position i
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def node_paces(state: StragglerState, a: Assignment, start: float, end: float,
               min_steps: int) -> list[NodePace] | None:
    """Every active node's pace between ``start`` and ``end``, each judged against the median of the others; None
    when not every rank can be judged there. O(ranks x log samples + nodes x log nodes): a coordinator turn of a
    16,384-rank job stays in milliseconds."""
    per_node: dict[str, list[tuple[str, int, tuple[float, float, int]]]] = {}
    history = state.history
    for wid, rank in a.ranks.items():
        p = window_pace(history.get(wid, ()), start, end, min_steps)
        if p is None:
            return None
        per_node.setdefault(a.nodes[wid], []).append((wid, rank, p))
    rows = []
    for node, ranks in per_node.items():
        ranks.sort(key=lambda r: r[1])
        slowest = max(ranks, key=lambda r: r[2][0])
        rows.append((node, tuple(r[0] for r in ranks), tuple(r[1] for r in ranks), slowest[2]))
    if len(rows) < 2:
        return [NodePace(node, w, r, p[0], p[1], p[2]) for node, w, r, p in rows]
    order = sorted(range(len(rows)), key=lambda k: rows[k][3][0])
    ordered = [rows[k][3][0] for k in order]
    position = {k: pos for pos, k in enumerate(order)}
    return [NodePace(node, w, r, p[0], p[1], p[2], median_s=_median_without(ordered, position[k]))
            for k, (node, w, r, p) in enumerate(rows)]


def slow_nodes(state: StragglerState, a: Assignment, now: float, s: StragglerSettings) -> list[NodePace] | None:
    """The nodes at least ``factor`` times the others' median over the whole window *and* over each of its
    :data:`SLICES` parts (a node that stays slow, not one burst that outweighs the rest of the window), the
    slowest first, with the whole window's figures; None when not every rank can be judged yet."""
    whole = node_paces(state, a, now - s.window_s, now, s.min_steps)
    if not whole or len(whole) < 2:
        return None
    named = {p.node for p in whole if p.ratio >= s.factor}
    for i in range(SLICES):
        part = node_paces(state, a, now - s.window_s * (SLICES - i) / SLICES, now - s.window_s * (SLICES - i - 1)
                          / SLICES, max(1, s.min_steps // SLICES))
        named &= {p.node for p in part or () if p.ratio >= s.factor}
    return sorted((p for p in whole if p.node in named), key=lambda p: -p.ratio)


PACE_SLOWEST = 3
"""Nodes a ``pace`` event lists by name (the slowest): its size does not grow with the job."""


def pace_event(paces: Sequence[NodePace], generation: int, window_s: float, now: float) -> Event:
    """The job's pace over the last window, once per window (the timeline; the metrics' ``deadpool_step_seconds``
    and ``deadpool_busy_seconds``): the median step, the median and largest busy time per step, and the slowest
    nodes with their ratio to the others' median."""
    busy = sorted(p.busy_s for p in paces)
    slowest = sorted(paces, key=lambda p: -p.busy_s)[:PACE_SLOWEST]
    return Event({"event": "pace", "generation": generation, "window_s": window_s, "nodes": len(paces),
                  "step_s": round(statistics.median(p.step_s for p in paces), 6),
                  "busy_median_s": round(statistics.median(busy), 6), "busy_max_s": round(busy[-1], 6),
                  "slowest": [{"node": p.node, "busy_s": round(p.busy_s, 6),
                               "ratio": round(p.ratio, 3) if math.isfinite(p.ratio) else None} for p in slowest],
                  "time": now})


def judge(state: StragglerState, beats: Mapping[str, Mapping[str, Any]], a: Assignment, spares_left: Sequence[str],
          now: float, s: StragglerSettings) -> Verdict:
    """One turn of the rule (the module's docstring): the next state, the lines and events, and the workers to
    evict."""
    if s.action == "off":
        return Verdict(state)
    state = observe(state, beats, a, now, s.window_s)
    actions: list[Action] = []
    unmeasured = sorted(w for w, h in state.history.items() if h and h[-1].steps >= s.min_steps and not h[-1].measured)
    if unmeasured:
        if "unmeasured" not in state.said:
            state = dataclasses.replace(state, said=state.said | {"unmeasured"})
            actions.append(Log(logging.INFO, (
                f"stragglers: not judged in generation {a.generation}: {', '.join(unmeasured[:4])} time no "
                "collective (no swappable gloo group: hot_swap.in_place off, or NCCL's waits, which are the "
                "device's), so a slow rank cannot be told from the ranks waiting for it")))
        return Verdict(state, tuple(actions))
    if now - state.judged_at < s.window_s / SAMPLES_PER_WINDOW:
        return Verdict(state, tuple(actions))
    state = dataclasses.replace(state, judged_at=now)
    if now - state.paced_at >= s.window_s:
        whole = node_paces(state, a, now - s.window_s, now, s.min_steps)
        if whole and len(whole) >= 2:
            state = dataclasses.replace(state, paced_at=now)
            actions.append(pace_event(whole, a.generation, s.window_s, now))
    named = slow_nodes(state, a, now, s)
    if not named:
        return Verdict(state, tuple(actions))
    nodes = len(set(a.nodes.values()))
    if 2 * len(named) >= nodes and nodes > 2:
        if "majority" not in state.said:
            state = dataclasses.replace(state, said=state.said | {"majority"})
            actions.append(Log(logging.WARNING, (
                f"stragglers: {len(named)} of {nodes} nodes are {s.factor:g}x slower than the others' median "
                f"({', '.join(p.node for p in named)}): the job itself is slow, no one is named")))
        return Verdict(state, tuple(actions))
    p = named[0]
    if now - state.named_at.get(p.node, -math.inf) < s.window_s:
        return Verdict(state, tuple(actions))
    lost = min(s.window_s, p.steps * max(0.0, p.busy_s - p.median_s))
    what = (f"node {p.node} (rank{'s' if len(p.ranks) > 1 else ''} {', '.join(map(str, p.ranks))}) is a straggler: "
            f"{p.busy_s:.3f} s of work per step outside collectives over the last {s.window_s:g} s ({p.steps} "
            f"steps), {p.ratio:.1f}x the other nodes' median {p.median_s:.3f} s (factor {s.factor:g}); the job "
            f"waited {lost:.1f} s for it")
    evict: dict[str, str] = {}
    if s.action != "swap":
        decision = "named"
        why = f"action report ({s.source}): named only"
    elif not spares_left:
        decision = "kept"
        why = "not evicted: no spare left"
    elif now - state.last_eviction < s.window_s:
        decision = "kept"
        why = (f"not evicted: at most one eviction per window, the last {now - state.last_eviction:.1f} s ago "
               f"(window {s.window_s:g} s)")
    else:
        decision = "evicted"
        why = f"evicted into a spare (action swap, {s.source}; spares left: {', '.join(spares_left)})"
        evict = {w: f"straggler: {p.busy_s:.3f} s per step outside collectives, {p.ratio:.1f}x the other nodes' "
                    f"median over {s.window_s:g} s (--straggler-action swap)" for w in p.workers}
        state = dataclasses.replace(state, last_eviction=now, evicted=state.evicted | {p.node})
    state = dataclasses.replace(state, named_at={**state.named_at, p.node: now})
    actions += [Event({"event": "straggler", "generation": a.generation, "node": p.node, "workers": list(p.workers),
                       "ranks": list(p.ranks), "busy_s": round(p.busy_s, 6), "median_s": round(p.median_s, 6),
                       "ratio": round(p.ratio, 3) if math.isfinite(p.ratio) else None, "factor": s.factor,
                       "window_s": s.window_s, "steps": p.steps, "step_s": round(p.step_s, 6),
                       "lost_s": round(lost, 6), "action": s.action, "decision": decision, "why": why,
                       "time": now}),
                Log(logging.WARNING, f"{what}; {why}")]
    return Verdict(state, tuple(actions), evict)


__all__ = ["ACTIONS", "NodePace", "Sample", "StragglerSettings", "StragglerState", "Verdict", "judge", "pace_event",
           "resolve", "setting_error", "slow_nodes", "window_pace"]
