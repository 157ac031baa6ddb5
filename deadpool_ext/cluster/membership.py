"""Pure membership logic of hot-swap: who holds which rank in each generation.

No processes, no sockets: plain dataclasses in, plain dataclasses out (the records are in
:mod:`deadpool_ext.cluster.assignment`), unit-tested directly. The launcher calls :func:`initial_assignment` once
and :func:`replace_failed` on every failure; a spare reads :func:`shadowed_node` / :func:`prepared_rank`.
"""
from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from .assignment import Assignment, Worker


class NoSpareError(RuntimeError):
    """A failed node cannot be replaced: no spare node is left. The message names what failed."""


def initial_assignment(workers: list[Worker], active_nodes: list[str], spare_nodes: list[str]) -> Assignment:
    """Ranks are dealt node by node in ``active_nodes`` order, by local index within a node."""
    if set(active_nodes) & set(spare_nodes):
        raise ValueError(f"nodes {sorted(set(active_nodes) & set(spare_nodes))} are both active and spare")
    ranks: dict[str, int] = {}
    nodes: dict[str, str] = {}
    rank = 0
    for node in active_nodes:
        members = sorted((w for w in workers if w.node == node), key=lambda w: w.local_index)
        if not members:
            raise ValueError(f"active node {node!r} has no workers")
        for w in members:
            ranks[w.worker_id] = rank
            nodes[w.worker_id] = node
            rank += 1
    return Assignment(generation=0, world_size=rank, ranks=ranks, nodes=nodes, spares=tuple(spare_nodes))


def shadowed_node(a: Assignment, spare_node: str) -> str | None:
    """The active node of ``a`` whose ranks the spare node ``spare_node`` builds its engine for before any
    failure (``hot_swap.spare_build_ahead``), None when it is not one of ``a``'s spares.

    The i-th spare (in ``a.spares`` order) takes the active node at position i + 1 (modulo their number) in
    rank order: spares cover the nodes after the first one first, because the first node's host serves the job's
    embedded store by default, and the job does not outlive that host (docs/multi-host.md)."""
    if spare_node not in a.spares:
        return None
    active = a.active_nodes()
    return active[(a.spares.index(spare_node) + 1) % len(active)] if active else None


def prepared_rank(a: Assignment, spare_node: str, local_index: int) -> int | None:
    """The rank the spare process ``local_index`` of ``spare_node`` builds its engine for ahead of a failure: the
    rank of the same local index on :func:`shadowed_node` (None: no such node or process)."""
    node = shadowed_node(a, spare_node)
    ranks = a.node_ranks(node) if node is not None else []
    return ranks[local_index] if 0 <= local_index < len(ranks) else None


def fits(current: Assignment, node: str, spare_workers: list[Worker],
         prepared: Mapping[str, tuple[int, int]]) -> bool:
    """Whether the spare node whose processes are ``spare_workers`` (in local-index order) built its engines for
    exactly ``node``'s ranks of a world of ``current``'s size (``prepared``: worker id -> (rank, world size), as
    its heartbeats say)."""
    old = current.node_ranks(node)
    if len(spare_workers) < len(old) or not old:
        return False
    return all(prepared.get(w.worker_id) == (r, current.world_size) for r, w in zip(old, spare_workers))


def node_workers(workers: list[Worker], node: str) -> list[Worker]:
    """``node``'s processes in local-index order."""
    return sorted((w for w in workers if w.node == node), key=lambda w: w.local_index)


def spares_ready(old: Assignment, new: Assignment, workers: list[Worker],
                 prepared: Mapping[str, tuple[int, int]]) -> dict[str, bool]:
    """Failed node -> whether the spare that took its ranks in ``new`` had built its engines ahead for them."""
    return {failed: fits(old, failed, node_workers(workers, spare), prepared) for failed, spare in new.replaced.items()}


