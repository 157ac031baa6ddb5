"""Where each rank's snapshot replicas live.

A replica only helps if it survives the failure that killed its source, so
replicas never share the source's node (failure domain), and the replicas of
one source sit on pairwise distinct nodes. Hence losing any ``rf`` nodes at
once still leaves a copy of every lost rank on a surviving node; only losing a
rank's node together with the nodes of all its ``rf`` holders loses it, which
is when `recovery_sources` returns None.

Everything here is a pure function of (topology, replication_factor): every
rank computes the same placement locally, with no communication, and the
result cannot drift between ranks or between a job and its restart.

Load balance matters because a holder's host memory and its network ingress
both scale with the number of replicas it receives; the most loaded rank sets
the snapshot latency for the whole job.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from deadpool_ext.cluster.topology import Topology

__all__ = ["PlacementError", "replica_holders", "replicas_held_by", "recovery_sources"]


class PlacementError(ValueError):
    """The requested replication cannot be placed on this topology."""


def replica_holders(topo: Topology, replication_factor: int) -> dict[int, tuple[int, ...]]:
    """For each rank, the ranks that hold its replicas (replica 1 first).

    Guarantees:

    * no holder is on the source rank's node, and one source's holders are on
      pairwise distinct nodes (so one node failure costs at most one copy);
    * deterministic: same input, same output, on every rank and every run;
    * load-balanced: the largest number of replicas held by any single rank is
      the smallest achievable on this topology.  With equally sized nodes that
      is exactly ``replication_factor`` per rank.

    The ring (rank with local index l on node i sends replica k to local
    index l mod size on node (i+k) mod n) is used whenever it reaches the
    lower bound of ``replication_factor`` replicas per rank -- always the case
    with equally sized nodes -- because it is easy to reason about when
    debugging a recovery. With uneven nodes the ring can be badly unbalanced
    (nodes of sizes 1, 2, 3 and rf=1: all three replicas of the 3-rank node
    land on the single rank of the 1-rank node, although one replica per rank
    is possible), so then a max-flow over node pairs finds optimal per-node
    replica counts and ranks are matched round-robin.

    ``replication_factor == 0`` yields empty tuples. Raises `PlacementError` if
    ``replication_factor`` is negative or exceeds ``number of nodes - 1``.
    """
    if isinstance(replication_factor, bool) or not isinstance(replication_factor, int):
        raise PlacementError(f"replication_factor must be an int, got {replication_factor!r}")
    if replication_factor < 0:
        raise PlacementError(f"replication_factor must be >= 0, got {replication_factor}")
    world = topo.world_size
    if replication_factor == 0:
        return {r: () for r in range(world)}

    # Nodes in order of their lowest rank, not by name: a spare that takes a failed node's ranks takes its
    # place in the ring too, so after a hot-swap every survivor keeps the sources and holders it had (its
    # replica buffers stay valid, nothing is re-allocated or re-sent). By name, "spare0" would sort after
    # "node2" and every replica of the job would move.
    nodes = sorted(topo.nodes, key=lambda n: min(topo.ranks_on(n)))
    n_nodes = len(nodes)
    if replication_factor > n_nodes - 1:
        raise PlacementError(
            f"replication_factor={replication_factor} needs at least {replication_factor + 1} nodes "
            f"(failure domains); topology has {n_nodes}"
        )

    # members[i][l] = rank with local_rank l on node i. Indexing by local_rank
    # (not by position in ranks_on) keeps the ring aligned with the launcher's
    # local ranks, e.g. GPU l always backs up to GPU l of the next node.
    members: list[list[int]] = []
    for node in nodes:
        on_node = topo.ranks_on(node)
        by_local = [0] * len(on_node)
        for r in on_node:
            by_local[topo.ranks[r].local_rank] = r
        members.append(by_local)
    sizes = [len(m) for m in members]

    ring = _ring(members, replication_factor)
    ring_max = _max_load(ring)
    # rf is a lower bound on the busiest rank (world*rf replicas over world
    # ranks), so a ring reaching it is optimal; that covers uniform nodes.
    if ring_max == replication_factor:
        return ring
    # Even when the ring's maximum cannot be beaten, re-plan: the ring folds a
    # big node onto the low local ranks of a small one, while the flow plan
    # spreads each node's incoming replicas evenly over its ranks.
    counts = _balanced_node_counts(sizes, replication_factor, at_most=ring_max)
    return _assign_ranks(members, counts, replication_factor)


def replicas_held_by(holders: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Invert `replica_holders`: holder rank -> source ranks it stores (sorted).

    Every rank that appears (as source or holder) gets an entry, so a rank that
    holds nothing maps to ``()`` rather than being missing -- callers iterate
    over their own rank without special-casing.
    """
    held: dict[int, list[int]] = {r: [] for r in holders}
    for source, hs in holders.items():
        for h in hs:
            held.setdefault(h, []).append(source)
    return {h: tuple(sorted(srcs)) for h, srcs in sorted(held.items())}


