"""Replica placement invariants: the safety properties recovery depends on."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from deadpool_ext.cluster.placement import (
    PlacementError,
    recovery_sources,
    replica_holders,
    replicas_held_by,
)
from deadpool_ext.cluster.topology import RankInfo, Topology


def _topo(sizes: list[int], *, interleave: bool = False) -> Topology:
    """Nodes of the given sizes; ``interleave`` spreads a node's ranks across the rank space."""
    names = [f"n{i}" for i, s in enumerate(sizes) for _ in range(s)]
    if interleave:
        random.Random(len(names)).shuffle(names)
    return Topology.from_node_list(names)


def _topologies() -> list[Topology]:
    out = [_topo(list(s)) for n in range(2, 5) for s in itertools.product([1, 2, 3], repeat=n)]
    out += [_topo([1, 2, 3], interleave=True), _topo([4, 1, 1, 2, 5], interleave=True)]
    out += [Topology.uniform(n, p) for n in (2, 3, 4, 7) for p in (1, 2, 8)]
    rng = random.Random(0)
    out += [_topo([rng.randint(1, 6) for _ in range(rng.randint(2, 9))], interleave=True) for _ in range(20)]
    return out


def _cases() -> list[tuple[Topology, int]]:
    return [(t, rf) for t in _topologies() for rf in range(1, len(t.nodes))]


def _loads(topo: Topology, holders: dict[int, tuple[int, ...]]) -> list[int]:
    held = replicas_held_by(holders)
    return [len(held.get(r, ())) for r in range(topo.world_size)]


# --- topology -------------------------------------------------------------


def test_from_node_list_assigns_local_ranks_in_rank_order() -> None:
    t = Topology.from_node_list(["b", "a", "b", "a", "b"])
    assert t.nodes == ("a", "b")
    assert [r.local_rank for r in t.ranks] == [0, 0, 1, 1, 2]
    assert t.ranks_on("b") == (0, 2, 4)
    assert t.node_of(3) == "a"
    assert t.world_size == 5


def test_uniform_node_names_sort_numerically() -> None:
    t = Topology.uniform(12, 2)
    assert t.nodes[:3] == ("node00", "node01", "node02")
    assert t.ranks_on("node10") == (20, 21)
    assert t == Topology.uniform(12, 2) and hash(t) == hash(Topology.uniform(12, 2))


