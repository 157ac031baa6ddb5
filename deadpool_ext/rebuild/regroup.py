"""A spare built solo for one node's ranks takes another node's ranks when its groups are subgroups of the world.

Why: :func:`~deadpool_ext.rebuild.swap.relabel` renumbers groups that span the whole world (ZeRO's data-parallel
ranks), where a group's rank is the global rank. Megatron-Core's groups are subgroups (tensor, pipeline, data
parallel, their gloo twins), each made by a ``new_group(ranks)`` that every rank calls in the same order, members or
not. A spare built for node B's ranks is a member of B's groups; to take node A's ranks it must be a member of A's
groups instead, under the names torch gave them (the in-place swap rendezvouses each group under its name, and
every rank lists its groups by name and members before the swap: ``worker._check_same_groups``). When the two
nodes hold the same coordinates but for data parallelism, exchanging A's and B's ranks (``mapping``) maps every
group of the spare onto a group of the job: B's tensor-parallel group onto A's, the data-parallel group onto
itself with another rank in it. So each group is renamed to the group ``mapping`` sends it to and renumbered.

The names come from a record kept while the spare builds: torch's name of every group made (the k-th group of a
set of members, in creation order; torch gives a name also to a group this rank is not in, and keeps no trace of
it). The framework's own copies of its ranks (Megatron's global rank lists) are the integration's to map
(``integrations/megatron/parallel.py`` :func:`relabel`).

Call order (a spare building ahead, ``rebuild/spare.py``):

1. :func:`record` once its default group is built solo, before the script makes any other group;
2. at an assignment to another node's ranks: :func:`node_permutation` (pure) from the two nodes' ranks, then
   :func:`plan` (what each group becomes, or why not: nothing changed yet), then :func:`apply`;
3. :func:`stop` once assigned (either way): torch's naming is its own again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .context import context


@dataclass(frozen=True, slots=True)
class Regroup:
    """What one of this rank's groups becomes (:func:`plan`)."""

    group: Any
    """The :class:`~deadpool_ext.rebuild.swap.SwappableGroup`."""
    name: str
    members: tuple[int, ...]


def record() -> None:
    """From now on, torch's name of every group made is kept with its members (step 1). Idempotent."""
    c10d = dist.distributed_c10d
    original = c10d._process_group_name
    if getattr(original, "deadpool_recording", False):
        return
    made = context().groups_made

    def named(ranks: Any, use_hashed_name: bool) -> Any:
        name = original(ranks, use_hashed_name)
        made.setdefault(tuple(sorted(int(r) for r in ranks)), []).append(str(name))
        return name

    named.deadpool_recording = True  # type: ignore[attr-defined]
    named.original = original  # type: ignore[attr-defined]
    c10d._process_group_name = named


def stop() -> None:
    """torch names groups on its own again (step 3); the record stays until the process ends."""
    c10d = dist.distributed_c10d
    original = getattr(c10d._process_group_name, "original", None)
    if original is not None:
        c10d._process_group_name = original


def node_permutation(built: list[int], assigned: list[int]) -> dict[int, int] | str:
    """The exchange of the two nodes' ranks, local index for local index: ``built`` the ranks the spare's processes
    built for, ``assigned`` the ones they take (pure). A string: why not."""
    if len(built) != len(assigned):
        return f"the node it built for has {len(built)} ranks, the one it takes {len(assigned)}"
    if set(built) & set(assigned):
        return f"the ranks it built for {built} and the ones it takes {assigned} overlap"
    mapping = dict(zip(built, assigned, strict=True))
    mapping.update(zip(assigned, built, strict=True))
    return mapping


def plan(mapping: Mapping[int, int]) -> list[Regroup] | str:
    """What each group this rank is in becomes under ``mapping`` (step 2; nothing is changed), or why it cannot:
    a group that ``mapping`` sends to a set of ranks the job never made a group of, or one made before the record."""
    from . import swap

    c10d = dist.distributed_c10d
    world, made = c10d._world, context().groups_made
    default = c10d._get_default_group()
    out = []
    for g in swap.groups():
        members = tuple(sorted(world.pg_group_ranks[g]))
        new = tuple(sorted(mapping.get(m, m) for m in members))
        if g is default or new == members:
            out.append(Regroup(g, g.group_name, members))
            continue
        names = made.get(members) or []
        if g.group_name not in names:
            return f"process group {g.group_name!r} of ranks {list(members)} was made before its names were recorded"
        k = names.index(g.group_name)
        targets = made.get(new) or []
        if k >= len(targets):
            return (f"process group {g.group_name!r} of ranks {list(members)} would become one of ranks {list(new)}, "
                    "which the job never made")
        out.append(Regroup(g, targets[k], new))
    return out


def apply(groups: list[Regroup], rank: int) -> int:
    """Rename and renumber this rank's groups as :func:`plan` said, for global rank ``rank`` (step 2). Returns how
    many were renamed."""
    from . import swap

    c10d = dist.distributed_c10d
    world = c10d._world
    renamed = 0
    for r in groups:
        g = r.group
        if r.name != g.group_name:
            old_tag = world.pg_to_tag.get(g)
            if old_tag is not None and g in world.tags_to_pg.get(old_tag, []):
                world.tags_to_pg[old_tag].remove(g)
            new_tag = f"ptd:{r.name}"
            world.tags_to_pg.setdefault(new_tag, []).append(g)
            world.pg_to_tag[g] = new_tag
            name: Any = getattr(c10d, "GroupName", str)(r.name)  # a str subtype in the torch versions that have it
            world.pg_names[g] = name
            c10d._register_process_group(name, g)
            renamed += 1
        world.pg_group_ranks[g] = {m: i for i, m in enumerate(r.members)}
        g._rank = r.members.index(rank)
        if isinstance(g.inner, swap._Solo):
            g.inner.rank = g._rank
    return renamed
