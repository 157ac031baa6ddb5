"""Fault-tolerance policies the simulator compares. A policy says two things, both pure:

1. what failure-free training pays: a list of :class:`Track` (a kind of checkpoint version taken every
   ``interval`` iterations, the step time each version adds, and how long after that it is committed);
2. what a failure costs: :meth:`Policy.restore` picks the version to resume from among what survived and
   prices the recovery phases (detect, restart or rebuild, load, replay) with the times of
   :class:`~deadpool_ext.sim.costs.Derived`.

The event engine (:mod:`deadpool_ext.sim.engine`) owns time, spares, rework and waiting; policies own only
these two answers, so a new policy is a small dataclass here.

Policies: ``ckpt_sync`` (periodic persistent checkpoints, the step waits for the write; DeepSpeed's default
engine), ``ckpt_async`` (staged to host memory, written in the background; DCP ``async_save``, CheckFreq),
``gemini`` (in-memory checkpoints replicated to a peer, whole-job restart; Gemini, SOSP'23), ``deadpool``
(in-memory snapshots + hot-swap with spares; DeadPool), ``tiercheck`` (differentials every iteration in
memory, bases every K iterations to memory and asynchronously to storage; TierCheck).
"""
from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass

from .costs import Derived
from .failures import FailureKind
from .params import SimParamError

PHASES = ("detect", "wait", "restart", "load", "replay")
"""Recovery phases in the order they happen (``wait``: for a node from the spare pool, added by the engine)."""


@dataclass(frozen=True, slots=True)
class Track:
    """One kind of checkpoint version."""

    name: str
    interval: int
    """Iterations between versions; a version is taken after every iteration whose number is a multiple."""
    blocking_s: float
    """Step time added by each version (blocking part plus interference; includes waiting for the previous
    version when the background work does not fit in the interval)."""
    latency_s: float
    """From the end of that step to the version being committed (usable for a restore)."""
    durable: bool
    """True for persistent storage: survives the loss of every node's memory."""


@dataclass(frozen=True, slots=True)
class Restore:
    """What a recovery resumes from and what it costs, phase by phase (``wait`` excluded)."""

    version: int
    source: str
    """``storage``, ``local`` (the node's own memory survived) or ``peer`` (a replica on another node)."""
    phases: dict[str, float]


