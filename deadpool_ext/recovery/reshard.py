"""Resharding ZeRO partitions between data-parallel sizes, element for element (pure: no torch, no processes).

A rank's snapshot holds, per *group* ``g`` (``master.<g>`` and the optimizer moments ``optim.<g>.<key>``), one
flat partition. Which elements of which parameters that partition holds is a :class:`PartitionLayout`, written
by the framework's state adapter into every snapshot's metadata (``layout``):

- ``rule="flat"`` (DeepSpeed ZeRO-1/2): group ``g`` is the concatenation of its parameters (in order), padded
  at the end; rank ``r`` holds elements ``[r * P, (r + 1) * P)`` of it, ``P`` its partition length;
- ``rule="per_param"`` (DeepSpeed ZeRO-3): every parameter of ``n`` elements is cut into ``dp`` pieces of
  ``s = ceil(n / dp)`` (the last padded); rank ``r`` holds piece ``r`` of each parameter of the group, the
  pieces concatenated in order (padding included, so each takes ``s`` slots).

A parameter is named by its index ``pid`` in the model's parameter order (the same model on every rank: the
layout carries a fingerprint of names and shapes). :func:`segments` turns one rank's layout into runs
``(pid, start, length, offset)``: elements ``start .. start+length`` of parameter ``pid`` sit at ``offset`` in
the rank's flat partition. :func:`overlaps` intersects an old rank's runs with a new rank's: what to copy from
where. :func:`needed_sources` is which old ranks a new rank needs at all (the transfer plan).

Padding is never copied: a new partition's padding stays zero, as in a freshly built engine (whose moments of
padding stay zero: their gradient is zero).

A third rule, :class:`ReplicatedLayout` (``rule="replicated"``, Megatron-Core without the distributed
optimizer), has no partitions at all: the state of a model-parallel *shard* (a tensor- and pipeline-parallel
slice of the model) is the same on every data-parallel rank of it, so a new rank takes its shard's state whole
from one old rank of that shard (:func:`replica_moves`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RULES = ("flat", "per_param")
REPLICATED = "replicated"


class ReshardError(ValueError):
    """Two layouts that cannot be resharded into each other (another model, another rule), or a malformed one."""


@dataclass(frozen=True, slots=True)
class Run:
    pid: int
    start: int
    """First element of the parameter in this run."""
    length: int
    offset: int
    """Where that element sits in the rank's flat partition of the group."""


@dataclass(frozen=True, slots=True)
class PartitionLayout:
    """How one rank's flat partitions map to parameter elements (see the module docstring)."""

    rule: str
    dp: int
    dp_rank: int
    groups: tuple[tuple[tuple[int, int], ...], ...]
    """Per group: (pid, numel) of its parameters, in flat order."""
    part: tuple[int, ...]
    """Per group: this rank's partition length (elements)."""
    model: str
    """Fingerprint of the model's parameter names and shapes."""

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "dp": self.dp, "dp_rank": self.dp_rank, "model": self.model,
                "groups": [[list(p) for p in g] for g in self.groups], "part": list(self.part)}

    @classmethod
    def from_json(cls, d: Any) -> PartitionLayout:
        """Strict: a layout read from a snapshot header is checked field by field before any use."""
        try:
            if not isinstance(d, dict) or set(d) != {"rule", "dp", "dp_rank", "model", "groups", "part"}:
                raise TypeError("fields")
            rule, dp, dp_rank, model = d["rule"], d["dp"], d["dp_rank"], d["model"]
            groups = tuple(tuple((_nat(p[0]), _nat(p[1])) for p in g if len(p) == 2) for g in d["groups"])
            if any(len(g) != len(raw) for g, raw in zip(groups, d["groups"])):
                raise TypeError("group entries")
            part = tuple(_nat(x) for x in d["part"])
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise ReshardError(f"malformed partition layout in a snapshot ({exc})") from None
        if rule not in RULES or type(dp) is not int or dp < 1 or type(dp_rank) is not int or not 0 <= dp_rank < dp:
            raise ReshardError(f"malformed partition layout: rule {rule!r}, dp {dp!r}, dp_rank {dp_rank!r}")
        if not isinstance(model, str) or len(part) != len(groups):
            raise ReshardError("malformed partition layout: model fingerprint or partition lengths")
        return cls(rule=rule, dp=dp, dp_rank=dp_rank, groups=groups, part=part, model=model)

    def params(self) -> dict[int, int]:
        """pid -> numel over every group."""
        return {pid: n for g in self.groups for pid, n in g}


def _nat(x: Any) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"{x!r} is not a non-negative int")
    return x


