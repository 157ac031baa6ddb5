"""rebuild/swap.py's swappable groups as a GPU job builds them, without a GPU: torch's ``cpu:gloo,cuda:nccl``
pattern. The gloo half is real, the NCCL half a stand-in that refuses host tensors as NCCL does; the groups, the
dispatch, the detach and the swap are the real ones.

- host-tensor collectives on the default group (object collectives, barrier, all-reduce of a CPU tensor) reach
  gloo, device tensors reach the device backend ("meta" tensors stand in for CUDA ones: any non-host device);
- a hot-swap rebuilds both halves;
- a CPU-only job keeps a single gloo inner group (unchanged).

The stand-in's methods are checked against torch's ProcessGroup in tests/unit/test_cuda_paths_signatures.py.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.rebuild import swap

# -- the swappable backend: gloo for host tensors, the device backend for device tensors ---------------------------


class FakeNccl:
    """An NCCL-like backend: refuses host tensors as NCCL does, records what it ran (it cannot run anything here)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.calls: list[str] = []
        self.aborted = False

    def abort(self):
        self.aborted = True

    def _run(self, name: str, tensors: list[Any]) -> Any:
        for t in tensors:
            if t.device.type == "cpu":
                raise RuntimeError("ProcessGroupNCCL: Tensors must be CUDA and dense")
        self.calls.append(name)
        return swap._Solo._done()

    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", list(tensors))

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._run("allgather", [t for outs in output_tensors for t in outs] + list(input_tensors))

    def barrier(self, opts=None):
        return self._run("barrier", [torch.empty(1)] if getattr(opts, "device", None) in (None, torch.device("cpu"))
                         else [])


@pytest.fixture
def gpu_like_world(monkeypatch):
    """A one-rank world whose swappable groups are built as on a GPU machine (kind "nccl"), the NCCL backend
    being the stand-in and the gloo one real."""
    made: list[FakeNccl] = []
    real = swap.build_backend

    def build_backend(kind, store, rank, size, timeout):
        if kind == "nccl":
            made.append(FakeNccl(rank, size))
            return made[-1]
        return real(kind, store, rank, size, timeout)

    monkeypatch.setattr(swap, "build_backend", build_backend)
    monkeypatch.setattr(swap, "default_inner", lambda: "nccl")
    if dist.is_initialized():
        dist.destroy_process_group()
    swap.use()
    swap.set_mode("live")
    dist.init_process_group(swap.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield made
    finally:
        dist.destroy_process_group()


def test_host_tensor_collectives_reach_gloo_beside_the_device_backend(gpu_like_world):
    made = gpu_like_world
    world = dist.distributed_c10d._get_default_group()
    assert isinstance(world, swap.SwappableGroup) and isinstance(world.inner, swap.DeviceSplit)
    assert world.kind == "nccl" and world.inner.device is made[0]
    # what torch and frameworks issue on the default group with host tensors: all of it on gloo
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    dist.barrier()
    objs: list[Any] = [None]
    dist.all_gather_object(objs, {"step": 7})
    assert objs == [{"step": 7}]
    box = [{"ranks": [0]}]
    dist.broadcast_object_list(box, src=0)
    assert box == [{"ranks": [0]}]
    assert made[0].calls == []
    # device tensors go to the device backend ("meta" stands in for "cuda": any non-host device)
    dev = torch.empty(2, device="meta")
    world.allreduce([dev], dist.AllreduceOptions())
    world.allgather([[torch.empty(2, device="meta")]], [dev], dist.distributed_c10d.AllgatherOptions())
    opts = dist.BarrierOptions()
    opts.device = torch.device("meta")
    world.barrier(opts)
    assert made[0].calls == ["allreduce", "allgather", "barrier"]
    # the side group stays gloo only
    side = dist.new_group(backend=swap.side_backend())
    assert side.kind == "gloo" and not isinstance(side.inner, swap.DeviceSplit)


def test_a_hot_swap_rebuilds_both_halves(gpu_like_world):
    made = gpu_like_world
    world = dist.distributed_c10d._get_default_group()
    assert swap.detach("test") >= 1
    with pytest.raises(swap.GroupDetached):
        dist.barrier()
    swap.go_live(dist.HashStore(), 1, 0)
    assert isinstance(world.inner, swap.DeviceSplit) and world.inner.device is made[-1] and len(made) >= 2
    t = torch.full((2,), 2.0)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
    world.allreduce([torch.empty(1, device="meta")], dist.AllreduceOptions())
    assert made[-1].calls == ["allreduce"]


def test_the_launchers_notice_aborts_the_nccl_halves_of_the_dead_generation(gpu_like_world):
    from deadpool_ext.rebuild import worker

    made = gpu_like_world
    side = dist.new_group(backend=swap.side_backend())  # gloo only: nothing to abort
    assert not isinstance(side.inner, swap.DeviceSplit)
    worker._abort_nccl_groups("test")  # the heartbeat thread's call at the notice: the backend is "deadpool"
    assert made and all(f.aborted for f in made)
    t = torch.ones(1)
    dist.all_reduce(t)  # the gloo half is untouched until detach parks it
    assert t.tolist() == [1.0]


def test_a_cpu_only_job_keeps_one_gloo_group():
    assert swap.default_inner() == "gloo"  # no CUDA here
    store = dist.HashStore()
    inner = swap.build_inner("gloo", store, 0, 1, timedelta(seconds=10))
    assert isinstance(inner, dist.ProcessGroup) and not isinstance(inner, swap.DeviceSplit)
    g = swap.SwappableGroup(0, 1, inner, "gloo", timedelta(seconds=10))
    assert g._inner_for("allreduce", ([torch.ones(1)],), {}) is inner


def test_device_of_finds_tensors_in_nested_arguments_and_devices_in_options():
    cpu, meta = torch.ones(1), torch.empty(1, device="meta")
    assert swap._device_of([[[meta]], [cpu]]) == torch.device("meta")
    assert swap._device_of([[], [cpu]]) == torch.device("cpu")
    opts = dist.BarrierOptions()
    assert swap._device_of([opts]) is None  # no device named: host
    opts.device = torch.device("meta")
    assert swap._device_of([opts]) == torch.device("meta")
    assert swap._device_of([torch.device("meta")]) == torch.device("meta")  # _start_coalescing(device)
    split = swap.DeviceSplit(cpu="gloo", device="nccl")
    assert split.pick("monitored_barrier", (), {}) == "gloo"  # gloo's alone
    assert split.pick("_start_coalescing", (torch.device("meta"),), {}) == "nccl"
    assert split.pick("barrier", (), {}) == "gloo"
