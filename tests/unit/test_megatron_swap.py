"""Megatron-Core's parallel state on swappable groups, without processes (issue 44, part 3): a spare built solo for
rank 2 of a TP2 x DP2 world builds every group Megatron makes, its gloo twins swappable too, at the coordinates
rank 2 has; and it says in one line why it takes no other node's ranks in place."""
import contextlib

import pytest
import torch.distributed as dist

from deadpool_ext.rebuild import swap

pytest.importorskip("megatron.core")


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
    from deadpool_ext.integrations.megatron.runtime import NO_RELABEL

    parallel.apply_cpu_shims()
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
        # Megatron's groups are subgroups of the world: another node's ranks are not taken in place
        assert "process group(s) were made without this rank" in (swap.relabel_refusal(4) or "")
        assert NO_RELABEL.startswith("Megatron-Core's parallel state")


def test_gloo_twins_stay_plain_gloo_without_the_swap():
    """A job whose groups are not swappable (``hot_swap.in_place: false``) gets Megatron's groups unchanged."""
    from megatron.core import parallel_state as ps

    from deadpool_ext.integrations.megatron import parallel
    from deadpool_ext.integrations.megatron.layout import Layout

    parallel.apply_cpu_shims()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel.initialize(Layout(world_size=1, tp=1, pp=1), seed=1234)
        assert not isinstance(ps.get_data_parallel_group_gloo(), swap.SwappableGroup)
    finally:
        parallel.destroy()
        dist.destroy_process_group()