def piece(numel: int, dp: int) -> int:
    """ZeRO-3's partition length of one parameter: ceil(numel / dp)."""
    return -(-numel // dp)


def segments(layout: PartitionLayout) -> list[list[Run]]:
    """Per group, the runs of parameter elements this rank's partition holds (padding left out)."""
    out: list[list[Run]] = []
    r, dp = layout.dp_rank, layout.dp
    for g, params in enumerate(layout.groups):
        runs: list[Run] = []
        if layout.rule == "flat":
            lo, hi = r * layout.part[g], (r + 1) * layout.part[g]
            at = 0
            for pid, n in params:
                a, b = max(lo, at), min(hi, at + n)
                if a < b:
                    runs.append(Run(pid, a - at, b - a, a - lo))
                at += n
        else:
            off = 0
            for pid, n in params:
                s = piece(n, dp)
                length = max(0, min(n - r * s, s))
                if length:
                    runs.append(Run(pid, r * s, length, off))
                off += s
            if off != layout.part[g]:
                raise ReshardError(f"group {g}: per-parameter pieces take {off} elements, the partition has "
                                   f"{layout.part[g]}")
        out.append(runs)
    return out


def check_compatible(old: PartitionLayout, new: PartitionLayout) -> None:
    """Same model, same rule, the same parameters with the same sizes: else :class:`ReshardError`."""
    if old.model != new.model:
        raise ReshardError(f"the snapshots were taken of another model (fingerprint {old.model} != {new.model})")
    if old.rule != new.rule:
        raise ReshardError(f"the snapshots' partition rule {old.rule!r} differs from this engine's {new.rule!r} "
                           "(another ZeRO stage)")
    if old.params() != new.params():
        raise ReshardError("the snapshots' parameters differ from this engine's (count or sizes)")


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``length`` elements from group ``src_group`` at ``src_offset`` of the old rank's partition to group
    ``dst_group`` at ``dst_offset`` of the new rank's."""

    src_group: int
    src_offset: int
    dst_group: int
    dst_offset: int
    length: int


def overlaps(old: PartitionLayout, new: PartitionLayout) -> list[Copy]:
    """What the new rank takes from the old rank's partition (empty: nothing)."""
    by_pid: dict[int, list[tuple[int, Run]]] = {}
    for g, runs in enumerate(segments(old)):
        for run in runs:
            by_pid.setdefault(run.pid, []).append((g, run))
    out: list[Copy] = []
    for g, runs in enumerate(segments(new)):
        for d in runs:
            for sg, s in by_pid.get(d.pid, ()):
                a, b = max(d.start, s.start), min(d.start + d.length, s.start + s.length)
                if a < b:
                    out.append(Copy(sg, s.offset + a - s.start, g, d.offset + a - d.start, b - a))
    return out


def covered(new: PartitionLayout) -> list[int]:
    """Per group, how many elements of the new partition are parameter elements (what the copies must fill)."""
    return [sum(run.length for run in runs) for runs in segments(new)]


def needed_sources(olds: Sequence[PartitionLayout], new: PartitionLayout) -> list[int]:
    """Indices of the old layouts the new rank copies from (those with at least one overlap)."""
    return [i for i, old in enumerate(olds) if overlaps(old, new)]


def with_rank(layout: PartitionLayout, dp: int, dp_rank: int, part: Sequence[int]) -> PartitionLayout:
    """The layout of another rank of the same job (the old world's ranks, from one of their layouts and each
    rank's partition lengths)."""
    return PartitionLayout(rule=layout.rule, dp=dp, dp_rank=dp_rank, groups=layout.groups, part=tuple(part),
                           model=layout.model)


@dataclass(frozen=True, slots=True)
class ReplicatedLayout:
    """A rank whose whole state is that of its model-parallel shard, replicated along data parallelism."""

    dp: int
    dp_rank: int
    shard: str
    """Which model-parallel slice of the model (the framework's name for it, compared for equality only)."""
    model: str
    """Fingerprint of the shard's tensors (names and shapes)."""
    rule: str = REPLICATED

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "dp": self.dp, "dp_rank": self.dp_rank, "shard": self.shard, "model": self.model}

    @classmethod
    def from_json(cls, d: Any) -> ReplicatedLayout:
        """Strict, like :meth:`PartitionLayout.from_json`."""
        if not isinstance(d, dict) or set(d) != {"rule", "dp", "dp_rank", "shard", "model"} or d["rule"] != REPLICATED:
            raise ReshardError("malformed replicated layout in a snapshot (fields)")
        dp, dp_rank, shard, model = d["dp"], d["dp_rank"], d["shard"], d["model"]
        if type(dp) is not int or dp < 1 or type(dp_rank) is not int or not 0 <= dp_rank < dp:
            raise ReshardError(f"malformed replicated layout: dp {dp!r}, dp_rank {dp_rank!r}")
        if not isinstance(shard, str) or not isinstance(model, str) or len(shard) > 200 or len(model) > 200:
            raise ReshardError("malformed replicated layout: shard or model fingerprint")
        return cls(dp=dp, dp_rank=dp_rank, shard=shard, model=model)


AnyLayout = PartitionLayout | ReplicatedLayout


def layout_from_json(d: Any) -> AnyLayout:
    """The layout a snapshot header carries, of whichever rule (strict)."""
    if isinstance(d, dict) and d.get("rule") == REPLICATED:
        return ReplicatedLayout.from_json(d)
    return PartitionLayout.from_json(d)


def replica_moves(old: Mapping[int, ReplicatedLayout], new: Sequence[ReplicatedLayout],
                  provider_of: Mapping[int, int]) -> list[tuple[int, int]]:
    """(old rank, new rank) for every new rank of a replicated layout: the old rank whose copy it takes whole.

    Among the old ranks of its shard, a new rank takes one whose copy it serves itself (``provider_of``: old
    rank -> the new rank that holds its copy; nothing moves), else the lowest. Every new rank's shard must have
    an old rank, of the same model: else :class:`ReshardError`."""
    by_shard: dict[str, list[int]] = {}
    for r in sorted(old):
        by_shard.setdefault(old[r].shard, []).append(r)
    moves: list[tuple[int, int]] = []
    for n, layout in enumerate(new):
        candidates = by_shard.get(layout.shard)
        if not candidates:
            raise ReshardError(f"no old rank holds shard {layout.shard} (new rank {n}); the old world held "
                               f"{sorted(by_shard) or 'none'}")
        r = next((r for r in candidates if provider_of.get(r) == n), candidates[0])
        if old[r].model != layout.model:
            raise ReshardError(f"shard {layout.shard}: the snapshots were taken of another model (fingerprint "
                               f"{old[r].model} != {layout.model})")
        moves.append((r, n))
    return sorted(moves)
