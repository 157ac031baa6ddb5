"""Which version to restore: a pure decision over what every rank reports it can read.

Each rank reports the versions it holds complete and checksum-clean in its own tier-1 slots, and the versions
of the peer replicas it holds for other ranks (tier 2); in differential mode also the differentials, locally
and as replicas. A version is obtainable from one source (own memory, or one holder) when that source holds
its full snapshot, or a base plus every differential after it up to the version (a chain). The chosen
version is the newest one that *every* rank can obtain, from its own memory or from a surviving holder. Ranks
never restore different versions: that would be a silently wrong model, the failure users of other systems report most.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RecoveryError(RuntimeError):
    """No consistent state can be restored from the memory tiers; the message says what each rank had."""


class NoCommonVersionError(RecoveryError):
    """The agreement itself found no version every rank can obtain: the same decision on every rank, so a
    caller may fall back to another tier on all ranks alike (unlike a fetch that fails on one rank)."""


@dataclass(kw_only=True, slots=True)
class RankReport:
    rank: int
    local: dict[int, int] = field(default_factory=dict)
    """version -> blob size of complete, verified copies in this rank's own slots."""
    replicas: dict[int, dict[int, int]] = field(default_factory=dict)
    """source rank -> {version: blob size} of complete, verified replicas this rank holds (up to two per
    source: replicas are double-buffered like the local slots)."""
    local_diffs: dict[int, int] = field(default_factory=dict)
    """version -> blob size of complete, verified differentials in this rank's own ring."""
    replica_diffs: dict[int, dict[int, int]] = field(default_factory=dict)
    """source rank -> {version: blob size} of differential replicas this rank holds."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "local": _enc(self.local), "replicas": _enc2(self.replicas),
                "local_diffs": _enc(self.local_diffs), "replica_diffs": _enc2(self.replica_diffs)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankReport:
        return cls(rank=int(d["rank"]), local=_dec(d["local"]), replicas=_dec2(d["replicas"]),
                   local_diffs=_dec(d.get("local_diffs", {})), replica_diffs=_dec2(d.get("replica_diffs", {})))


def _enc(m: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in m.items()}


def _enc2(m: dict[int, dict[int, int]]) -> dict[str, dict[str, int]]:
    return {str(k): _enc(v) for k, v in m.items()}


def _dec(m: dict[str, Any]) -> dict[int, int]:
    return {int(k): int(v) for k, v in m.items()}


def _dec2(m: dict[str, Any]) -> dict[int, dict[int, int]]:
    return {int(k): _dec(v) for k, v in m.items()}


def reachable(bases: dict[int, int], diffs: dict[int, int]) -> dict[int, int]:
    """version -> the newest base from which one source can rebuild it (the base itself, or base + the
    unbroken run of differentials after it)."""
    out: dict[int, int] = {}
    for b in sorted(bases):
        out[b] = b
        v = b + 1
        while v in diffs:
            out[v] = b
            v += 1
    return out


@dataclass(kw_only=True, slots=True)
class RestorePlan:
    version: int
    fetch: dict[int, tuple[int, int]]
    """rank -> (holder rank, blob size of the base) for ranks that must fetch their state from a peer."""
    base: dict[int, int] = field(default_factory=dict)
    """rank -> version of the base it restores (== ``version`` unless differentials are replayed)."""
    fetch_diffs: dict[int, dict[int, int]] = field(default_factory=dict)
    """rank -> {differential version: blob size} to fetch from its holder (ranks in ``fetch`` only)."""

    def diffs(self, rank: int) -> list[int]:
        """Differentials ``rank`` replays on its base, in order."""
        return list(range(self.base.get(rank, self.version) + 1, self.version + 1))

    @property
    def replays(self) -> bool:
        return any(b != self.version for b in self.base.values())


def choose_version(reports: list[RankReport]) -> RestorePlan | None:
    """Newest version restorable on all ranks; ``None`` when no rank holds anything (a fresh start).

    Raises :class:`RecoveryError` when state exists but no single version is complete for every rank.
    """
    world = len(reports)
    if sorted(r.rank for r in reports) != list(range(world)):
        raise ValueError("reports must cover ranks 0..world-1 exactly once")
    by_rank = {r.rank: r for r in reports}
    local = {r.rank: reachable(r.local, r.local_diffs) for r in reports}
    held = {(h.rank, src): reachable(bases, h.replica_diffs.get(src, {}))
            for h in reports for src, bases in h.replicas.items()}
    candidates: set[int] = set()
    for m in [*local.values(), *held.values()]:
        candidates.update(m)
    if not candidates:
        return None
    for version in sorted(candidates, reverse=True):
        fetch: dict[int, tuple[int, int]] = {}
        base: dict[int, int] = {}
        fetch_diffs: dict[int, dict[int, int]] = {}
        for rank in range(world):
            if version in local[rank]:
                base[rank] = local[rank][version]
                continue
            holders = sorted(h for (h, src), m in held.items() if src == rank and version in m)
            if not holders:
                break
            h = holders[0]
            b = held[(h, rank)][version]
            base[rank] = b
            fetch[rank] = (h, by_rank[h].replicas[rank][b])
            diffs = by_rank[h].replica_diffs.get(rank, {})
            if b < version:
                fetch_diffs[rank] = {v: diffs[v] for v in range(b + 1, version + 1)}
        else:
            return RestorePlan(version=version, fetch=fetch, base=base, fetch_diffs=fetch_diffs)
    lines = [f"rank {r.rank}: own {sorted(r.local) or 'none'}"
             + (f" + differentials {sorted(r.local_diffs)}" if r.local_diffs else "")
             + f", holds replicas { {k: sorted(v) for k, v in sorted(r.replicas.items())} or 'none'}"
             + (f" + differential replicas { {k: sorted(v) for k, v in sorted(r.replica_diffs.items())} }"
                if r.replica_diffs else "") for r in reports]
    raise NoCommonVersionError("no snapshot version is complete for every rank in local or peer memory; "
                        "what each rank has:\n  " + "\n  ".join(lines))