@pytest.mark.parametrize(
    ("ranks", "match"),
    [
        ((), "at least one rank"),
        ((RankInfo(rank=1, node="a", local_rank=0),), "0..N-1"),
        ((RankInfo(rank=0, node="a", local_rank=0), RankInfo(rank=0, node="b", local_rank=0)), "0..N-1"),
        ((RankInfo(rank=1, node="a", local_rank=0), RankInfo(rank=0, node="a", local_rank=1)), "sorted"),
        ((RankInfo(rank=0, node="", local_rank=0),), "non-empty"),
        ((RankInfo(rank=0, node="a", local_rank=0), RankInfo(rank=1, node="a", local_rank=0)), "local_ranks"),
        ((RankInfo(rank=0, node="a", local_rank=1),), "local_ranks"),
    ],
)
def test_topology_validation(ranks: tuple[RankInfo, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(ranks=ranks)


def test_topology_lookup_errors() -> None:
    t = Topology.uniform(2, 2)
    with pytest.raises(ValueError, match="not in this topology"):
        t.node_of(4)
    with pytest.raises(ValueError, match="not in this topology"):
        t.ranks_on("nope")
    with pytest.raises(ValueError):
        Topology.from_node_list("abc")
    with pytest.raises(ValueError):
        Topology.uniform(0, 8)


# --- placement ------------------------------------------------------------


def test_never_on_own_node_and_distinct_nodes() -> None:
    cases = _cases()
    assert len(cases) > 300
    for topo, rf in cases:
        holders = replica_holders(topo, rf)
        assert sorted(holders) == list(range(topo.world_size))
        for src, hs in holders.items():
            assert len(hs) == rf, (topo, rf, src)
            nodes = [topo.node_of(h) for h in hs]
            assert topo.node_of(src) not in nodes, (topo, rf, src, hs)
            assert len(set(nodes)) == rf, (topo, rf, src, hs)


def test_uniform_topologies_hold_exactly_rf() -> None:
    for n, p in [(2, 1), (3, 4), (4, 8), (9, 2)]:
        topo = Topology.uniform(n, p)
        for rf in range(1, n):
            assert _loads(topo, replica_holders(topo, rf)) == [rf] * (n * p)


def test_uniform_is_ring_on_same_local_rank() -> None:
    topo = Topology.uniform(4, 2)
    # rank 1 is local 1 on node 0 -> local 1 on nodes 1 and 2.
    assert replica_holders(topo, 2)[1] == (3, 5)
    assert replica_holders(topo, 1)[7] == (1,)


def test_uneven_load_is_balanced() -> None:
    for topo, rf in _cases():
        loads = _loads(topo, replica_holders(topo, rf))
        assert sum(loads) == topo.world_size * rf
        # Within a node the incoming replicas are spread evenly.
        for node in topo.nodes:
            on_node = [loads[r] for r in topo.ranks_on(node)]
            assert max(on_node) - min(on_node) <= 1, (topo, rf, node, on_node)
        # Whenever one replica per rank is achievable on the "bigger nodes
        # feed smaller" side, nobody gets more than ceil(N*rf/N) = rf.
        sizes = sorted(len(topo.ranks_on(n)) for n in topo.nodes)
        if rf == 1 and sizes[-1] <= sum(sizes[:-1]):
            assert max(loads) == 1, (topo, loads)


def test_uneven_beats_naive_ring() -> None:
    # Nodes of sizes 1, 2, 3 with rf=1: a ring would give the single rank of
    # node n0 all three replicas of n2; one per rank is achievable.
    topo = _topo([1, 2, 3])
    assert _loads(topo, replica_holders(topo, 1)) == [1] * 6
    # rf=2 forces 5 onto rank 0 (n2's 3 ranks and n1's 2 ranks have no other
    # choice); the rest must stay spread.
    loads = _loads(topo, replica_holders(topo, 2))
    assert loads[0] == 5 and max(loads[1:]) <= 2


def test_optimal_max_load_against_brute_force() -> None:
    # Exhaustive search over all valid placements of tiny topologies.
    for sizes, rf in [([1, 2, 3], 1), ([1, 1, 3], 1), ([1, 2, 2, 1], 2), ([3, 1, 1, 1], 2), ([2, 1, 3, 1], 1)]:
        topo = _topo(sizes)
        choices = []
        for r in range(topo.world_size):
            others = [h for h in range(topo.world_size) if topo.node_of(h) != topo.node_of(r)]
            choices.append(
                [c for c in itertools.combinations(others, rf) if len({topo.node_of(h) for h in c}) == rf]
            )
        best = math.inf
        for combo in itertools.product(*choices):
            load = [0] * topo.world_size
            for hs in combo:
                for h in hs:
                    load[h] += 1
            best = min(best, max(load))
        assert max(_loads(topo, replica_holders(topo, rf))) == best, (sizes, rf)


def test_deterministic() -> None:
    for topo, rf in _cases()[::7]:
        again = Topology.from_node_list([r.node for r in topo.ranks])
        assert replica_holders(topo, rf) == replica_holders(again, rf)


def test_rf_too_large() -> None:
    with pytest.raises(PlacementError, match=r"replication_factor=2 .*3 nodes.*has 2") as ei:
        replica_holders(Topology.uniform(2, 4), 2)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(PlacementError, match="replication_factor=1"):
        replica_holders(Topology.uniform(1, 8), 1)
    with pytest.raises(PlacementError, match="replication_factor"):
        replica_holders(Topology.uniform(3, 1), -1)


def test_rf_zero() -> None:
    topo = Topology.uniform(1, 3)
    assert replica_holders(topo, 0) == {0: (), 1: (), 2: ()}
    assert replicas_held_by(replica_holders(topo, 0)) == {0: (), 1: (), 2: ()}


def test_inverse_mapping() -> None:
    for topo, rf in _cases()[::5]:
        holders = replica_holders(topo, rf)
        held = replicas_held_by(holders)
        assert sorted(held) == list(range(topo.world_size))
        pairs = {(s, h) for s, hs in holders.items() for h in hs}
        assert pairs == {(s, h) for h, ss in held.items() for s in ss}
        assert all(list(ss) == sorted(ss) for ss in held.values())


def test_recovery_one_lost_node() -> None:
    topo = Topology.uniform(4, 2)
    holders = replica_holders(topo, 2)
    src = recovery_sources(topo, holders, {"node1"})
    assert sorted(src) == [2, 3]
    assert src == {2: holders[2][0], 3: holders[3][0]}
    assert all(topo.node_of(h) != "node1" for h in src.values())


def test_recovery_node_and_holder_lost() -> None:
    topo = Topology.uniform(3, 2)
    holders = replica_holders(topo, 1)
    lost_node = "node0"
    holder_node = topo.node_of(holders[0][0])
    src = recovery_sources(topo, holders, {lost_node, holder_node})
    assert src[0] is None and src[1] is None
    # node1's own replicas went to node2, which survived.
    assert {r: src[r] for r in topo.ranks_on(holder_node)} == {
        r: holders[r][0] for r in topo.ranks_on(holder_node)
    }
    # With rf=2 the second replica saves node0.
    holders2 = replica_holders(topo, 2)
    src2 = recovery_sources(topo, holders2, {lost_node, topo.node_of(holders2[0][0])})
    assert src2[0] == holders2[0][1]


def test_recovery_any_rf_lost_nodes_is_recoverable() -> None:
    for topo, rf in _cases()[::3]:
        holders = replica_holders(topo, rf)
        for lost in itertools.combinations(topo.nodes, rf):
            assert None not in recovery_sources(topo, holders, set(lost)).values(), (topo, rf, lost)


def test_recovery_unknown_node() -> None:
    topo = Topology.uniform(2, 1)
    with pytest.raises(ValueError, match="typo|not in this topology"):
        recovery_sources(topo, replica_holders(topo, 1), {"node7"})


@pytest.mark.parametrize("per_node", [1, 2])
def test_spare_takes_the_failed_nodes_place_in_the_ring(per_node):
    """After a hot-swap the spare holds the failed node's ranks; placement is by rank order, not node name,
    so every survivor keeps its holders and sources (no replica moves)."""
    def topo(names):
        return Topology.from_node_list([n for n in names for _ in range(per_node)])

    before = replica_holders(topo(["node0", "node1", "node2", "node3"]), 2)
    for failed in range(4):
        names = [f"node{i}" for i in range(4)]
        names[failed] = "spare0"
        assert replica_holders(topo(names), 2) == before, failed


def test_stale_replica_buffers_are_dropped_after_the_first_replication(tmp_path):
    from deadpool_ext.memory.shm import segment_name
    from deadpool_ext.replicate.peer import PeerReplicator

    held = {(src, b): segment_name("job1", "replica", src, f"h1b{b}") for src in (0, 2) for b in (0, 1)}
    for fname in [*held.values(), segment_name("job1", "replica", 0, "h3b0"),
                  segment_name("job2", "replica", 2, "h1b0")]:
        (tmp_path / fname).write_bytes(b"x" * 4096)
    p = PeerReplicator.__new__(PeerReplicator)  # the file logic only: no process group needed
    p.rank, p.dir, p.job_id, p.kind, p.sources = 1, str(tmp_path), "job1", "replica", (0,)
    p._drop_stale()
    left = sorted(f.name for f in tmp_path.iterdir())
    assert held[(2, 0)] not in left and held[(2, 1)] not in left  # source 2 is no longer ours
    assert held[(0, 0)] in left and held[(0, 1)] in left  # our source's buffers stay
    assert segment_name("job1", "replica", 0, "h3b0") in left  # another holder's
    assert segment_name("job2", "replica", 2, "h1b0") in left  # another job's