def replace_failed(current: Assignment, workers: list[Worker], failed_nodes: AbstractSet[str],
                   dead_spares: AbstractSet[str] = frozenset(),
                   prepared: Mapping[str, tuple[int, int]] | None = None) -> Assignment:
    """Next generation: each failed node's ranks go, in local-index order, to a live spare node: the one that
    built its engines ahead for exactly those ranks (``prepared``: worker id -> (rank, world size)) if there is
    one, else the next in order (which then builds its engine after the assignment).

    Survivors keep their ranks, so their local snapshots stay theirs. Raises :class:`NoSpareError` when
    there are fewer live spares than failed nodes; dead spares are dropped from the pool first.
    """
    spares = [s for s in current.spares if s not in dead_spares and s not in failed_nodes]
    failed = sorted(n for n in failed_nodes if n in set(current.nodes.values()))
    if len(failed) > len(spares):
        raise NoSpareError(f"node(s) {failed} failed but only {len(spares)} spare node(s) are left "
                           f"({spares or 'none'}); start the job with more --spare-nodes")
    ranks = dict(current.ranks)
    nodes = dict(current.nodes)
    replaced: dict[str, str] = {}
    # the failed nodes some spare built ahead for take that spare first; the others take the next in order
    matched = {n: next((s for s in spares if fits(current, n, node_workers(workers, s), prepared or {})), None)
               for n in failed}
    order = sorted(failed, key=lambda n: matched[n] is None)
    for node in order:
        spare = matched[node] if matched[node] in spares else spares[0]
        assert spare is not None
        spares.remove(spare)
        old = sorted(((r, w) for w, r in current.ranks.items() if current.nodes[w] == node))
        new = node_workers(workers, spare)
        if len(new) < len(old):
            raise NoSpareError(f"spare node {spare} has {len(new)} processes, node {node} had {len(old)}")
        for (rank, dead_worker), w in zip(old, new):
            del ranks[dead_worker], nodes[dead_worker]
            ranks[w.worker_id] = rank
            nodes[w.worker_id] = spare
        replaced[node] = spare
    return Assignment(generation=current.generation + 1, world_size=current.world_size, ranks=ranks, nodes=nodes,
                      spares=tuple(spares), replaced=replaced)


def shrink_failed(current: Assignment, failed_nodes: AbstractSet[str],
                  dead_spares: AbstractSet[str] = frozenset()) -> Assignment:
    """Next generation without the failed nodes (no spare left, ``--no-spare-policy shrink``): the survivors
    keep their order and are renumbered ``0 .. M-1`` (a node's ranks stay consecutive), the world is M.

    Raises :class:`NoSpareError` when no node would be left."""
    failed = {n for n in failed_nodes if n in set(current.nodes.values())}
    survivors = sorted((r, w) for w, r in current.ranks.items() if current.nodes[w] not in failed)
    if not survivors:
        raise NoSpareError(f"node(s) {sorted(failed)} failed and no node is left to shrink to")
    ranks = {w: i for i, (_, w) in enumerate(survivors)}
    nodes = {w: current.nodes[w] for _, w in survivors}
    spares = tuple(s for s in current.spares if s not in dead_spares and s not in failed)
    return Assignment(generation=current.generation + 1, world_size=len(ranks), ranks=ranks, nodes=nodes,
                      spares=spares, shrunk=tuple(sorted(failed)))


def grow_into(current: Assignment, workers: list[Worker], node: str) -> Assignment:
    """Next generation with ``node`` (a repaired node or a new spare, its processes started and waiting) added
    to a shrunk world: everyone keeps their rank, the node's processes take ranks ``M .. M+k-1``."""
    if node in set(current.nodes.values()):
        raise ValueError(f"node {node} is already in generation {current.generation}")
    joining = sorted((w for w in workers if w.node == node), key=lambda w: w.local_index)
    if not joining:
        raise ValueError(f"node {node} has no processes")
    ranks = dict(current.ranks)
    nodes = dict(current.nodes)
    for i, w in enumerate(joining):
        ranks[w.worker_id] = current.world_size + i
        nodes[w.worker_id] = node
    return Assignment(generation=current.generation + 1, world_size=len(ranks), ranks=ranks, nodes=nodes,
                      spares=tuple(s for s in current.spares if s != node), grown=(node,))
