"""Which rank runs on which failure domain.

Replica placement and recovery only need to know, for every rank, the failure
domain ("node") it shares fate with. Keeping that as plain, immutable data --
with no dependency on torch.distributed -- lets every rank compute identical
placements locally from the same input, and lets tests build arbitrary
(including uneven) clusters without launching processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["NodePlacement", "RankInfo", "Topology", "node_placement"]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One rank and the failure domain it lives in.

    ``node`` is an opaque failure-domain id (a hostname in production, a
    simulated node name in tests); ranks with equal ``node`` are assumed to be
    lost together, so they can never back each other up.
    """

    rank: int
    node: str
    local_rank: int


@dataclass(frozen=True, slots=True)
class Topology:
    """The full rank -> node map of a job, validated once at construction.

    Validation is strict (ranks must be exactly 0..N-1, in order) because a
    malformed topology would otherwise surface much later as replicas placed
    on the wrong node -- i.e. silent data loss at recovery time.
    """

    ranks: tuple[RankInfo, ...]
    # Derived lookups, computed once; excluded from eq/hash/repr so two
    # topologies compare purely by their ranks.
    _nodes: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _by_node: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        if not ranks:
            raise ValueError("Topology needs at least one rank; got none")
        for i, info in enumerate(ranks):
            if not isinstance(info, RankInfo):
                raise ValueError(f"Topology.ranks[{i}] must be a RankInfo, got {type(info).__name__}")
            if info.rank != i:
                seen = [r.rank for r in ranks]
                raise ValueError(
                    "Topology.ranks must list ranks 0..N-1 exactly once, sorted by rank; "
                    f"position {i} holds rank {info.rank} (ranks given: {seen})"
                )
            if not isinstance(info.node, str) or not info.node:
                raise ValueError(f"rank {i}: node must be a non-empty string, got {info.node!r}")
            if info.local_rank < 0:
                raise ValueError(f"rank {i}: local_rank must be >= 0, got {info.local_rank}")

        by_node: dict[str, list[int]] = {}
        for info in ranks:
            by_node.setdefault(info.node, []).append(info.rank)
        for node, members in by_node.items():
            local = sorted(ranks[r].local_rank for r in members)
            # Placement uses local_rank as an index within the node, so gaps or
            # duplicates would make it address ranks that do not exist.
            if local != list(range(len(members))):
                raise ValueError(
                    f"node {node!r}: local_ranks must be 0..{len(members) - 1} each exactly once, "
                    f"got {local}"
                )

        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_nodes", tuple(sorted(by_node)))
        object.__setattr__(self, "_by_node", {n: tuple(m) for n, m in by_node.items()})

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Distinct node ids, sorted so every rank agrees on one node order."""
        return self._nodes

    def node_of(self, rank: int) -> str:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is not in this topology (world size {len(self.ranks)})")
        return self.ranks[rank].node

    def ranks_on(self, node: str) -> tuple[int, ...]:
        """Ranks on ``node``, ascending; raises for unknown nodes to catch typos early."""
        try:
            return self._by_node[node]
        except KeyError:
            raise ValueError(f"node {node!r} is not in this topology (nodes: {list(self._nodes)})") from None

    @classmethod
    def from_node_list(cls, nodes: Sequence[str]) -> Topology:
        """Build from ``nodes[r]`` = node of rank r (e.g. an all-gathered hostname list).

        local_rank is the rank's index among the ranks of the same node, in
        rank order, which matches how torchrun/DeepSpeed launchers assign it.
        """
        if isinstance(nodes, str):
            # A bare string is a Sequence[str] too; treating "abc" as three
            # one-letter nodes is never what the caller meant.
            raise ValueError("nodes must be a sequence of node ids, not a single string")
        counts: dict[str, int] = {}
        infos = []
        for rank, node in enumerate(nodes):
            local = counts.get(node, 0)
            counts[node] = local + 1
            infos.append(RankInfo(rank=rank, node=node, local_rank=local))
        return cls(ranks=tuple(infos))

    @classmethod
    def uniform(cls, nnodes: int, nproc_per_node: int, prefix: str = "node") -> Topology:
        """``nnodes`` nodes of ``nproc_per_node`` ranks each, ranks laid out node-major.

        Node ids are zero-padded (node00..node15) so that the sorted node order
        equals the numeric order; otherwise "node10" would sort before "node2".
        """
        if nnodes < 1 or nproc_per_node < 1:
            raise ValueError(
                f"uniform topology needs nnodes >= 1 and nproc_per_node >= 1, got {nnodes} and {nproc_per_node}"
            )
        width = len(str(nnodes - 1))
        return cls.from_node_list(
            [f"{prefix}{i:0{width}d}" for i in range(nnodes) for _ in range(nproc_per_node)]
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlacement:
    """Where one rank's node-local memory lives and who looks after it; handed to the snapshot manager by the
    integration (built by :func:`node_placement` from the launcher's variables and the config)."""

    job_id: str
    node: str
    """This rank's failure domain."""
    first_on_node: bool
    """This rank claims the node's directory and starts its memory agent."""
    shm_root: str
    launcher_pid: int
    """The process whose exit ends the job (the agent frees the memory then)."""


def node_placement(*, job_id: str, host: str, launcher_node: str | None, local_rank: int, local_world_size: int,
                   simulate_nodes: int, shm_root: str, launcher_pid: int) -> NodePlacement:
    """Pure: the node of a rank. ``launcher_node`` (deadpool-run names each worker's node) wins; else with
    ``simulate_nodes`` = n the host's processes are split into n simulated nodes of consecutive local ranks
    (so tier 2 works on one host); else the host is the node."""
    if launcher_node is not None:
        node, first = launcher_node, local_rank == 0
    elif simulate_nodes:
        if local_world_size % simulate_nodes:
            raise ValueError(f"deadpool config: deadpool.local.simulate_nodes={simulate_nodes} must divide the "
                             f"{local_world_size} processes per host")
        per = local_world_size // simulate_nodes
        node, first = f"{host}-sim{local_rank // per}", local_rank % per == 0
    else:
        node, first = host, local_rank == 0
    return NodePlacement(job_id=job_id, node=node, first_on_node=first, shm_root=shm_root, launcher_pid=launcher_pid)
