"""Megatron-Core's parallel state on swappable groups, without processes (issue 44, part 3): a spare built solo for
rank 2 of a TP2 x DP2 world builds every group Megatron makes, its gloo twins swappable too, at the coordinates
rank 2 has; relabelled to rank 0 (the other data-parallel replica: node0's ranks exchanged for node1's) its groups,
their names and Megatron's rank lists are exactly those of a spare built for rank 0; an exchange that would change
a rank's model shard is refused in one line."""
import contextlib

import pytest
import torch.distributed as dist

from deadpool_ext.rebuild import swap

pytest.importorskip("megatron.core")


@pytest.fixture(autouse=True)
def _cpu_shims():
    """Megatron's CPU shims for these tests only: reverted after each, as tests/unit/test_patches.py expects."""
    from deadpool_ext import patches  # type: ignore[attr-defined]
    from deadpool_ext.integrations.megatron import parallel

    already = [n for n in patches.MEGATRON_CORE_CPU if patches.get(n).applied]
    parallel.apply_cpu_shims()
    yield
    patches.revert_all([n for n in patches.MEGATRON_CORE_CPU if n not in already])


@contextlib.contextmanager
def _solo_world(rank: int, size: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    swap.use()
    swap.set_mode("solo")
    dist.init_process_group(swap.BACKEND, store=swap.SoloStore(size), rank=rank, world_size=size)
    try:
        yield
    finally:
        from deadpool_ext.integrations.megatron import parallel

        parallel.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        swap.set_mode("live")


def test_a_spare_builds_megatrons_groups_solo_all_swappable_at_its_coordinates():
    from megatron.core import parallel_state as ps

    from deadpool_ext.integrations.megatron import parallel
    from deadpool_ext.integrations.megatron.layout import Coordinates, Layout

    with _solo_world(rank=2, size=4):
        coords = parallel.initialize(Layout(world_size=4, tp=2, pp=1), seed=1234)
        assert coords == Coordinates(tp=0, pp=0, dp=1)
        made = [ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                ps.get_data_parallel_group_gloo(), ps.get_pipeline_model_parallel_group()]
        assert all(isinstance(g, swap.SwappableGroup) for g in made), [type(g).__name__ for g in made]
        gloo = ps.get_data_parallel_group_gloo()
        assert gloo.kind == "gloo" and dist.get_process_group_ranks(gloo) == [0, 2]
        assert dist.new_group is not None and dist.new_group.__name__ == "new_group"  # the substitution is undone
        assert dist.new_group.__module__ == "torch.distributed.distributed_c10d"
        # Megatron's groups are subgroups of the world: not renumbered as a whole (regroup.py renames them)
        assert "process group(s) were made without this rank" in (swap.relabel_refusal(4) or "")


def test_gloo_twins_stay_plain_gloo_without_the_swap():
    """A job whose groups are not swappable (``hot_swap.in_place: false``) gets Megatron's groups unchanged."""
    from megatron.core import parallel_state as ps

    from deadpool_ext.integrations.megatron import parallel
    from deadpool_ext.integrations.megatron.layout import Layout

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel.initialize(Layout(world_size=1, tp=1, pp=1), seed=1234)
        assert not isinstance(ps.get_data_parallel_group_gloo(), swap.SwappableGroup)
    finally:
        parallel.destroy()
        dist.destroy_process_group()


def _megatron_view():
    from megatron.core import parallel_state as ps

    lists = {k: v for k, v in vars(ps).items() if k.startswith("_") and k.endswith("_RANKS") and isinstance(v, list)}
    ranks = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
             dist.get_rank(group=ps.get_data_parallel_group_gloo()), dist.get_rank())
    return swap.describe(), lists, ranks


def test_a_spare_built_for_rank_2_relabelled_to_rank_0_is_what_a_spare_built_for_rank_0_is():
    from deadpool_ext.integrations.megatron import parallel
    from deadpool_ext.integrations.megatron.layout import Layout, dp_exchange_refusal
    from deadpool_ext.rebuild import regroup

    layout = Layout(world_size=4, tp=2, pp=1)
    with _solo_world(rank=0, size=4):
        parallel.initialize(layout, seed=1234)
        want = _megatron_view()
    with _solo_world(rank=2, size=4):
        regroup.record()
        try:
            parallel.initialize(layout, seed=1234)
            mapping = regroup.node_permutation([2, 3], [0, 1])
            assert mapping == {2: 0, 3: 1, 0: 2, 1: 3} and dp_exchange_refusal(mapping, layout) is None
            groups = regroup.plan(mapping)
            assert not isinstance(groups, str), groups
            assert regroup.apply(groups, 0) > 0
            assert parallel.relabel(mapping) > 0
            got = _megatron_view()
        finally:
            regroup.stop()
    assert got == want
    assert dist.distributed_c10d._process_group_name.__module__ == "torch.distributed.distributed_c10d"


def test_an_exchange_that_changes_a_ranks_model_shard_is_refused():
    from deadpool_ext.integrations.megatron.layout import Layout, dp_exchange_refusal
    from deadpool_ext.rebuild import regroup

    # PP2 x DP2, two ranks per node: node0 holds pipeline stage 0 (ranks 0, 1), node1 stage 1 (ranks 2, 3)
    pp = Layout(world_size=4, tp=1, pp=2)
    why = dp_exchange_refusal(regroup.node_permutation([2, 3], [0, 1]), pp)
    assert why == "rank 0 is at tensor/pipeline coordinates (0, 0), rank 2 at (0, 1): another model shard"
    overlap = "the ranks it built for [2, 3] and the ones it takes [3, 4] overlap"
    assert regroup.node_permutation([2, 3], [3, 4]) == overlap
    assert regroup.node_permutation([2], [0, 1]) == "the node it built for has 1 ranks, the one it takes 2"
