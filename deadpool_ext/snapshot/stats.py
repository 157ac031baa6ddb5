"""What the memory tiers did, typed: per-snapshot timings, sizes, and the last restore.

One object per :class:`~deadpool_ext.snapshot.manager.SnapshotManager`, written by the hot path, the writer thread
(:mod:`.writer`) and the restore executor (:mod:`.restore`); read as fields. :meth:`SnapshotStats.as_dict` is the
summary a runtime's ``stats()`` returns (JSON; benchmarks and the tests' job summaries read its keys).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIMING_WINDOW = 50_000
"""Per-snapshot timings kept (medians, maxima): the newest 50,000-100,000 of each kind, so a job of millions of
steps does not grow a list per step (about 4 MB per kind at most)."""

TIMINGS = ("blocking_s", "copy_s", "seal_s", "replicate_s", "commit_s", "copy_cpu_s", "seal_cpu_s",
           "replicate_cpu_s", "commit_cpu_s")
"""The per-snapshot timing series, in the order the summary lists them."""


def trim_window(values: list[float], window: int = TIMING_WINDOW) -> None:
    """Drop the oldest entries of ``values`` once it holds more than twice ``window`` (amortised O(1) per append;
    positions move only past that length, so a benchmark slicing a shorter run is unaffected)."""
    if len(values) > 2 * window:
        del values[:len(values) - window]


@dataclass(kw_only=True, slots=True)
class SnapshotStats:
    snapshots: int = 0
    """Bases committed by this rank's writer."""
    diffs: int = 0
    """Differentials committed by this rank's writer."""
    base_nbytes: int | None = None
    """Blob size of the newest base."""
    diff_nbytes: int | None = None
    """Blob size of the newest differential."""
    checksum_fused: bool | None = None
    """Whether the newest copy hashed in its own pass (CPU path); None before the first snapshot."""
    worker_priority: str | None = None
    """The writer thread's CPU priority as obtained (snapshot/priority.py); None before it started."""
    blocking_s: list[float] = field(default_factory=list)
    """Per snapshot: what the training thread waited (its share of ``after_step`` plus the next step's wait for
    the copy). The newest entry grows until the next optimizer step."""
    copy_s: list[float] = field(default_factory=list)
    seal_s: list[float] = field(default_factory=list)
    replicate_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)
    # the writer thread's CPU per phase (thread_time; gloo's own threads are not in it): where a snapshot's
    # cycles go, for the overhead profile
    copy_cpu_s: list[float] = field(default_factory=list)
    seal_cpu_s: list[float] = field(default_factory=list)
    replicate_cpu_s: list[float] = field(default_factory=list)
    commit_cpu_s: list[float] = field(default_factory=list)
    restore: dict[str, Any] | None = None
    """What the last restore did, the same on every rank (JSON): the outcome, the plan, every copy refused by the
    check before use (:mod:`.restore`)."""
    restore_s: float | None = None
    restored_version: int | None = None
    restored_from: str | None = None
    """``local``, ``peer`` or ``resharded``."""
    replayed: int | None = None
    """Differentials replayed by the last restore."""
    replay_s: float | None = None
    fetch_checked_early: float | None = None
    """Fraction of a fetched blob's bytes checked while the rest arrived."""
    restore_parts: dict[str, float] | None = None
    """Where the last same-size restore's seconds went on this rank: ``plan_s`` (what every rank holds, scanned and
    all-gathered, and the plan), ``obtain_s`` (the fetch from a peer, or this rank's own copy, and the check before
    use, agreed by every rank), ``apply_s`` (copied into the live state, derived tensors checked, replay)."""
    unsealed: list[int] = field(default_factory=list)
    """Versions copied but never sealed: the step failed before its late client state was posted, or the worker
    was replaced at a hot-swap while it waited (restores take the version before)."""
    cut_short: list[int] = field(default_factory=list)
    """Versions whose replica exchange or global commit failed because a peer was lost (``writer.cut_short``):
    never committed; a restore takes the newest committed version."""
    abandoned: list[tuple[int | None, str]] = field(default_factory=list)
    """(version, phase) of each worker a hot-swap abandoned in a collective on the dead generation's communicator
    (``writer.stop``): it ends on its own and commits nothing."""

    def add_timing(self, name: str, value: float) -> None:
        series: list[float] = getattr(self, name)
        series.append(value)
        trim_window(series)

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        """The summary: counts and sizes, each timing series as ``<name>_median`` / ``<name>_max``, the last
        restore's fields where one ran, and ``extra`` (the manager's committed version, memory, boosts)."""
        out: dict[str, Any] = {"snapshots": self.snapshots, "diffs": self.diffs, "base_nbytes": self.base_nbytes,
                               "diff_nbytes": self.diff_nbytes}
        for name in ("checksum_fused", "worker_priority", "restore", "restore_s", "restored_version",
                     "restored_from", "replayed", "replay_s", "fetch_checked_early", "restore_parts"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in TIMINGS:
            vals = sorted(getattr(self, name))
            out[f"{name}_median"] = vals[len(vals) // 2] if vals else None
            out[f"{name}_max"] = vals[-1] if vals else None
        out.update(extra)
        return out
