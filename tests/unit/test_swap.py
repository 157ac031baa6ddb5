"""rebuild/swap.py without processes: the solo collectives (a spare's local engine build), the solo store that
lets torch's rendezvous barriers pass, and a one-rank world whose communicator is swapped in place."""
import contextlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.rebuild import swap
from deadpool_ext.rebuild.context import context


def test_solo_collectives_are_those_of_ranks_that_all_contributed_the_same():
    solo = swap._Solo(rank=1, size=4)
    t = torch.tensor([1.0, 2.0])
    solo.allreduce([t], dist.AllreduceOptions())  # default op SUM
    assert t.tolist() == [4.0, 8.0]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    t = torch.tensor([3.0])
    solo.allreduce([t], opts)
    assert t.tolist() == [3.0]
    out = torch.zeros(8)
    solo.all_gather_single(out, torch.tensor([5.0, 6.0]))
    assert out.tolist() == [5.0, 6.0] * 4
    outs = [torch.zeros(2) for _ in range(4)]
    solo.allgather([outs], [torch.tensor([7.0, 8.0])])
    assert all(o.tolist() == [7.0, 8.0] for o in outs)
    got = torch.zeros(2)
    solo.reduce_scatter_single(got, torch.arange(8.0))  # this rank's chunk, summed over 4 equal ranks
    assert got.tolist() == [8.0, 12.0]
    b = torch.tensor([9.0])
    solo.broadcast([b], dist.BroadcastOptions())
    assert b.tolist() == [9.0]
    assert solo.barrier().is_completed()
    with pytest.raises(swap.SwapError, match="recv_anysource cannot be computed locally"):
        solo.recv_anysource([b], 0)


def test_solo_point_to_point_is_the_pipeline_engines_warm_up():
    """DeepSpeed's ``PipelineEngine.__init__`` sends its neighbour stage the scalar 0.0 and receives one into a
    buffer holding 0.0: solo, the send is dropped and the receive keeps what the rank holds (the peer sent the same),
    so a pipeline spare builds its engine ahead instead of dying at start-up (issue 43, part 5)."""
    solo = swap._Solo(rank=1, size=2)
    loss = torch.tensor(0.0)
    assert solo.send([loss], 0, 0).is_completed()
    assert solo.recv([loss], 0, 0).is_completed()
    assert loss.item() == 0.0


def test_solo_store_counts_every_rank_so_torchs_barrier_passes_locally():
    store = swap.SoloStore(3)
    assert store.add("k", 1) == 3 and store.add("k", 0) == 3
    # torch's own rendezvous barrier of new_group / init_process_group, which would wait for 3 workers
    dist.distributed_c10d._store_based_barrier(0, store, "g", 3, timedelta(seconds=5))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["b"])
    with pytest.raises(RuntimeError, match="never set"):
        store.wait(["b"])


def test_mode_rejects_unknown_names():
    with pytest.raises(ValueError, match="'live' or 'solo'"):
        swap.set_mode("dead")


@contextlib.contextmanager
def _own_world():
    """A process-group registry of the test's own: a default group another test of this process left behind is
    destroyed first (torch keeps one registry per process), and the test's is destroyed afterwards."""
    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        swap.set_mode("live")


@pytest.fixture
def one_rank_world():
    with _own_world():
        swap.use()
        swap.set_mode("live")
        dist.init_process_group(swap.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
        yield


def test_groups_are_swapped_in_place_and_refuse_work_while_detached(one_rank_world):
    world = dist.distributed_c10d._get_default_group()
    side = dist.new_group(backend=swap.side_backend())
    sub = dist.new_group()
    assert swap.active() and isinstance(side, swap.SwappableGroup) and isinstance(sub, swap.SwappableGroup)
    assert side.kind == "gloo" and dist.get_backend() == swap.BACKEND
    assert [name for name, _ in swap.describe()] == [world.group_name, side.group_name, sub.group_name]
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    before = world.inner
    graveyard = context().graveyard
    graveyard.take_buried()
    assert swap.detach("test") == 3
    assert len(graveyard.buried) == 3 and graveyard.buried[0] is before  # the context's one graveyard holds them
    with pytest.raises(swap.GroupDetached, match="generation ended"):
        dist.all_reduce(t)
    with pytest.raises(swap.GroupDetached):
        dist.all_reduce(t, group=side)
    checked = []
    store = dist.HashStore()
    assert swap.go_live(store, 1, 0, check=lambda: checked.append(swap.groups()[0].generation)) == 3
    assert checked == [1]  # the check runs once the default group is live, before the others
    assert graveyard.buried == []  # the dead generation's communicators reaped once the new ones are built
    assert world is dist.distributed_c10d._get_default_group() and world.inner is not before
    assert dist.distributed_c10d._world.pg_map[world][1] is store
    out = torch.zeros(2)
    dist.all_gather_single(out, torch.tensor([3.0, 4.0]), group=sub)
    assert out.tolist() == [3.0, 4.0]
    with pytest.raises(swap.SwapError, match="rank changed"):
        swap.go_live(store, 2, 1)


def test_solo_world_builds_groups_and_answers_locally():
    with _own_world():
        swap.use()
        swap.set_mode("solo")
        dist.init_process_group(swap.BACKEND, store=swap.SoloStore(4), rank=2, world_size=4)
        sub = dist.new_group()  # torch's rendezvous barrier on the solo store passes without the other 3
        t = torch.ones(1)
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [4.0] and dist.get_world_size() == 4 and dist.get_rank() == 2


def test_a_solo_world_relabelled_answers_the_new_rank_everywhere_and_a_partial_subgroup_blocks_it():
    """Issue 44: a spare built solo as rank 1 of 3 takes rank 0: every group (the default and a whole-world
    subgroup) answers 0, and the swap to the generation's communicators accepts it. A group made without this rank
    (a model- or pipeline-parallel subgroup) blocks the relabel, named in one line."""
    with _own_world():
        swap.use()
        swap.set_mode("solo")
        dist.init_process_group(swap.BACKEND, store=swap.SoloStore(3), rank=1, world_size=3)
        sub = dist.new_group()
        assert swap.relabel_refusal(3) is None
        assert swap.relabel(0) == 2
        assert dist.get_rank() == 0 and dist.get_rank(group=sub) == 0 and dist.get_world_size() == 3
        out = torch.zeros(3)
        dist.all_gather_single(out, torch.tensor([5.0]), group=sub)  # solo: every rank sent what this one holds
        assert out.tolist() == [5.0, 5.0, 5.0]
        dist.new_group(ranks=[1, 2])  # without this process (now rank 0)
        assert "1 process group(s) were made without this rank" in swap.relabel_refusal(3)
    with _own_world():
        swap.use()
        swap.set_mode("solo")
        dist.init_process_group(swap.BACKEND, store=swap.SoloStore(4), rank=1, world_size=4)
        dist.new_group(ranks=[0, 1])
        assert "spans ranks [0, 1], not the whole world" in swap.relabel_refusal(4)


def test_torch_outside_the_supported_range_is_named(monkeypatch):
    assert swap.unsupported() is None  # the pinned torch
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert "torch 2.99.0 (the in-place swap supports torch >=2.4,<2.14)" == swap.unsupported()
