"""The restore planner of the memory tiers: which version, which copies, from where. Pure: no process group, no
shared memory, no torch (unit-tested on plain reports: tests/unit/test_restore_plan.py, test_agree.py).

What the planner reads, gathered by the executor (:mod:`.restore`) from every rank:

- a same-size restore: each rank's :class:`RankReport` (own slots and ring, replicas held for others);
- an elastic restore: each node's census (:meth:`.tier1.TierOneStore.census`: every copy in its directory, of
  whichever world wrote it), the copies refused so far, and the new world's partition layout.

What it returns, one of:

- :class:`Fresh`: nothing in memory;
- :class:`KeepBase`: nothing newer than the tier-3 base already loaded;
- :class:`SameSizePlan`: this world's own snapshots (:func:`choose_version`: every rank's base, who fetches from
  which holder, the differentials to replay);
- :class:`ElasticPlan`: a version of a world of another size, each old rank's copy and provider, and the pairwise
  moves (old rank -> new rank) the new partitions need (:mod:`deadpool_ext.recovery.reshard`).

The same-size rule (:func:`choose_version`): each rank reports the versions it holds complete and checksum-clean in
its own tier-1 slots, and the versions of the peer replicas it holds for other ranks (tier 2); in differential mode
also the differentials, locally and as replicas. A version is obtainable from one source (own memory, or one holder)
when that source holds its full snapshot, or a base plus every differential after it up to the version (a chain).
The chosen version is the newest one that *every* rank can obtain, from its own memory or from a surviving holder.
Ranks never restore different versions: that would be a silently wrong model, the failure users of other systems
report most.

No copy is trusted by the plan: the executor checks each before use, and a refused one is excluded before the
planner is asked again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..recovery.reshard import (
    REPLICATED,
    AnyLayout,
    PartitionLayout,
    ReplicatedLayout,
    ReshardError,
    check_compatible,
    layout_from_json,
    overlaps,
    replica_moves,
    with_rank,
)

# -- the same-size rule: which version every rank can obtain -----------------------------------------------------------

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


# -- the plans ---------------------------------------------------------------------------------------------------------

MAX_ELASTIC_ROUNDS = 8
"""An elastic restore chooses again at most this often after copies are refused before use."""


@dataclass(frozen=True, slots=True)
class Fresh:
    """No snapshot of this job in local or peer memory."""


@dataclass(frozen=True, slots=True)
class KeepBase:
    """The memory tiers hold ``version`` (of a world of ``world`` ranks), not newer than the tier-3 base."""

    version: int
    tier3_base: int
    world: int


@dataclass(frozen=True, slots=True)
class SameSizePlan:
    """Restore this world's own snapshots: :class:`RestorePlan` says each rank's base and who fetches what."""

    plan: RestorePlan

    @property
    def version(self) -> int:
        return self.plan.version


Copy = dict[str, Any]
"""A census entry: ``{file, tier, rank, world, version, nbytes[, layout]}``."""


@dataclass(frozen=True, slots=True)
class ElasticPlan:
    """Restore ``version`` of a world of ``world_old`` ranks onto ``world_new`` ranks."""

    version: int
    world_old: int
    world_new: int
    providers: dict[int, tuple[int, Copy]]
    """old rank -> (the new rank that serves its copy, the census entry of that copy)."""
    moves: list[tuple[int, int]]
    """(old rank, new rank) pairs, in the one global order every rank runs them."""
    olds: Mapping[int, AnyLayout]
    """Each old rank's layout, as the copies it sends must carry."""
    news: list[PartitionLayout] = field(default_factory=list)
    """Each new rank's partitions (empty for a replicated layout: a new rank takes one old copy whole)."""

    @property
    def replicated(self) -> bool:
        return not self.news

    def tiers(self) -> list[int]:
        """The tier of each copy the moves read, by old rank."""
        return [self.providers[r][1]["tier"] for r in sorted({r for r, _ in self.moves})]


Decision = Fresh | KeepBase | SameSizePlan | ElasticPlan


def plan_same_size(reports: list[RankReport], newer_than: int | None) -> Fresh | KeepBase | SameSizePlan:
    """The newest version every rank can obtain from its own memory or a holder. Raises
    :class:`NoCommonVersionError` when state exists but no version is complete."""
    plan = choose_version(reports)
    if plan is None:
        return Fresh()
    if newer_than is not None and plan.version <= newer_than:
        return KeepBase(version=plan.version, tier3_base=newer_than, world=len(reports))
    return SameSizePlan(plan=plan)


def choose_copies(census: list[list[Copy]], refused: set[tuple[int, str]]
                  ) -> tuple[int, int, dict[int, tuple[int, Copy]]] | None:
    """(world, version, old rank -> (provider, copy)) of the newest version some world holds completely; a tier-1
    slot is preferred to a replica, then the lowest provider. ``refused``: (provider, file) pairs to leave out."""
    have: dict[tuple[int, int], dict[int, list[tuple[int, int, Copy]]]] = {}
    for provider, blobs in enumerate(census):
        for b in blobs:
            if (provider, b["file"]) in refused or not 0 <= b["rank"] < b["world"]:
                continue
            have.setdefault((b["world"], b["version"]), {}).setdefault(b["rank"], []).append((b["tier"], provider, b))
    complete = [(v, w) for (w, v), ranks in have.items() if len(ranks) == w]
    if not complete:
        return None
    version, world = max(complete)
    chosen = {r: min(c, key=lambda x: (x[0], x[1])) for r, c in have[(world, version)].items()}
    return world, version, {r: (p, b) for r, (_, p, b) in chosen.items()}


