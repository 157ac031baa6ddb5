"""The snapshot writer: one background thread per rank that turns a prepared snapshot into a committed version.

Input: a :class:`Job` (a :class:`~.slots.PreparedSnapshot` of live tensors, the tier-1 segment to write, and on a
GPU the compute stream's event the copy must follow). Output: a sealed slot (or ring entry) of the
:class:`~.tier1.TierOneStore`, its replicas on the holders (:mod:`deadpool_ext.replicate`), and the version every
rank agreed on (:attr:`SnapshotWriter.committed_version`, an all-reduce MIN on the side group).

Call order (the manager; the training thread unless said otherwise):

1. :meth:`SnapshotWriter.start` for each world (construction, and after an in-place hot-swap);
2. per snapshot :meth:`submit`; the training thread waits for ``job.copied`` before the next optimizer step
   (only the copy reads the live tensors); the writer thread then seals, replicates and commits
   (``snapshot.background: false``: all of it inline, in :meth:`submit`);
3. :meth:`quiesce` (stop taking jobs), :meth:`stop` (an in-place hot-swap: bump the epoch, join or abandon the
   thread), :meth:`close`.

Epochs: :meth:`stop` bumps the epoch; a thread of an older epoch (abandoned, still blocked in a transfer on the dead
generation's communicator) touches nothing of the writer when it wakes: no state, no commit, no error.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..memory.pinned import SideStream
from ..rebuild.cause import lost_peer_text
from ..recovery.timeline import write_event
from ..replicate.peer import PeerReplicator
from .differential import DiffRing
from .late import LATE_KEY, LateDropped, LateState, LateStep
from .priority import WorkerPriority
from .slots import PreparedSnapshot, SlotWriter
from .stats import SnapshotStats
from .tier1 import TierOneStore

log = logging.getLogger("deadpool_ext")


SNAPSHOT_EVENT_EVERY_S = 5.0
"""Shortest time between two ``snapshot`` timeline events of a rank (one JSON line each)."""


class SnapshotWorkerError(RuntimeError):
    pass


class Job:
    __slots__ = ("snap", "slot", "copied", "done", "event", "kind", "late")

    def __init__(self, snap: PreparedSnapshot, slot: int, event: Any, kind: str = "base") -> None:
        self.snap, self.slot, self.event, self.kind = snap, slot, event, kind
        self.late: LateStep | None = None
        self.copied = threading.Event()
        self.done = threading.Event()


REPLICATING = "replication to peers"
"""The worker's phase while it exchanges replicas (a hot-swap may abandon it in this phase and the next)."""
COMMITTING = "global commit (all-reduce on the side group)"
"""The worker's phase in the all-reduce that agrees on the committed version (abandonable: see ``stop``)."""
_ABANDONABLE = (REPLICATING, COMMITTING)


def cut_short(phase: str, error: str, generation_ended: bool) -> bool:
    """Whether a snapshot that failed in ``phase`` with ``error`` was cut short by a lost peer (pure): it failed
    while it exchanged with other ranks (the replica transfer or the global commit), because a peer's connection
    reset or closed, or because the launcher had already ended the generation. Such a snapshot is the failure the
    tiers protect against, not an error of the snapshot: its version is simply never committed."""
    return phase in _ABANDONABLE and (generation_ended or lost_peer_text(error))


def generation_ended() -> bool:
    """The launcher's notice of this generation's end arrived and is not acted on yet (deadpool-run only)."""
    from ..rebuild.context import context

    return context().interrupts.requested is not None

ABANDON_AFTER_S = 0.5
"""How long a hot-swap waits for a snapshot worker that is in a replica transfer before abandoning it: after the
dead generation's sockets are cut, a transfer that can fail does so within milliseconds; one still blocked is on
a receive gloo does not fail (a peer that died), which would only end at the group's timeout, so every second
waited here is the recovery's (2 s before: the whole of a five-swap run's slowest swap). Abandoning is as safe
early as late (the epoch is past, the transport closed); the wait only lets a worker that fails fast end cleanly."""


