"""Device-to-host snapshot copies: page-locked ("pinned") shared-memory segments and the side stream that copies.

A copy from the GPU into pageable memory is synchronous and staged through a driver bounce buffer; into
page-locked memory it is a DMA the copy engine runs while the GPU computes. The snapshot slots are shared-memory
mappings made elsewhere (:mod:`.shm`), so they are page-locked in place with ``cudaHostRegister``. The driver keeps
that registration until ``cudaHostUnregister`` of the same address: unmapping a registered range first leaves the
driver holding pages that are gone (undefined behaviour, and a later mapping at the same address cannot be
registered). So a pinned segment is only ever given up through :meth:`HostPinner.close`.

Call order (one pinner per process, owned by the snapshot manager):

1. ``pin(seg)`` once the segment is created and touched (every slot and ring entry);
2. ``close(seg)`` wherever a pinned segment is given up (resized, rewired at a hot-swap, an abandoned restore):
   waits for copies still in flight on the side stream (``drain``), unregisters, then unmaps;
3. ``release_all()`` when the owner closes: unregisters what is still pinned; the segments stay mapped for
   whatever still reads them, now as ordinary memory.

Without CUDA every call is a no-op (``enabled`` is False): the CPU path never touches the CUDA runtime. The runtime
is passed in (``cudart``), which is how tests check the order of calls without a GPU.

:class:`SideStream` is the copy itself: the side stream waits for an event the training thread records on the
compute stream after the optimizer step, the copies are enqueued on the side stream, and the copy is reported
done only once an event recorded on the side stream *after* them has completed: enqueued is not copied, and the
next optimizer step overwrites the source tensors. Only that event is waited for, never the whole device.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .shm import ShmSegment

log = logging.getLogger("deadpool_ext")

COPY_TIMES_KEPT = 50_000
"""Per-copy device times kept by :class:`SideStream` (as the manager's own timing lists: bounded for long jobs)."""

REGISTER_DEFAULT = 0
"""``cudaHostRegisterDefault``: page-locked for the device of the calling context (one GPU per rank)."""


def cuda_runtime() -> Any:
    """torch's CUDA runtime module (``cudaHostRegister`` / ``cudaHostUnregister``), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


class HostPinner:
    """Registers segments with the CUDA runtime and unregisters each one before it is unmapped."""

    def __init__(self, cudart: Any = None, drain: Callable[[], None] | None = None) -> None:
        self.cudart = cudart
        self.drain = drain
        """Waits for every copy enqueued into pinned memory (the side stream's synchronize): the DMA must be over
        before its target stops being page-locked."""
        self._pinned: dict[int, tuple[ShmSegment, int, int]] = {}  # id(seg) -> (seg, address, bytes)
        self.refused: dict[str, int] = {}
        """Segments the runtime refused to page-lock (name -> cudaHostRegister's error): pageable memory."""
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.cudart is not None

    def __len__(self) -> int:
        return len(self._pinned)

    def is_pinned(self, seg: ShmSegment) -> bool:
        return id(seg) in self._pinned

    def pinned_nbytes(self) -> int:
        return sum(n for _, _, n in self._pinned.values())

    def pin(self, seg: ShmSegment) -> bool:
        """Page-lock ``seg`` (idempotent). False without CUDA or when the runtime refuses (logged: the copies then
        fall back to pageable memory, correct but synchronous)."""
        if not self.enabled or seg.closed:
            return False
        with self._lock:
            if id(seg) in self._pinned:
                return True
            t = seg.tensor()
            ptr, nbytes = int(t.data_ptr()), int(t.numel())
            del t  # a live view would keep the mapping from being unmapped at close
            rc = int(self.cudart.cudaHostRegister(ptr, nbytes, REGISTER_DEFAULT))
            if rc != 0:
                self.refused[seg.name] = rc
                log.warning("cudaHostRegister of %s failed (error %s): snapshot copies fall back to pageable memory",
                            seg.name, rc)
                return False
            self._pinned[id(seg)] = (seg, ptr, nbytes)
            return True

    def unpin(self, seg: ShmSegment) -> None:
        """Unregister ``seg`` if it is pinned, after the side stream has drained; the mapping stays."""
        with self._lock:
            entry = self._pinned.pop(id(seg), None)
        if entry is not None:
            self._unregister([entry])

    def close(self, seg: ShmSegment) -> None:
        """Give up ``seg``: unregister (if pinned), then unmap. Use this, never ``seg.close()``, on a pinned one."""
        self.unpin(seg)
        seg.close()

    def release_all(self) -> int:
        """Unregister every segment still pinned (the owner closes); returns how many. Mappings stay."""
        with self._lock:
            entries = list(self._pinned.values())
            self._pinned.clear()
        self._unregister(entries)
        return len(entries)

    def _unregister(self, entries: list[tuple[ShmSegment, int, int]]) -> None:
        if not entries:
            return
        if self.drain is not None:
            self.drain()
        for seg, ptr, _ in entries:
            rc = int(self.cudart.cudaHostUnregister(ptr))
            if rc != 0:  # nothing to undo: the range is unmapped next either way; say so once per segment
                log.warning("cudaHostUnregister of %s failed (error %s)", seg.name, rc)


class SideStream:
    """A CUDA stream for snapshot copies, ordered after the compute stream by events (``cuda``: ``torch.cuda``,
    or a stand-in with its ``Stream``, ``Event`` and ``stream`` in tests).

    Call order: ``ready()`` on the training thread right after the optimizer step (the version to copy is
    complete on the compute stream); ``copy(ready_event, enqueue)`` on the worker thread; ``synchronize()`` before
    the copies' target memory is unregistered (:class:`HostPinner`'s ``drain``)."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.stream = cuda.Stream()
        self.copy_s: list[float] = []
        """Each copy's time on the device (events around it on the side stream): the D2H bandwidth a benchmark
        reports, without the wait for the step's own kernels. The newest ``COPY_TIMES_KEPT`` at most."""

    @classmethod
    def create(cls) -> SideStream | None:
        """A side stream on the current device, or None without CUDA."""
        import torch

        return cls(torch.cuda) if torch.cuda.is_available() else None

    def ready(self) -> Any:
        """Training thread: an event on the current (compute) stream after the work that produced the version."""
        event = self.cuda.Event()
        event.record()
        return event

    def copy(self, ready: Any, enqueue: Callable[[Any], None]) -> None:
        """Worker thread: the side stream waits for ``ready`` (on the device, the host does not block), ``enqueue``
        issues the copies on it, and this returns once an event recorded after them has completed. The event is
        a blocking one: the worker thread sleeps in the wait instead of spinning a core the training thread needs
        to launch kernels."""
        self.stream.wait_event(ready)
        begin = self.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        with self.cuda.stream(self.stream):
            enqueue(self.stream)
        done = self.cuda.Event(enable_timing=True, blocking=True)
        done.record(self.stream)
        done.synchronize()
        self.copy_s.append(begin.elapsed_time(done) / 1e3)
        if len(self.copy_s) > 2 * COPY_TIMES_KEPT:
            del self.copy_s[:-COPY_TIMES_KEPT]

    def synchronize(self) -> None:
        self.stream.synchronize()
