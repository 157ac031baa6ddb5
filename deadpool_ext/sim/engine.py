"""Discrete-event engine: one trial of one policy against one failure trace.

Events are failures (from the trace), the end of a recovery, a repaired node returning to the spare pool, and
the end of the horizon, popped in (time, priority, insertion) order so equal times resolve deterministically:
a node returns and a recovery completes before a failure at the same instant is applied, and the horizon
ends last.

Training between events is not simulated iteration by iteration (a 30-day run has ~400k iterations per
trial): a running *segment* maps wall time to completed iterations in closed form from the policy's tracks,
and the newest committed version of each track at a failure time is computed from the same map.

Job states: RUNNING -> (failure) -> RECOVERING (detect, restart or rebuild, load, replay) -> RUNNING. When the
policy needs a node and the pool is empty, ``cluster.no_spare_policy`` decides: ``wait``: WAITING for the next
repaired node, then RECOVERING; ``fail``: STOPPED for the rest of the horizon, back at the newest persistent
version (the launcher stops the job and drops its memory; a resubmission would load from storage); ``shrink``:
the failed node's data-parallel replica leaves the job (its healthy nodes join the pool), the recovery is priced
by :func:`~deadpool_ext.sim.elastic.shrink`, and iterations take ``replicas / live`` times as long until a
repaired node lets the job grow back (:func:`~deadpool_ext.sim.elastic.grow`, a planned recovery at once;
failures of the slots that are out of the job do not touch it). A failure during WAITING or
RECOVERING starts the recovery over, escalated to the worst failure seen (memory lost > node lost >
transient). Memory of a lost node exists only as its peer's replica until the recovery has re-replicated it;
losing that peer in the window loses the node's in-memory state (fallback to storage).

Time is accounted into categories that sum to the horizon (checked by the tests): useful, overhead (step time
added by checkpoints), rework (iterations computed and then rolled back, plus the partial iteration a failure
or a grow interrupts), the recovery phases, wait, shrunk (the step time added by running on fewer replicas:
useful counts each iteration at its full-size time), stopped (after ``fail``) and unfinished (the partial
iteration at the horizon).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from . import elastic
from .costs import Derived
from .failures import Failure, FailureKind
from .policies import PHASES, Policy, Track

# Event kinds and their priority at equal times (lower first).
REPAIR, RECOVERY_DONE, FAILURE, END = "repair", "recovery_done", "failure", "end"
PRIORITY = {REPAIR: 0, RECOVERY_DONE: 1, FAILURE: 2, END: 3}
CATEGORIES = ("useful", "overhead", "rework", *PHASES, "shrunk", "stopped", "unfinished")


@dataclass(order=True, frozen=True, slots=True)
class Event:
    time_s: float
    priority: int
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    """A min-heap of events ordered by (time, priority of the kind, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = 0

    def push(self, time_s: float, kind: str, payload: Any = None) -> Event:
        if kind not in PRIORITY:
            raise ValueError(f"unknown event kind {kind!r}")
        if not math.isfinite(time_s) or time_s < 0:
            raise ValueError(f"event time must be finite and >= 0, got {time_s!r}")
        ev = Event(time_s, PRIORITY[kind], self._seq, kind, payload)
        self._seq += 1
        heapq.heappush(self._heap, ev)
        return ev

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class Segment:
    """Failure-free training from wall time ``start`` and absolute iteration ``n0`` under the given tracks."""

    def __init__(self, start: float, n0: int, tracks: list[Track], iteration_s: float) -> None:
        self.start, self.n0, self.tracks, self.it = start, n0, tracks, iteration_s

    def overhead(self, n: int) -> float:
        """Checkpoint time added to the first ``n`` iterations of the segment."""
        a, b = self.n0, self.n0 + n
        return sum(t.blocking_s * (b // t.interval - a // t.interval) for t in self.tracks)

    def wall(self, n: int) -> float:
        """Wall time from the segment start to the end of iteration n0 + n, checkpoint blocking included."""
        return n * self.it + self.overhead(n)

    def done(self, dt: float) -> int:
        """Iterations completed ``dt`` seconds into the segment."""
        lo, hi = 0, int(dt / self.it) + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.wall(mid) <= dt:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def latest(self, track: Track, n: int, dt: float) -> int | None:
        """Newest version of ``track`` taken in this segment and committed by ``dt`` (None: none yet)."""
        v = (self.n0 + n) // track.interval * track.interval
        while v > self.n0:
            if self.wall(v - self.n0) + track.latency_s <= dt:
                return v
            v -= track.interval
        return None


@dataclass(slots=True)
class TrialResult:
    goodput: float
    breakdown: dict[str, float]
    """Seconds per category of :data:`CATEGORIES`; they sum to the horizon."""
    failures: int
    restores: dict[str, int]
    """Completed recoveries by source: local, peer, storage."""
    waits: int
    """Recoveries that had to wait for a node because the spare pool was empty."""
    iterations: int
    shrinks: int = 0
    """Replicas that left the job for want of a spare (``shrink``)."""
    grows: int = 0
    """Replicas that came back (``shrink``)."""
    capacity: float = 1.0
    """Time-average fraction of the replicas in the job; goodput cannot exceed it."""
    stopped_s: float | None = None
    """When the job stopped for want of a spare (``fail``); None: it did not."""


_SEVERITY = {FailureKind.TRANSIENT: 0, FailureKind.NODE_LOST: 1, FailureKind.CLUSTER: 2}


class _Trial:
    """Mutable state of one trial; :func:`run_trial` is the public entry."""

    def __init__(self, policy: Policy, d: Derived, horizon_s: float) -> None:
        self.policy, self.d, self.horizon = policy, d, horizon_s
        self.tracks = policy.tracks(d)
        self.memory_names = [t.name for t in self.tracks if not t.durable]
        self.versions = {t.name: 0 for t in self.tracks}
        self.q = EventQueue()
        self.acc = dict.fromkeys(CATEGORIES, 0.0)
        self.restores = {"local": 0, "peer": 0, "storage": 0}
        self.waits = self.failures = 0
        self.pool = d.spares
        self.progress = 0
        self.mode = "running"
        self.seg = Segment(0.0, 0, self.tracks, d.iteration_s)
        self.unit, self.replicas = d.shrink_unit_nodes, elastic.replicas(d)
        self.out: list[int] = []             # replicas out of the job (shrink), oldest first
        self.resized = False                 # the current recovery changes the world size
        self.shrinks = self.grows = 0
        self.stopped_at: float | None = None
        self.cap_s = self.cap_t = 0.0        # integral of the live fraction up to cap_t
        self.mark = 0.0                      # when the current WAITING / RECOVERING / STOPPED state began
        self.token = 0                       # identifies the live RECOVERY_DONE event
        self.needed = 0                      # nodes the job still waits for
        self.kind: FailureKind | None = None  # worst failure of the current recovery
        self.memory_ok = True
        self.restore_plan: Any = None       # the current recovery's Restore (set by on_failure before use)
        self.exposed: dict[int, float] = {}  # lost node -> until when its state lives only on its peer

    # -- accounting --------------------------------------------------------------------------------------
    def _close_segment(self, t: float) -> None:
        dt = t - self.seg.start
        n = self.seg.done(dt)
        for tr in self.tracks:
            v = self.seg.latest(tr, n, dt)
            if v is not None:
                self.versions[tr.name] = v
        self.acc["useful"] += n * self.d.iteration_s  # provisional: rolled-back iterations move to rework
        self.acc["shrunk"] += n * (self.seg.it - self.d.iteration_s)
        self.acc["overhead"] += self.seg.overhead(n)
        self.acc["rework" if t < self.horizon else "unfinished"] += dt - self.seg.wall(n)
        self.progress = self.seg.n0 + n

    def _close_recovery(self, t: float) -> None:
        """Attribute the time since the recovery began to its phases, in order (an interrupted recovery has
        spent its time on the first phases)."""
        left = t - self.mark
        for name in PHASES:
            if name == "wait":
                continue
            spent = min(left, self.restore_plan.phases.get(name, 0.0))
            self.acc[name] += spent
            left -= spent
        self.acc["load"] += max(0.0, left)  # float rounding only

    @property
    def live(self) -> int:
        return self.replicas - len(self.out)

    def _capacity(self, t: float) -> None:
        """Integrate the live fraction up to ``t``; call before the number of live replicas changes."""
        self.cap_s += (t - self.cap_t) * self.live / self.replicas
        self.cap_t = t

    def _rollback(self, version: int) -> None:
        if version < self.progress:
            lost = (self.progress - version) * self.d.iteration_s
            self.acc["useful"] -= lost
            self.acc["rework"] += lost
            self.progress = version

    # -- events ------------------------------------------------------------------------------------------
    def on_failure(self, t: float, f: Failure) -> None:
        if self.mode == "stopped" or (f.node >= 0 and f.node // self.unit in self.out):
            return  # no job left, or a slot that is out of the job (its healthy nodes idle as spares)
        self.failures += 1
        if self.mode == "running":
            self._close_segment(t)
        elif self.mode == "recovering":
            self._close_recovery(t)
        else:
            self.acc["wait"] += t - self.mark
        if f.kind is FailureKind.CLUSTER:
            self.memory_ok = False
        elif f.kind is FailureKind.NODE_LOST:
            # The state of a node lost earlier lives only on its ring successor until re-replicated.
            if any((lost + 1) % self.d.nodes == f.node and until > t for lost, until in self.exposed.items()):
                self.memory_ok = False
            self.exposed[f.node] = math.inf
        if self.kind is None or _SEVERITY[f.kind] > _SEVERITY[self.kind]:
            self.kind = f.kind
        if self.policy.needs_node(f.kind):
            back = self.d.node_repair_s if f.kind is FailureKind.NODE_LOST else self.d.node_reboot_s
            self.q.push(t + back, REPAIR)
            self.needed += 1
        self._take_nodes()
        if self.needed and self.d.no_spare_policy == "fail":
            self._stop(t)
            return
        if self.needed and self.d.no_spare_policy == "shrink" and self.live > 1:
            self._shrink(t, f.node // self.unit)
        kind = FailureKind.CLUSTER if not self.memory_ok else self.kind
        plan = self.policy.restore(self.d, kind, self.versions, self.memory_ok)
        self.restore_plan = elastic.shrink(plan, self.d, self.live) if self.resized else plan
        self._rollback(self.restore_plan.version)
        self.mark = t
        if self.needed:
            if self.mode != "waiting":
                self.waits += 1
            self.mode = "waiting"
        else:
            self._start_recovery(t)

    def _take_nodes(self) -> None:
        take = min(self.pool, self.needed)
        self.pool -= take
        self.needed -= take

    def _shrink(self, t: float, replica: int) -> None:
        """The failed node's replica leaves the job; its other nodes are healthy and become spares."""
        self._capacity(t)
        self.out.append(replica)
        self.needed -= 1
        self.pool += self.unit - 1
        self.shrinks += 1
        self.resized = True
        self._take_nodes()

    def _maybe_grow(self, t: float) -> None:
        """A running, shrunk job grows back, by every replica the pool can fill, as soon as it can fill one (a
        recovery in progress finishes first)."""
        back = min(len(self.out), self.pool // self.unit)
        if self.mode != "running" or not back:
            return
        self._close_segment(t)  # the iteration in flight is redone
        self._capacity(t)
        self.pool -= back * self.unit
        del self.out[:back]
        self.grows += back
        self.resized = True
        self.restore_plan = elastic.grow(self.d, self.progress, self.live)
        self._start_recovery(t)

    def _stop(self, t: float) -> None:
        """``fail``: the job ends here; what counts is what the persistent tier holds."""
        self._rollback(max((self.versions[tr.name] for tr in self.tracks if tr.durable), default=0))
        self._capacity(t)  # no replica is in the job from here on
        self.mode, self.mark, self.stopped_at = "stopped", t, t

    def _start_recovery(self, t: float) -> None:
        self.mode, self.mark = "recovering", t
        self.token += 1
        self.q.push(t + sum(self.restore_plan.phases.values()), RECOVERY_DONE, self.token)

    def on_repair(self, t: float) -> None:
        self.pool += 1
        if self.mode == "waiting":
            self._take_nodes()
            if not self.needed:
                self.acc["wait"] += t - self.mark
                self._start_recovery(t)
        self._maybe_grow(t)

    def on_recovery_done(self, t: float, token: int) -> None:
        if self.mode != "recovering" or token != self.token:
            return  # superseded by a failure during the recovery
        self._close_recovery(t)
        plan = self.restore_plan
        if plan.source in self.restores:
            self.restores[plan.source] += 1
        if plan.source == "storage":
            # Memory tiers start again from the reloaded state.
            for name in self.memory_names:
                self.versions[name] = plan.version
        # Lost nodes' state is on two nodes again once the first snapshot after the restore is replicated.
        memory = [tr for tr in self.tracks if not tr.durable]
        window = max((tr.interval * self.d.iteration_s + tr.latency_s for tr in memory), default=0.0)
        self.exposed = {n: t + window for n, u in self.exposed.items() if u > t}
        self.mode, self.kind, self.memory_ok, self.restore_plan = "running", None, True, None
        self.resized = False
        self.seg = Segment(t, self.progress, self.tracks, elastic.iteration_s(self.d, self.live))
        self._maybe_grow(t)

    def on_end(self, t: float) -> None:
        if self.mode == "running":
            self._close_segment(t)
        elif self.mode == "recovering":
            self._close_recovery(t)
        else:
            self.acc["stopped" if self.mode == "stopped" else "wait"] += t - self.mark
        if self.mode != "stopped":
            self._capacity(t)


def run_trial(policy: Policy, d: Derived, trace: list[Failure], horizon_s: float) -> TrialResult:
    """Simulate ``horizon_s`` seconds of wall time of one job under ``policy`` and the given failures."""
    s = _Trial(policy, d, horizon_s)
    for f in trace:
        if f.time_s < horizon_s:
            s.q.push(f.time_s, FAILURE, f)
    s.q.push(horizon_s, END)
    while s.q:
        ev = s.q.pop()
        if ev.kind == END:
            s.on_end(ev.time_s)
            break
        if ev.kind == FAILURE:
            s.on_failure(ev.time_s, ev.payload)
        elif ev.kind == REPAIR:
            s.on_repair(ev.time_s)
        else:
            s.on_recovery_done(ev.time_s, ev.payload)
    return TrialResult(goodput=s.acc["useful"] / horizon_s, breakdown=dict(s.acc), failures=s.failures,
                       restores=dict(s.restores), waits=s.waits, iterations=s.progress, shrinks=s.shrinks,
                       grows=s.grows, capacity=s.cap_s / horizon_s, stopped_s=s.stopped_at)