def recovery_sources(
    topo: Topology,
    holders: Mapping[int, tuple[int, ...]],
    lost_nodes: set[str] | frozenset[str],
) -> dict[int, int | None]:
    """For each rank on a lost node, a surviving rank that holds its replica.

    The first holder (in ``holders`` order, i.e. the nearest replica) whose
    node survived is chosen, so all ranks agree on the same source without
    talking to each other. ``None`` means every copy of that rank's state was
    on a lost node: the job must fall back to a persistent checkpoint.
    """
    unknown = set(lost_nodes) - set(topo.nodes)
    if unknown:
        # Almost certainly a hostname typo or a topology from another job;
        # silently ignoring it would report "nothing to recover".
        raise ValueError(f"lost_nodes {sorted(unknown)} are not in this topology (nodes: {list(topo.nodes)})")
    result: dict[int, int | None] = {}
    for info in topo.ranks:
        if info.node not in lost_nodes:
            continue
        result[info.rank] = next((h for h in holders.get(info.rank, ()) if topo.node_of(h) not in lost_nodes), None)
    return result


def _ring(members: list[list[int]], rf: int) -> dict[int, tuple[int, ...]]:
    n_nodes = len(members)
    out: dict[int, tuple[int, ...]] = {}
    for i, ranks in enumerate(members):
        for local, rank in enumerate(ranks):
            out[rank] = tuple(
                members[(i + k) % n_nodes][local % len(members[(i + k) % n_nodes])] for k in range(1, rf + 1)
            )
    return dict(sorted(out.items()))


def _assign_ranks(members: list[list[int]], counts: list[list[int]], rf: int) -> dict[int, tuple[int, ...]]:
    """Turn node-pair counts into rank-level holders.

    ``counts[i][j]`` ranks of node i send one replica to node j. Source side:
    write target nodes as runs (ring order from i+1), run j of length
    counts[i][j] <= size_i, and give position p to local rank p mod size_i; a
    run never wraps onto the same rank twice, so each rank's targets are
    distinct. Target side: hand incoming replicas to node j's ranks
    round-robin, so its ranks' loads differ by at most one.
    """
    n_nodes = len(members)
    per_source: dict[int, list[int]] = {r: [] for ranks in members for r in ranks}
    incoming: list[list[int]] = [[] for _ in range(n_nodes)]
    target_of: dict[tuple[int, int], int] = {}
    for i, ranks in enumerate(members):
        seq = [j for k in range(1, n_nodes) for j in [(i + k) % n_nodes] for _ in range(counts[i][j])]
        assert len(seq) == len(ranks) * rf, "flow must route every replica"
        for pos, j in enumerate(seq):
            src = ranks[pos % len(ranks)]
            per_source[src].append(j)
            incoming[j].append(src)
    for j, srcs in enumerate(incoming):
        for t, src in enumerate(sorted(srcs)):
            target_of[(src, j)] = members[j][t % len(members[j])]
    return {src: tuple(target_of[(src, j)] for j in per_source[src]) for src in sorted(per_source)}


def _max_load(holders: Mapping[int, tuple[int, ...]]) -> int:
    load: dict[int, int] = {}
    for hs in holders.values():
        for h in hs:
            load[h] = load.get(h, 0) + 1
    return max(load.values(), default=0)