def _check_interval(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SimParamError(f"policy interval {name}: must be an integer >= 1, got {value!r}")


def _memory_track(d: Derived, interval: int, name: str = "memory", fraction: float = 1.0) -> Track:
    """An in-memory snapshot of ``fraction`` of the state every ``interval`` iterations, copied off the critical
    path (DeadPool's ping-pong buffers): the step pays the measured interference, and waits only when the copy
    and replica take longer than the interval."""
    background = fraction * d.snapshot_background_s
    waited = max(0.0, background - interval * d.iteration_s)
    return Track(name, interval, fraction * d.interference_s + waited, background, durable=False)


def _background_storage_track(d: Derived, interval: int, staging_s: float = 0.0) -> Track:
    """A persistent version written in the background; the step pays the measured interference of a background
    write, and the next version waits for the previous write (as DCP's ``async_save`` users and DeepSpeed's
    decoupled engine do)."""
    waited = max(0.0, d.storage_write_s - interval * d.iteration_s)
    return Track("storage", interval, staging_s + d.persist_interference_s + waited, d.storage_write_s,
                 durable=True)


class Policy(abc.ABC):
    """Call order (engine, per trial): :meth:`tracks` once; per failure :meth:`needs_node`, then
    :meth:`restore` with the newest committed version of every track that survived."""

    name: str = ""
    hot_spares: bool = False
    """True: a failed node is fenced and a spare takes its place, even for a transient fault."""

    @abc.abstractmethod
    def tracks(self, d: Derived) -> list[Track]: ...

    @abc.abstractmethod
    def restore(self, d: Derived, kind: FailureKind, versions: dict[str, int], memory_ok: bool) -> Restore: ...

    @abc.abstractmethod
    def intervals(self) -> dict[str, int]: ...

    def needs_node(self, kind: FailureKind) -> bool:
        """Whether the job needs a node from the pool to go on after this failure."""
        if kind is FailureKind.CLUSTER:
            return False
        return kind is FailureKind.NODE_LOST or self.hot_spares

    def memory_bytes_per_node(self, d: Derived) -> float:
        """Host memory the policy keeps per node (checked against the node's memory in reports)."""
        return 0.0

    def label(self) -> str:
        return self.name + " " + " ".join(f"{k}={v}" for k, v in self.intervals().items())

    def _from_storage(self, d: Derived, versions: dict[str, int]) -> Restore:
        return Restore(versions["storage"], "storage",
                       {"detect": d.detect_s, "restart": d.restart_s, "load": d.storage_read_s})


@dataclass(frozen=True, slots=True)
class CheckpointRestart(Policy):
    """Persistent checkpoints every ``persist_interval`` iterations; any failure restarts the whole job from
    the newest complete one."""

    persist_interval: int
    asynchronous: bool = False

    def __post_init__(self) -> None:
        _check_interval("persist_interval", self.persist_interval)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "ckpt_async" if self.asynchronous else "ckpt_sync"

    def tracks(self, d: Derived) -> list[Track]:
        if self.asynchronous:
            return [_background_storage_track(d, self.persist_interval, staging_s=d.d2h_s)]
        # Synchronous: the step copies to host and writes before training continues (DeepSpeed's default).
        return [Track("storage", self.persist_interval, d.d2h_s + d.storage_write_s, 0.0, durable=True)]

    def restore(self, d: Derived, kind: FailureKind, versions: dict[str, int], memory_ok: bool) -> Restore:
        return self._from_storage(d, versions)

    def intervals(self) -> dict[str, int]:
        return {"persist_interval": self.persist_interval}

    def memory_bytes_per_node(self, d: Derived) -> float:
        return d.node_bytes if self.asynchronous else 0.0


@dataclass(frozen=True, slots=True)
class MemoryRestart(Policy):
    """Gemini-style: in-memory checkpoints every ``memory_interval`` iterations in the node's host memory and a
    peer's; a failure restarts the whole job, which loads from memory (the replacement node from the peer),
    or from storage (written every ``persist_interval``) when memory is lost."""

    memory_interval: int
    persist_interval: int
    name = "gemini"

    def __post_init__(self) -> None:
        _check_interval("memory_interval", self.memory_interval)
        _check_interval("persist_interval", self.persist_interval)

    def tracks(self, d: Derived) -> list[Track]:
        return [_memory_track(d, self.memory_interval), _background_storage_track(d, self.persist_interval)]

    def restore(self, d: Derived, kind: FailureKind, versions: dict[str, int], memory_ok: bool) -> Restore:
        if not memory_ok:
            return self._from_storage(d, versions)
        load = d.restore_fixed_s + (d.peer_fetch_s if kind is FailureKind.NODE_LOST else 0.0)
        return Restore(versions["memory"], "peer" if kind is FailureKind.NODE_LOST else "local",
                       {"detect": d.detect_s, "restart": d.restart_s, "load": load})

    def intervals(self) -> dict[str, int]:
        return {"memory_interval": self.memory_interval, "persist_interval": self.persist_interval}

    def memory_bytes_per_node(self, d: Derived) -> float:
        return 2.0 * d.node_bytes  # own copy + the peer's replica


@dataclass(frozen=True, slots=True)
class HotSwap(Policy):
    """DeadPool: snapshots every ``memory_interval`` iterations (ping-pong slots + a peer replica); a failed
    node is replaced by a spare while the survivors keep their processes (communicator rebuild), the spare
    fetches the lost state from the peer. No spare: the engine waits, stops or shrinks (``cluster.no_spare_policy``).
    Memory lost: whole-job restart from storage (written in the background every ``persist_interval``)."""

    memory_interval: int
    persist_interval: int
    name = "deadpool"
    hot_spares = True

    def __post_init__(self) -> None:
        _check_interval("memory_interval", self.memory_interval)
        _check_interval("persist_interval", self.persist_interval)

    def tracks(self, d: Derived) -> list[Track]:
        return [_memory_track(d, self.memory_interval), _background_storage_track(d, self.persist_interval)]

    def restore(self, d: Derived, kind: FailureKind, versions: dict[str, int], memory_ok: bool) -> Restore:
        if not memory_ok:
            return self._from_storage(d, versions)
        return Restore(versions["memory"], "peer", {"detect": d.detect_s, "restart": d.hotswap_s,
                                                    "load": d.restore_fixed_s + d.peer_fetch_s})

    def intervals(self) -> dict[str, int]:
        return {"memory_interval": self.memory_interval, "persist_interval": self.persist_interval}

    def memory_bytes_per_node(self, d: Derived) -> float:
        return 4.0 * d.node_bytes  # two ping-pong slots + a double-buffered replica (docs/architecture.md)


@dataclass(frozen=True, slots=True)
class Tiered(Policy):
    """TierCheck: a differential every iteration in local and peer memory; a base every ``base_interval``
    iterations in memory, migrated asynchronously (never stalling training) to storage. Recovery anchors on
    what survives: local base (transient), peer base (node lost), remote base (memory lost; differentials are
    gone with the memory). Restoring from memory replays the differentials since the base."""

    base_interval: int
    name = "tiercheck"

    def __post_init__(self) -> None:
        _check_interval("base_interval", self.base_interval)

    def tracks(self, d: Derived) -> list[Track]:
        diff = _memory_track(d, 1, name="diff", fraction=d.diff_fraction)
        base = _memory_track(d, self.base_interval, name="base")
        # Migration is throttled rather than stalling training: when one base takes longer to write than the
        # interval, only every m-th base reaches storage.
        every = max(1, math.ceil(d.storage_write_s / (self.base_interval * d.iteration_s)))
        storage = Track("storage", self.base_interval * every, d.persist_interference_s, d.storage_write_s,
                        durable=True)
        return [diff, base, storage]

    def restore(self, d: Derived, kind: FailureKind, versions: dict[str, int], memory_ok: bool) -> Restore:
        if not memory_ok:
            return self._from_storage(d, versions)
        version = versions["diff"]
        replay = max(0, version - versions["base"]) * d.replay_s_per_diff
        load = d.restore_fixed_s + (d.peer_fetch_s if kind is FailureKind.NODE_LOST else 0.0)
        return Restore(version, "peer" if kind is FailureKind.NODE_LOST else "local",
                       {"detect": d.detect_s, "restart": d.restart_s, "load": load, "replay": replay})

    def intervals(self) -> dict[str, int]:
        return {"base_interval": self.base_interval}

    def memory_bytes_per_node(self, d: Derived) -> float:
        return 2.0 * d.node_bytes * (1.0 + self.base_interval * d.diff_fraction)


POLICY_NAMES = ("ckpt_sync", "ckpt_async", "gemini", "deadpool", "tiercheck")


def make_policy(name: str, **intervals: int) -> Policy:
    """Build a policy by name with its intervals (``make_policy("deadpool", memory_interval=1,
    persist_interval=500)``); unknown names or keys are clear errors."""
    builders: dict[str, Callable[..., Policy]] = {
        "ckpt_sync": lambda **kw: CheckpointRestart(asynchronous=False, **kw),
        "ckpt_async": lambda **kw: CheckpointRestart(asynchronous=True, **kw),
        "gemini": MemoryRestart, "deadpool": HotSwap, "tiercheck": Tiered,
    }
    if name not in builders:
        raise SimParamError(f"unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    try:
        return builders[name](**intervals)
    except TypeError as exc:
        raise SimParamError(f"policy {name}: bad intervals {intervals}: {exc}") from None
