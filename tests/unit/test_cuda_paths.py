"""The snapshot's CUDA-only paths, tested without a GPU: stand-ins for the CUDA calls (the runtime's
cudaHostRegister / cudaHostUnregister, torch.cuda's Stream / Event / stream), the real code around them
(memory/pinned.py, a real SnapshotManager in a gloo world of one, real shared memory).

What each test pins down:
- every pinned slot is unregistered before it is unmapped, on every path that gives one up (resize, rewire at a
  hot-swap, an abandoned restore, close), and only pinned ones are;
- a snapshot's copy is reported done ("copied", which lets the next optimizer step overwrite the sources) only
  once the side stream's event after the copies has completed, never when they were enqueued.

The process-group side (gloo beside NCCL) is tests/unit/test_cuda_paths_swap.py.

The stand-ins are checked against torch's real signatures in tests/unit/test_cuda_paths_signatures.py.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import pytest

from deadpool_ext.cluster.topology import NodePlacement
from deadpool_ext.memory import pinned
from deadpool_ext.memory.shm import ShmSegment
from deadpool_ext.snapshot import manager as mgr
from deadpool_ext.testing.memory_job import Adapter, manager, world_of_one

# -- stand-ins ---------------------------------------------------------------------------------------------------


class FakeCudart:
    """``torch.cuda.cudart()``: register / unregister, with the errors the runtime gives for a double register
    (712, cudaErrorHostMemoryAlreadyRegistered) and an unknown address (713, cudaErrorHostMemoryNotRegistered).
    Every call goes into ``log``, shared with the unmap spy."""

    def __init__(self, log: list[tuple[Any, ...]], fail: bool = False) -> None:
        self.log = log
        self.fail = fail
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        self.log.append(("register", ptr, size, flags))
        if self.fail:
            return 1  # cudaErrorInvalidValue
        if ptr in self.registered:
            return 712
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.log.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713


class FakeEvent:
    """``torch.cuda.Event``: ``synchronize`` blocks until the test completes it (the copies it follows are still
    running on the device until then)."""

    made: list[FakeEvent] = []
    auto_complete = False
    """True: every event completes as soon as it is waited for (tests that are not about the wait)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False) -> None:
        self.blocking = blocking
        self.stream: Any = "unrecorded"
        self.completed = threading.Event()
        self.waiting = threading.Event()
        FakeEvent.made.append(self)

    def record(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else "current"

    def query(self) -> bool:
        return self.completed.is_set()

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.stream != "unrecorded" and end_event.completed.is_set()
        return 2.5  # milliseconds, as torch's

    def synchronize(self) -> None:
        self.waiting.set()
        if FakeEvent.auto_complete:
            self.completed.set()
        assert self.completed.wait(30), "the test never completed the event"


class FakeStream:
    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.waited: list[FakeEvent] = []
        self.synchronized = 0

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeCuda:
    """The parts of ``torch.cuda`` that memory/pinned.py's SideStream uses."""

    Stream = FakeStream
    Event = FakeEvent

    def __init__(self) -> None:
        self.current: list[Any] = []

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Any:
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()


@pytest.fixture
def unmaps(monkeypatch):
    """Every ShmSegment unmap, in one log with the runtime's calls: ("unmap", address of its first byte)."""
    log: list[tuple[Any, ...]] = []
    real = ShmSegment.close

    def spy(self: ShmSegment) -> None:
        if not self.closed:
            t = self.tensor()
            log.append(("unmap", int(t.data_ptr())))
            del t
        real(self)

    monkeypatch.setattr(ShmSegment, "close", spy)
    return log


def _check_unregistered_before_unmap(log: list[tuple[Any, ...]]) -> None:
    """Every unmapped address that was registered was unregistered before, and never used after."""
    live: set[int] = set()
    for entry in log:
        if entry[0] == "register":
            live.add(entry[1])
        elif entry[0] == "unregister":
            live.discard(entry[1])
        elif entry[0] == "unmap":
            assert entry[1] not in live, f"address {entry[1]:#x} unmapped while still registered: {log}"


# -- HostPinner --------------------------------------------------------------------------------------------------


def test_pinner_unregisters_after_draining_and_before_unmapping(tmp_path, unmaps):
    rt = FakeCudart(unmaps)
    drained: list[int] = []
    p = pinned.HostPinner(rt, drain=lambda: (drained.append(len(unmaps)), unmaps.append(("drain",)))[0])
    a = ShmSegment.create("a", 1 << 16, root=str(tmp_path))
    b = ShmSegment.create("b", 1 << 16, root=str(tmp_path))
    assert p.pin(a) and p.pin(b) and p.pin(a)  # idempotent: registered once
    assert [e[0] for e in unmaps] == ["register", "register"] and len(p) == 2
    assert unmaps[0][2:] == (1 << 16, pinned.REGISTER_DEFAULT)
    p.close(a)
    assert [e[0] for e in unmaps[2:]] == ["drain", "unregister", "unmap"] and a.closed
    assert p.release_all() == 1 and not rt.registered and not b.closed  # b stays mapped, as ordinary memory
    assert unmaps[-1][0] == "unregister"
    p.close(b)  # no longer pinned: unmapped without another unregister
    assert unmaps[-1][0] == "unmap" and sum(1 for e in unmaps if e[0] == "unregister") == 2
    _check_unregistered_before_unmap(unmaps)


def test_pinner_refused_register_is_recorded_and_never_unregistered(tmp_path, unmaps):
    p = pinned.HostPinner(FakeCudart(unmaps, fail=True))
    seg = ShmSegment.create("s", 1 << 16, root=str(tmp_path))
    assert not p.pin(seg)
    assert p.refused == {"s": 1} and not p.is_pinned(seg)  # error 1: the copies use pageable memory
    p.close(seg)
    assert [e[0] for e in unmaps] == ["register", "unmap"]


def test_pinner_without_cuda_touches_nothing(tmp_path):
    assert pinned.cuda_runtime() is None  # this machine: no CUDA
    p = pinned.HostPinner(None)
    seg = ShmSegment.create("s", 1 << 16, root=str(tmp_path))
    assert not p.enabled and not p.pin(seg) and p.release_all() == 0
    p.close(seg)
    assert seg.closed


# -- SideStream --------------------------------------------------------------------------------------------------


def test_side_stream_copy_returns_only_after_its_event_completed():
    cuda = FakeCuda()
    side = pinned.SideStream(cuda)
    FakeEvent.made.clear()
    ready = side.ready()
    assert ready.stream == "current"  # recorded on the compute stream, by the training thread
    enqueued: list[Any] = []
    finished = threading.Event()

    def worker() -> None:
        side.copy(ready, lambda s: enqueued.append((s, list(cuda.current))))
        finished.set()

    t = threading.Thread(target=worker)
    t.start()
    done = FakeEvent.made[-1] if len(FakeEvent.made) > 1 else None
    for _ in range(300):
        if len(FakeEvent.made) > 1 and FakeEvent.made[-1].waiting.is_set():
            done = FakeEvent.made[-1]
            break
        threading.Event().wait(0.01)
    assert done is not None, "the copy never waited for an event"
    assert side.stream.waited == [ready]  # the side stream follows the compute stream's event
    assert enqueued == [(side.stream, [side.stream])]  # copies issued on the side stream
    assert done.stream is side.stream and done.blocking  # recorded after them, on the side stream; a sleeping wait
    assert not finished.wait(0.2), "returned while the copies were still running on the device"
    done.completed.set()
    assert finished.wait(10)
    t.join(10)
    assert side.stream.synchronized == 0  # never a whole-stream (or device) synchronize on this path
    assert side.copy_s == [0.0025]  # the copy's own time on the device, from the events around it


# -- the snapshot manager on the CUDA path ------------------------------------------------------------------------


@pytest.fixture
def cuda_manager(tmp_path, monkeypatch, unmaps):
    """A real SnapshotManager (gloo world of one, real shared memory) on the CUDA path: the runtime, streams and
    events are the stand-ins, and its snapshot counts as one in device memory."""
    rt = FakeCudart(unmaps)
    cuda = FakeCuda()
    monkeypatch.setattr(mgr, "cuda_runtime", lambda: rt)
    monkeypatch.setattr(mgr.SideStream, "create", classmethod(lambda cls: cls(cuda)))
    monkeypatch.setattr(mgr, "_on_device", lambda tensors: True)
    FakeEvent.made.clear()
    monkeypatch.setattr(FakeEvent, "auto_complete", False)
    with world_of_one():
        a = Adapter()
        m = manager(str(tmp_path), a)
        yield m, a, rt, unmaps
        m.close()


def _step(m: mgr.SnapshotManager, a: Adapter, step: int) -> None:
    m.before_optimizer_step()
    a.w.fill_(step)
    a.steps = step
    m.after_step()


def _complete_copy_events() -> None:
    for ev in FakeEvent.made:
        if ev.blocking:
            ev.completed.set()


def test_copied_is_reported_only_after_the_side_streams_event(cuda_manager):
    m, a, rt, _ = cuda_manager
    _step(m, a, 1)
    job = m.writer.inflight
    assert job is not None and isinstance(job.event, FakeEvent) and job.event.stream == "current"
    for _ in range(500):  # the worker reaches the wait for the copies' event
        if any(ev.blocking and ev.waiting.is_set() for ev in FakeEvent.made):
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("the worker never waited for the side stream's event")
    assert not job.copied.wait(0.3), "copied reported while the copies were still in flight"
    assert m.writer.side is not None and m.writer.side.stream.waited == [job.event]
    _complete_copy_events()
    assert job.copied.wait(10) and job.done.wait(10)
    m.wait_idle()
    assert m.committed_version == 1 and len(rt.registered) == 2  # both slots page-locked at the first snapshot


def test_every_pinned_slot_is_unregistered_before_unmap_on_every_path(cuda_manager, tmp_path):
    m, a, rt, log = cuda_manager
    FakeEvent.auto_complete = True  # (the fixture's monkeypatch restores it)
    _step(m, a, 1)
    m.wait_idle()
    slots = [s for s in m.store.slots if s is not None]
    assert len(slots) == 2 and all(m.store.pinner.is_pinned(s) for s in slots) and len(rt.registered) == 2
    # resize: the state changed size at a restore -> new slots, the old ones unregistered first
    m.store.open_slots(slots[0].nbytes + 4096)
    assert all(s.closed for s in slots) and len(rt.registered) == 2
    _check_unregistered_before_unmap(log)
    # an abandoned restore closes the slots it opened
    m.store.header_reserved = 0
    m.store.close_unused()
    assert m.store.slots == [None, None] and not rt.registered
    _check_unregistered_before_unmap(log)
    # rewire at an in-place hot-swap: slots of the first snapshot after it, then given up
    _step(m, a, 2)
    m.wait_idle()
    assert len(rt.registered) == 2
    m.rewire(NodePlacement(job_id="sec", node="n0", first_on_node=False, shm_root=str(tmp_path),
                           launcher_pid=os.getpid()))
    assert not rt.registered
    _check_unregistered_before_unmap(log)
    _step(m, a, 3)
    m.wait_idle()
    assert len(rt.registered) == 2
    m.close()  # close: everything still pinned is unregistered (the slots stay readable)
    assert not rt.registered and all(s is not None and not s.closed for s in m.store.slots)
    _check_unregistered_before_unmap(log)
    assert not [e for e in log if e[0] == "unregister" and e[1] not in {r[1] for r in log if r[0] == "register"}]