class SnapshotWriter:
    def __init__(self, *, rank: int, store: TierOneStore, group: Any, side: SideStream | None,
                 stats: SnapshotStats, chunk_bytes: int, background: bool, timeout_s: float,
                 late: Callable[[], LateState | None]) -> None:
        self.rank, self.store, self.group, self.side, self.stats = rank, store, group, side, stats
        self.chunk_bytes, self.background, self.timeout_s, self._late = chunk_bytes, background, timeout_s, late
        self.thread: threading.Thread | None = None
        self.epoch = 0
        """Bumped when the worker is stopped for a hot-swap: a worker of an older epoch touches nothing here."""
        self._epoch_lock = threading.Lock()
        self.phase = "idle"
        """What the worker is doing (for the error that says where it is stuck)."""
        self._told_at = -SNAPSHOT_EVENT_EVERY_S  # the first commit is told at once

    def start(self, *, peers: PeerReplicator, dpeers: PeerReplicator | None, ring: DiffRing,
              priority: WorkerPriority) -> None:
        """The writer of a world: its replicators, ring and priority; nothing committed, nothing in flight."""
        self.peers, self.dpeers, self.ring, self.priority = peers, dpeers, ring, priority
        self.committed_base: int | None = None
        self.committed_version: int | None = None
        self.inflight: Job | None = None
        self.error: BaseException | None = None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        if self.background:
            self.thread = threading.Thread(target=self._worker, args=(self.epoch,), name="deadpool-snapshot",
                                           daemon=True)
            self.thread.start()

    def submit(self, job: Job) -> None:
        """Hand a job to the worker thread (or, with ``snapshot.background: false``, run it here)."""
        self.inflight = job
        if self.thread is not None:
            self._queue.put(job)
            return
        try:
            self._run(job, self.epoch)  # in the training thread
        finally:
            job.copied.set()
            job.done.set()  # else the next after_step waits replication.timeout_s for it

    def raise_error(self) -> None:
        if self.error is not None:
            raise SnapshotWorkerError(f"background snapshot worker failed: {self.error}") from self.error

    # -- the thread --------------------------------------------------------------------------------------------
    def _worker(self, epoch: int = 0) -> None:
        got = self.stats.worker_priority = self.priority.lower()
        if self.rank == 0:
            log.info("snapshot worker: CPU priority %s (snapshot.worker_priority: %s)%s", got,
                     self.priority.requested, ", raised to normal while a step waits for its copy"
                     if got in ("idle", "nice19") else "")
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.priority.lower()  # again after a boost (no system call otherwise)
            try:
                self._run(job, epoch)
            except BaseException as exc:  # surfaced on the main thread at the next hook
                if epoch != self.epoch:  # abandoned at a hot-swap: its failure is the dead generation's
                    log.info("abandoned snapshot worker (snapshot of step %d) ended: %s", job.snap.version,
                             " ".join(str(exc).split())[:200])
                    return
                self.error = exc
                phase, self.phase = self.phase, "idle"
                if cut_short(phase, str(exc), generation_ended()):
                    # the failure the snapshots protect against, seen from here first: the step's own collective
                    # fails the same way, and the recovery restores the newest committed version
                    self.stats.cut_short.append(job.snap.version)
                    log.warning("snapshot of step %d cut short: a peer was lost during its %s (%s); the newest "
                                "version committed is %s, and a restore takes the newest version every rank still "
                                "holds", job.snap.version, phase, " ".join(str(exc).split())[:160],
                                self.committed_version)
                else:
                    log.error("snapshot of step %d failed: %s", job.snap.version, exc)
            finally:
                job.copied.set()
                job.done.set()

    def _run(self, job: Job, epoch: int = 0) -> None:
        """Invalidate -> copy -> (the step's late state) -> seal -> replicate -> commit."""
        diff = job.kind == "diff"
        store = self.store
        if diff:
            self.ring.check_reuse(job.snap.version, self.committed_base)  # watermark GC
            seg, reserved = store.ring_entry(job.slot), store.ring_header_reserved
        else:
            seg, reserved = store.slot(job.slot), store.header_reserved
        writer = SlotWriter(seg.tensor(), reserved, self.chunk_bytes)
        self.phase = "copy"
        t0, c0 = time.perf_counter(), time.thread_time()
        writer.invalidate()
        if diff:
            self.ring.versions.pop(job.slot, None)
        elif store.latest is not None and store.latest[1] == job.slot:
            store.latest = None
        if job.event is not None:
            assert self.side is not None  # an event is recorded only with a side stream
            # returns once the side stream's event after the copies has completed: the bytes are in the slot
            self.side.copy(job.event, lambda stream: writer.copy(job.snap, stream))
        else:
            writer.copy(job.snap)
        job.copied.set()  # only now may the next optimizer step overwrite the source tensors
        t1, c1 = time.perf_counter(), time.thread_time()
        late = self._late()
        if job.late is not None and late is not None:
            self.phase = "waiting for the step's late client state"
            try:
                section = late.wait(job.late, lambda: epoch != self.epoch)
            except LateDropped as exc:
                self.stats.unsealed.append(job.snap.version)
                log.info("%s", exc)
                self.phase = "idle"
                return
            if section is not None:
                job.snap.meta[LATE_KEY] = section
        blob_len = writer.seal(job.snap)
        if blob_len != seg.nbytes:
            raise RuntimeError(f"snapshot of step {job.snap.version} is {blob_len} bytes, slot is {seg.nbytes}: "
                               "the rank's state changed size, which in-memory snapshots do not support")
        if diff:
            self.ring.stored(job.snap.version)
        else:
            store.latest = (job.snap.version, job.slot)
        t2, c2 = time.perf_counter(), time.thread_time()
        self.phase = REPLICATING
        if diff:
            assert self.dpeers is not None  # differential mode
            self.dpeers.replicate(seg.tensor(), blob_len, buf=job.slot)
        else:
            self.peers.replicate(seg.tensor(), blob_len)
        t3, c3 = time.perf_counter(), time.thread_time()
        if epoch != self.epoch:
            raise SnapshotWorkerError("replaced at a hot-swap during the replication; no commit")
        self.phase = COMMITTING
        flag = torch.tensor([job.snap.version], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        with self._epoch_lock:  # a worker abandoned in the all-reduce never writes the new generation's versions
            if epoch != self.epoch:
                raise SnapshotWorkerError("replaced at a hot-swap during the global commit; nothing committed")
            self.committed_version = int(flag.item())
            if not diff and self.committed_version == job.snap.version:
                self.committed_base = job.snap.version
        t4, c4 = time.perf_counter(), time.thread_time()
        self.phase = "idle"
        st = self.stats
        if diff:
            st.diffs, st.diff_nbytes = st.diffs + 1, blob_len
        else:
            st.snapshots, st.base_nbytes = st.snapshots + 1, blob_len
        st.checksum_fused = writer.checksums is not None  # hashed in the copy's pass (one read of the bytes)
        for key, value in (("copy_s", t1 - t0), ("seal_s", t2 - t1), ("replicate_s", t3 - t2), ("commit_s", t4 - t3),
                           ("copy_cpu_s", c1 - c0), ("seal_cpu_s", c2 - c1), ("replicate_cpu_s", c3 - c2),
                           ("commit_cpu_s", c4 - c3)):
            st.add_timing(key, value)
        self._tell(job.snap.version, blob_len, t4 - t0)

    def _tell(self, version: int, nbytes: int, lag_s: float) -> None:
        """The ``snapshot`` timeline event, at most every :data:`SNAPSHOT_EVENT_EVERY_S` per rank: what the goodput
        ledger serves as the snapshots' blocking, bytes and commit lag (``recovery/ledger.py``)."""
        now = time.time()
        if now - self._told_at < SNAPSHOT_EVENT_EVERY_S:
            return
        self._told_at = now
        blocking = self.stats.blocking_s
        write_event(event="snapshot", rank=self.rank, version=version, step_at=now - lag_s, nbytes=nbytes,
                    blocking_s=blocking[-1] if blocking else None, commit_lag_s=lag_s,
                    committed=self.committed_version)

    # -- stopping ----------------------------------------------------------------------------------------------
    def quiesce(self, timeout_s: float = 10.0) -> None:
        """Take no more jobs. Waits (bounded) until the in-flight copy is done, so no stale worker writes into a
        slot the next world will use; replication of that version may fail with the dead group, which is expected
        and not raised."""
        job = self.inflight
        if job is not None:
            self.priority.boost()  # waited for: not at idle priority
            job.copied.wait(timeout_s)
            deadline = time.time() + timeout_s
            while self.store.latest is None or self.store.latest[0] != job.snap.version:
                if job.done.is_set() or time.time() > deadline:
                    break
                time.sleep(0.01)
        if self.thread is not None:
            self._queue.put(None)
        self.thread = None

    def stop(self, quiesce: Callable[[], None], timeout_s: float = 30.0) -> None:
        """Bump the epoch, ``quiesce()``, then wait (bounded) until the thread has exited: after an in-place
        hot-swap no stale worker may issue a collective on the side group's new communicator."""
        thread = self.thread
        job = self.inflight
        with self._epoch_lock:
            self.epoch += 1  # from here on the current worker touches nothing of this writer
        quiesce()
        if thread is None:
            return
        t0 = time.monotonic()
        thread.join(min(timeout_s, ABANDON_AFTER_S))
        phase = self.phase
        if thread.is_alive() and phase in _ABANDONABLE:
            # Blocked on the dead generation's communicator: gloo may not fail a receive from a peer that died (it
            # waits for the group's timeout). Its sockets are closed or cut, so nothing more can arrive; the
            # transport is closed (no next message) and the epoch is past (no commit, no state): a commit
            # all-reduce that returns later is dropped under the epoch lock (a host lost mid-commit does this).
            self.peers.transport.closed = True
            if self.dpeers is not None:
                self.dpeers.transport.closed = True
            self.stats.abandoned.append((job.snap.version if job is not None else None, phase))
            log.warning("snapshot worker abandoned after %.1fs: still in the %s of step %s on the dead generation's "
                        "communicator (at %s); it ends when that collective times out and touches nothing of the "
                        "new generation", time.monotonic() - t0, phase,
                        job.snap.version if job is not None else "?", stack_of(thread, 3))
            return
        thread.join(max(0.0, timeout_s - (time.monotonic() - t0)))
        if thread.is_alive():
            raise SnapshotWorkerError(
                f"the snapshot worker did not stop within {timeout_s:.0f}s after the failure: it is still in the "
                f"{job.kind if job is not None else '?'} snapshot of step "
                f"{job.snap.version if job is not None else '?'} ({self.phase}), at {stack_of(thread)}")

    def wait_idle(self) -> None:
        """Wait (``timeout_s`` at most) for the snapshot in flight, in short slices so that the launcher's notice
        (``rebuild.notice``, inside an armed region) can stop the wait; raise its error."""
        job = self.inflight
        if job is not None:
            if not job.done.is_set():
                self.priority.boost()
            deadline = time.monotonic() + self.timeout_s
            while not job.done.wait(0.2) and time.monotonic() < deadline:
                pass
        self.raise_error()

    def close(self) -> bool:
        """End the thread (bounded); False when it is still running (it may still enqueue a copy)."""
        thread = self.thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(self.timeout_s)
        self.thread = None
        return thread is None or not thread.is_alive()


def stack_of(thread: threading.Thread, frames: int = 6) -> str:
    """The innermost frames of a live thread, as ``file:line function`` from the outside in (for an error line)."""
    import sys
    import traceback

    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "(no stack: the thread is not running Python code)"
    summary = traceback.extract_stack(frame)[-frames:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(summary))