def _balanced_node_counts(sizes: list[int], rf: int, *, at_most: int) -> list[list[int]]:
    """Node-pair replica counts minimising max over nodes of ceil(received / size).

    ``at_most`` must be a feasible cap (the ring's maximum load is: the ring
    is a witness); it bounds the search.

    Any rank-level placement induces such counts and its busiest rank on node
    j holds at least ceil(received_j / size_j), while `_assign_ranks` achieves
    exactly that; so optimising at node level is optimal at rank level, on a
    graph of nodes instead of ranks.

    Feasibility of a per-rank cap L is a max-flow: source -> node i (cap
    size_i*rf) -> node j != i (cap size_i: each rank sends node j at most one
    replica) -> sink (cap L*size_j). Feasibility is monotone in L, so binary
    search it.
    """
    lo, hi = rf, at_most
    best: list[list[int]] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        flow = _node_flow(sizes, rf, mid)
        if flow is not None:
            best, hi = flow, mid - 1
        else:
            lo = mid + 1
    assert best is not None, "at_most must be feasible"
    return best


def _node_flow(sizes: list[int], rf: int, cap: int) -> list[list[int]] | None:
    """Counts routing all replicas with at most ``cap`` per holder rank, or None."""
    n = len(sizes)
    graph = _Dinic(2 * n + 2)
    src, sink = 2 * n, 2 * n + 1
    pair_edge: dict[tuple[int, int], int] = {}
    for i in range(n):
        graph.add_edge(src, i, sizes[i] * rf)
        graph.add_edge(n + i, sink, cap * sizes[i])
        for k in range(1, n):
            # Ring order from i+1 makes augmenting paths (hence ties) prefer
            # near nodes, mirroring the uniform ring.
            j = (i + k) % n
            pair_edge[(i, j)] = graph.add_edge(i, n + j, sizes[i])
    if graph.max_flow(src, sink) < sum(sizes) * rf:
        return None
    counts = [[0] * n for _ in range(n)]
    for (i, j), e in pair_edge.items():
        counts[i][j] = graph.flow_on(e)
    return counts


class _Dinic:
    """Minimal deterministic Dinic max-flow (graphs here have ~2*nodes vertices)."""

    __slots__ = ("adj", "to", "cap", "orig")

    def __init__(self, n: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []
        self.orig: list[int] = []

    def add_edge(self, u: int, v: int, c: int) -> int:
        e = len(self.to)
        self.to += [v, u]
        self.cap += [c, 0]
        self.orig += [c, 0]
        self.adj[u].append(e)
        self.adj[v].append(e + 1)
        return e

    def flow_on(self, e: int) -> int:
        return self.orig[e] - self.cap[e]

    def max_flow(self, s: int, t: int) -> int:
        total = 0
        n = len(self.adj)
        while True:
            level = [-1] * n
            level[s] = 0
            queue = deque([s])
            while queue:
                u = queue.popleft()
                for e in self.adj[u]:
                    v = self.to[e]
                    if self.cap[e] > 0 and level[v] < 0:
                        level[v] = level[u] + 1
                        queue.append(v)
            if level[t] < 0:
                return total
            it = [0] * n
            while True:
                pushed = self._push(s, t, level, it)
                if not pushed:
                    break
                total += pushed

    def _push(self, s: int, t: int, level: list[int], it: list[int]) -> int:
        # Iterative DFS (recursion depth is tiny here, but iterative keeps it
        # safe and avoids per-call overhead): find one blocking-flow path.
        path: list[int] = []
        u = s
        while True:
            if u == t:
                f = min(self.cap[e] for e in path)
                for e in path:
                    self.cap[e] -= f
                    self.cap[e ^ 1] += f
                return f
            adj = self.adj[u]
            advanced = False
            while it[u] < len(adj):
                e = adj[it[u]]
                v = self.to[e]
                if self.cap[e] > 0 and level[v] == level[u] + 1:
                    path.append(e)
                    u = v
                    advanced = True
                    break
                it[u] += 1
            if not advanced:
                if not path:
                    return 0
                # Dead end: retreat and skip the edge that led here.
                e = path.pop()
                u = self.to[e ^ 1]
                it[u] += 1
