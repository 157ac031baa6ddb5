"""Which version to restore: a pure decision over what every rank reports it can read.

Each rank reports the versions it holds complete and checksum-clean in its own tier-1 slots, and the versions
of the peer replicas it holds for other ranks (tier 2). The chosen version is the newest one that *every* rank
can obtain, from its own memory or from a surviving holder. Ranks never restore different versions: that
would be a silently wrong model, the failure users of other systems report most.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RecoveryError(RuntimeError):
    """No consistent state can be restored from the memory tiers; the message says what each rank had."""


@dataclass(kw_only=True, slots=True)
class RankReport:
    rank: int
    local: dict[int, int] = field(default_factory=dict)
    """version -> blob size of complete, verified copies in this rank's own slots."""
    replicas: dict[int, dict[int, int]] = field(default_factory=dict)
    """source rank -> {version: blob size} of complete, verified replicas this rank holds (up to two per
    source: replicas are double-buffered like the local slots)."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "local": {str(k): v for k, v in self.local.items()},
                "replicas": {str(k): {str(v): n for v, n in vs.items()} for k, vs in self.replicas.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RankReport":
        return cls(rank=int(d["rank"]), local={int(k): int(v) for k, v in d["local"].items()},
                   replicas={int(k): {int(v): int(n) for v, n in vs.items()} for k, vs in d["replicas"].items()})


@dataclass(kw_only=True, slots=True)
class RestorePlan:
    version: int
    fetch: dict[int, tuple[int, int]]
    """rank -> (holder rank, blob size) for ranks that must fetch their state from a peer replica (of
    ``version``)."""


def choose_version(reports: list[RankReport]) -> RestorePlan | None:
    """Newest version restorable on all ranks; ``None`` when no rank holds anything (a fresh start).

    Raises :class:`RecoveryError` when state exists but no single version is complete for every rank.
    """
    world = len(reports)
    if sorted(r.rank for r in reports) != list(range(world)):
        raise ValueError("reports must cover ranks 0..world-1 exactly once")
    by_rank = {r.rank: r for r in reports}
    candidates: set[int] = set()
    for r in reports:
        candidates.update(r.local)
        for versions in r.replicas.values():
            candidates.update(versions)
    if not candidates:
        return None
    for version in sorted(candidates, reverse=True):
        fetch: dict[int, tuple[int, int]] = {}
        for rank in range(world):
            if version in by_rank[rank].local:
                continue
            holders = sorted(h.rank for h in reports if version in h.replicas.get(rank, {}))
            if not holders:
                break
            fetch[rank] = (holders[0], by_rank[holders[0]].replicas[rank][version])
        else:
            return RestorePlan(version=version, fetch=fetch)
    lines = [f"rank {r.rank}: own {sorted(r.local) or 'none'}, holds replicas "
             f"{ {k: sorted(v) for k, v in sorted(r.replicas.items())} or 'none'}" for r in reports]
    raise RecoveryError("no snapshot version is complete for every rank in local or peer memory; "
                        "what each rank has:\n  " + "\n  ".join(lines))
