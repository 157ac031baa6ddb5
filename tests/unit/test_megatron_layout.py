"""TP/PP/DP coordinates of ranks (pure), the spare-takes-the-same-coordinates property, and replica
placement outside each shard's failure domain for Megatron layouts."""
from __future__ import annotations

import itertools

import pytest

from deadpool_ext.cluster.membership import Worker, initial_assignment, replace_failed
from deadpool_ext.cluster.placement import replica_holders
from deadpool_ext.cluster.topology import Topology
from deadpool_ext.integrations.megatron.layout import (
    Coordinates,
    Layout,
    LayoutError,
    coordinates,
    rank_of,
    tp_groups_within_nodes,
)


def test_megatron_default_order_tp_dp_pp():
    lay = Layout(world_size=8, tp=2, pp=2)
    assert lay.dp == 2
    got = [coordinates(r, lay) for r in range(8)]
    assert got[:4] == [Coordinates(0, 0, 0), Coordinates(1, 0, 0), Coordinates(0, 0, 1), Coordinates(1, 0, 1)]
    assert got[4] == Coordinates(tp=0, pp=1, dp=0)
    assert all(rank_of(c, lay) == r for r, c in enumerate(got))
    assert len(set(got)) == 8


@pytest.mark.parametrize(("world", "tp", "pp", "match"), [
    (4, 3, 1, "not divisible by tensor-parallel x pipeline-parallel = 3 x 1 = 3"),
    (6, 2, 2, "world size 6"),
    (4, 0, 1, "--tensor-model-parallel-size must be a positive integer"),
    (4, 1, -1, "--pipeline-model-parallel-size"),
])
def test_bad_layouts_are_clear_errors(world, tp, pp, match):
    with pytest.raises(LayoutError, match=match):
        Layout(world_size=world, tp=tp, pp=pp)


@pytest.mark.parametrize(("nnodes", "nproc", "tp", "pp"), [(2, 2, 2, 1), (2, 2, 1, 2), (4, 2, 2, 2), (3, 4, 4, 1)])
def test_spare_takes_exactly_the_failed_ranks_coordinates(nnodes, nproc, tp, pp):
    workers = [Worker(f"{n}.{i}", n, i) for n in [f"node{k}" for k in range(nnodes)] + ["spare0"] for i in range(nproc)]
    a0 = initial_assignment(workers, [f"node{k}" for k in range(nnodes)], ["spare0"])
    lay = Layout(world_size=a0.world_size, tp=tp, pp=pp)
    for failed in [f"node{k}" for k in range(nnodes)]:
        a1 = replace_failed(a0, workers, {failed})
        for w, rank in a1.ranks.items():
            if a1.nodes[w] == "spare0":
                old = next(ow for ow, r in a0.ranks.items() if r == rank)
                assert a0.nodes[old] == failed
                assert coordinates(rank, lay) == coordinates(a0.ranks[old], lay)
        # survivors keep rank, hence coordinates
        assert {w: r for w, r in a1.ranks.items() if a1.nodes[w] != "spare0"} == \
               {w: r for w, r in a0.ranks.items() if a0.nodes[w] != failed}


@pytest.mark.parametrize(("nnodes", "nproc", "tp", "pp", "rf"),
                         [(2, 2, 2, 1, 1), (2, 2, 1, 2, 1), (4, 2, 2, 2, 1), (4, 2, 2, 2, 2), (3, 4, 2, 2, 2)])
def test_no_replica_in_the_failure_domain_of_its_shard(nnodes, nproc, tp, pp, rf):
    """Every (tp, pp, dp) shard's replicas sit on nodes other than the shard's own; with rf >= 1, losing any
    one node leaves a copy of every shard it held."""
    topo = Topology.uniform(nnodes, nproc)
    lay = Layout(world_size=topo.world_size, tp=tp, pp=pp)
    holders = replica_holders(topo, rf)
    for rank in range(topo.world_size):
        shard_node = topo.node_of(rank)
        nodes = [topo.node_of(h) for h in holders[rank]]
        assert shard_node not in nodes, (coordinates(rank, lay), nodes)
        assert len(set(nodes)) == rf
    for lost in topo.nodes:
        for rank in topo.ranks_on(lost):
            assert any(topo.node_of(h) != lost for h in holders[rank]), coordinates(rank, lay)


def test_tp_groups_within_nodes():
    assert tp_groups_within_nodes(Layout(world_size=4, tp=2, pp=1), 2)
    assert not tp_groups_within_nodes(Layout(world_size=8, tp=4, pp=1), 2)


def test_coordinates_cover_every_rank_once():
    for world, tp, pp in itertools.product([4, 8, 12], [1, 2, 4], [1, 2, 3]):
        if world % (tp * pp):
            continue
        lay = Layout(world_size=world, tp=tp, pp=pp)
        assert sorted(rank_of(coordinates(r, lay), lay) for r in range(world)) == list(range(world))
