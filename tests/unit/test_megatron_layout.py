"""TP/PP/DP coordinates of ranks (pure), the spare-takes-the-same-coordinates property, and replica
placement outside each shard's failure domain for Megatron layouts."""
from __future__ import annotations

import itertools

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment, replace_failed
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


# -- elastic: data parallelism only (dp_resize) and the global batch (keep_global_batch) --------------------------
def _world(n: int, per_node: int) -> tuple[list[Worker], dict[str, int]]:
    workers = [Worker(f"node{i // per_node}.{i % per_node}", f"node{i // per_node}", i % per_node) for i in range(n)]
    return workers, {w.worker_id: r for r, w in enumerate(workers)}


def _shrink(ranks: dict[str, int], lost_node: str) -> dict[str, int]:
    from deadpool_ext.cluster.assignment import Assignment
    from deadpool_ext.cluster.membership import shrink_failed

    nodes = {w: w.split(".")[0] for w in ranks}
    a = Assignment(generation=0, world_size=len(ranks), ranks=ranks, nodes=nodes)
    return shrink_failed(a, {lost_node}).ranks


def test_shrink_that_drops_whole_data_parallel_replicas_keeps_every_shard():
    from deadpool_ext.integrations.megatron.layout import dp_resize, shard_name

    for tp, pp, n, per_node in ((2, 1, 4, 2), (1, 1, 4, 2), (2, 1, 8, 2), (2, 1, 6, 2), (1, 2, 8, 1)):
        lay = Layout(world_size=n, tp=tp, pp=pp)
        _, ranks = _world(n, per_node)
        lost = "node1" if pp == 1 else None
        if lost is None:  # pp 2 on single-process nodes: lose both ranks of dp replica 1 (ranks 1 and 5)
            new = {w: i for i, w in enumerate(w for w, r in sorted(ranks.items(), key=lambda kv: kv[1])
                                              if coordinates(r, lay).dp != 1)}
        else:
            new = _shrink(ranks, lost)
        got = dp_resize(lay, ranks, new, len(new))
        assert (got.tp, got.pp, got.world_size) == (tp, pp, len(new)) and got.dp < lay.dp
        for w, r in new.items():  # every survivor keeps its shard
            assert shard_name(coordinates(r, got), got) == shard_name(coordinates(ranks[w], lay), lay)


def test_shrink_that_breaks_a_tensor_or_pipeline_group_is_refused_naming_the_rank():
    from deadpool_ext.integrations.megatron.layout import dp_resize

    # PP2 x DP2 on 2 nodes of 2: node1 holds pipeline stage 1 of both replicas.
    _, ranks = _world(4, 2)
    with pytest.raises(LayoutError, match=r"rank 1 at \(tp 0, pp 0\) would become rank 1 at \(tp 0, pp 1\).*"
                                          r"\[2, 3\].*pipeline-parallel group lost a member"):
        dp_resize(Layout(world_size=4, tp=1, pp=2), ranks, _shrink(ranks, "node1"), 2)
    # TP2 x DP3 on 2 nodes of 3: 3 ranks left is no multiple of tp 2.
    _, ranks = _world(6, 3)
    with pytest.raises(LayoutError, match=r"3 ranks are not a multiple of tensor-parallel x pipeline-parallel = 2 x 1"):
        dp_resize(Layout(world_size=6, tp=2, pp=1), ranks, _shrink(ranks, "node1"), 3)


def test_grow_appends_whole_replicas():
    from deadpool_ext.integrations.megatron.layout import dp_resize

    _, old = _world(2, 2)
    new = {**old, "node1.0": 2, "node1.1": 3}
    assert dp_resize(Layout(world_size=2, tp=2, pp=1), old, new, 4) == Layout(world_size=4, tp=2, pp=1)


def test_global_batch_kept_by_micro_batches_or_refused():
    from deadpool_ext.integrations.megatron.layout import keep_global_batch

    assert keep_global_batch(8, 4, 1, 1, False) == (2, 8)      # dp 2 -> 1: two micro-batches per rank
    assert keep_global_batch(8, 4, 2, 2, False) == (1, 8)      # and back
    with pytest.raises(LayoutError, match="cannot keep the global batch 12 at data-parallel size 2.*allow_batch"):
        keep_global_batch(12, 4, 1, 2, False)
    assert keep_global_batch(12, 4, 1, 2, True) == (1, 8)      # opted in: micro-batches stay, the batch changes


def test_tier3_bases_refuse_virtual_pipeline_stages_before_any_collective(tmp_path):
    """Every rank holds the same chunk count, so each refuses alike, before a barrier could leave a peer waiting
    (no process group exists here: a collective would raise something else)."""
    pytest.importorskip("megatron.core")
    from deadpool_ext.integrations.megatron.checkpoint import load_base, save_base

    two = [object(), object()]
    for call, what in ((lambda: save_base(str(tmp_path), two, None, None, None, None), "save_base"),
                       (lambda: load_base(str(tmp_path), two, None, None, None), "load_base")):
        with pytest.raises(LayoutError, match=rf"{what}: tier-3 bases take one model chunk per rank, got 2 "
                                              r"\(virtual pipeline stages"):
            call()


def test_batch_flags_of_the_megatron_script_are_one_line_each():
    """The demo Megatron script's batch flags (``training/megatron/train.py::batch_flags``): each error is one line
    and names its flag (``ConfigError.key``); that the real script refuses such a flag before training is
    test_megatron.py::test_bad_batch_flags_are_refused_naming_the_flag."""
    from deadpool_ext.config import ConfigError
    from deadpool_ext.training.megatron.train import batch_flags

    dp2 = Layout(world_size=2, tp=1, pp=1)
    assert batch_flags(None, None, 4, dp2) == (8, 1)
    assert batch_flags(16, None, 4, dp2) == (16, 2)
    assert batch_flags(None, 3, 2, Layout(world_size=4, tp=2, pp=1)) == (12, 3)
    with pytest.raises(ConfigError, match=r"^--global-batch-size 5 is not a multiple of --micro-batch-size 4 x "
                                          r"data-parallel size 1$") as err:
        batch_flags(5, None, 4, Layout(world_size=1, tp=1, pp=1))
    assert err.value.key == "--global-batch-size"
    with pytest.raises(ConfigError, match=r"^--global-batch-size and --num-microbatches: give one of them") as err:
        batch_flags(8, 2, 4, dp2)
    assert err.value.key == "--num-microbatches"