def old_layout(census: list[list[Copy]], world: int) -> AnyLayout:
    """The layout of the world of ``world`` ranks, from one of its copies."""
    for blobs in census:
        for b in blobs:
            if b["world"] == world and "layout" in b:
                return layout_from_json(b["layout"])
    raise RecoveryError(f"the snapshots of the world of {world} ranks carry no partition layout (taken by a "
                        "version of deadpool_ext or a framework that cannot reshard): cannot restore them at another "
                        "data-parallel size")


def plan_elastic(census: list[list[Copy]], refused: set[tuple[int, str]], *, world_new: int,
                 new_layout: dict[str, Any] | None, news_replicated: list[ReplicatedLayout] | None,
                 newer_than: int | None, why_no_layout: str = "") -> ElasticPlan | KeepBase | None:
    """The elastic plan, or None when the newest complete version is this world's own (the same-size plan applies)
    or memory holds nothing. ``new_layout``: this rank's partition layout (JSON; None: the engine cannot reshard,
    ``why_no_layout`` says why); ``news_replicated``: every new rank's layout when it is a replicated one.
    Raises :class:`RecoveryError` when the version chosen cannot be resharded onto this world."""
    pick = choose_copies(census, refused)
    if pick is None:
        return None
    world_old, version, providers = pick
    if world_old == world_new and (new_layout is None
                                   or old_layout(census, world_old).dp == layout_from_json(new_layout).dp):
        return None  # this world's own snapshots: the same-size restore
    if newer_than is not None and version <= newer_than:
        return KeepBase(version=version, tier3_base=newer_than, world=world_old)
    if new_layout is None:
        raise RecoveryError(f"the newest state in memory (step {version}) was taken by a world of {world_old} "
                            f"ranks, this one has {world_new}, and this engine's state cannot be resharded"
                            + (f" ({why_no_layout})" if why_no_layout else ""))
    new = layout_from_json(new_layout)
    try:
        base = old_layout(census, world_old)
        if news_replicated is not None:
            if not isinstance(base, ReplicatedLayout):
                raise ReshardError(f"the snapshots' partition rule {base.rule!r} differs from this job's "
                                   f"{REPLICATED!r}")
            replicas = _old_replicas(providers)
            moves = replica_moves(replicas, news_replicated, {r: p for r, (p, _) in providers.items()})
            return ElasticPlan(version=version, world_old=world_old, world_new=world_new, providers=providers,
                               moves=moves, olds=replicas)
        assert isinstance(new, PartitionLayout)
        if not isinstance(base, PartitionLayout):
            raise ReshardError(f"the snapshots' partition rule {base.rule!r} differs from this engine's {new.rule!r}")
        check_compatible(base, new)
        if base.dp != world_old or new.dp != world_new:
            raise ReshardError(f"resharding covers data parallelism only (dp {base.dp} of {world_old} ranks -> dp "
                               f"{new.dp} of {world_new})")
        parts = {r: with_rank(base, world_old, r, base.part) for r in range(world_old)}
        news = [with_rank(new, world_new, n, new.part) for n in range(world_new)]
        moves = [(r, n) for r in range(world_old) for n in range(world_new) if overlaps(parts[r], news[n])]
    except ReshardError as exc:
        raise RecoveryError(f"cannot reshard step {version} from {world_old} to {world_new} ranks: {exc}") from None
    return ElasticPlan(version=version, world_old=world_old, world_new=world_new, providers=providers, moves=moves,
                       olds=parts, news=news)


def _old_replicas(providers: dict[int, tuple[int, Copy]]) -> dict[int, ReplicatedLayout]:
    """Each old rank's replicated layout, from the census entry of the copy chosen for it."""
    out: dict[int, ReplicatedLayout] = {}
    for r, (_, b) in sorted(providers.items()):
        layout = layout_from_json(b.get("layout"))
        if not isinstance(layout, ReplicatedLayout):
            raise ReshardError(f"rank {r}'s copy {b['file']} carries a {layout.rule!r} layout among replicated ones")
        out[r] = layout
    return out


@dataclass(frozen=True, slots=True)
class RestorePlanner:
    """The one planner of a restore: the same inputs on every rank give the same decision on every rank.

    Call order (the executor, every rank, each round of one restore):

    1. with ``elastic`` (``no_spare_policy: shrink``): :meth:`elastic` over the census and the copies refused so
       far; None means this world's own snapshots are the newest: go on to 2.;
    2. :meth:`same_size` over every rank's report.
    """

    world: int
    newer_than: int | None = None
    elastic_allowed: bool = False
    new_layout: dict[str, Any] | None = None
    news_replicated: list[ReplicatedLayout] | None = None
    why_no_layout: str = ""

    def elastic(self, census: list[list[Copy]], refused: set[tuple[int, str]]) -> ElasticPlan | KeepBase | None:
        if not self.elastic_allowed:
            return None
        return plan_elastic(census, refused, world_new=self.world, new_layout=self.new_layout,
                            news_replicated=self.news_replicated, newer_than=self.newer_than,
                            why_no_layout=self.why_no_layout)

    def same_size(self, reports: list[RankReport]) -> Fresh | KeepBase | SameSizePlan:
        return plan_same_size(reports, self.newer_than)
