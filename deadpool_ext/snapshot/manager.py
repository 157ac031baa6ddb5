"""Snapshots every iteration, off the critical path: tier 1 (local shared memory) and tier 2 (peer memory).

Call order (every rank; the runtime does this):

1. ``SnapshotManager(adapter, config, placement)`` - collective: gathers every rank's node name, places replicas,
   creates a gloo side group used only by snapshot traffic.
2. ``restore_latest()`` - collective, main thread, before training: agree on a version, fetch what is
   missing from peers, restore in place. Returns the version or ``None``.
3. Per optimizer step: ``before_optimizer_step()`` then (after the step) ``after_step()``.
4. ``close()``.

The manager is the facade over four parts, each owning one concern: the tier-1 store of this rank's segments
(:mod:`.tier1`), the writer thread that seals, replicates and commits (:mod:`.writer`), the restore planner and its
executor (:mod:`.plan`, :mod:`.restore`), and the typed stats (:mod:`.stats`). It keeps the hot path (what to
snapshot at a step: a base or a differential, into which slot) and the wiring of a world (side group, replicators,
node directory and agent).

The hazard and how it is avoided: the background worker copies *live* parameter, master-weight and optimizer
tensors. Forward and backward only read them (ZeRO keeps gradients in separate buffers); the optimizer step
overwrites them in place. ``before_optimizer_step`` therefore waits until the copy of the previous version is
done - in steady state it already is, since the copy ran during forward and backward. Checksums, replication
and the global commit happen after that point, on the copied bytes, and never block the step.
"""
from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import hooks
from ..cluster.topology import NodePlacement
from ..config import DeadpoolConfig
from ..memory.agent import claim_directory, ensure_agent
from ..memory.pinned import HostPinner, SideStream, cuda_runtime
from ..memory.shm import ensure_private_dir, job_shm_dir
from ..persist.sign import checkpoint_key
from ..rebuild.context import context
from ..replicate.auth import BlobSigner
from ..replicate.peer import PeerReplicator
from . import spare_slots
from .differential import DiffRing, GradTap
from .late import LateState
from .priority import WorkerPriority
from .restore import RestoreExecutor, shrink_allowed
from .slots import PreparedSnapshot, header_reserve, prepare, slot_nbytes
from .state import RankStateAdapter, captured_of
from .stats import SnapshotStats
from .tier1 import TierOneStore
from .writer import ABANDON_AFTER_S, COMMITTING, Job, SnapshotWorkerError, SnapshotWriter

__all__ = ["ABANDON_AFTER_S", "COMMITTING", "SnapshotManager", "SnapshotWorkerError", "prepare_node"]

log = logging.getLogger("deadpool_ext")


def prepare_node(config: DeadpoolConfig, placement: NodePlacement) -> str:
    """This node's memory directory (0700, never through a symlink, refused if another user made it), claimed for
    the job and watched by the node's agent (local rank 0). Idempotent; what :class:`SnapshotManager` does first,
    and what a spare does before its assignment (``rebuild/spare.py``: nothing of it depends on the rank, and the
    agent's start, a process, is then off the recovery's critical path). Returns the directory."""
    directory = job_shm_dir(placement.shm_root, placement.job_id, placement.node)
    ensure_private_dir(directory)
    if placement.first_on_node:
        keep = float(config.local.keep_after_exit_s)
        claim_directory(directory, placement.launcher_pid, keep_s=keep)
        ensure_agent(directory, placement.launcher_pid, keep_s=keep)
    return directory


class SnapshotManager:
    def __init__(self, adapter: RankStateAdapter, config: DeadpoolConfig, placement: NodePlacement) -> None:
        self.adapter = adapter
        self.config = config
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.job_id = placement.job_id
        self.node = placement.node
        if placement.shm_root != config.local.shm_root and self.rank == 0:
            log.info("shared memory root %s set by deadpool-run (config says %s)", placement.shm_root,
                     config.local.shm_root)
        self.dir = prepare_node(config, placement)
        timeout = timedelta(seconds=max(config.replication.timeout_s, config.recovery.timeout_s))
        # Snapshot traffic never shares a communicator with training collectives (which may be NCCL); swappable
        # (in-place hot-swap) when the default group is.
        from ..rebuild.swap import side_backend

        self.group = dist.new_group(backend=side_backend(), timeout=timeout)
        dc = config.differential
        self.tap: GradTap | None = GradTap(adapter, dc.compression) if dc.enabled else None
        self.chunk_bytes = config.snapshot.chunk_mb << 20
        # GPU: device-to-host copies on a side stream into page-locked slots (memory/pinned.py); None on CPU.
        self._side: SideStream | None = SideStream.create()
        self._pinner = HostPinner(cuda_runtime(), drain=self._side.synchronize if self._side is not None else None)
        self.store = TierOneStore(self.dir, self.job_id, self.rank, self._pinner, dc.base_interval - 1)
        """Tier 1: this rank's slots and differential ring (memory only; what to write and when is decided here)."""
        self.timings = SnapshotStats()
        """What the memory tiers did (typed); :meth:`stats` is its summary."""
        self.shrink_allowed = shrink_allowed(config)
        """Whether a restore may reshard a world of another size (``no_spare_policy: shrink``)."""
        self.late: LateState | None = None
        """The framework's state posted after the step (snapshot/late.py; the HF Trainer's), kept across rewires."""
        self.writer = SnapshotWriter(rank=self.rank, store=self.store, group=self.group, side=self._side,
                                     stats=self.timings, chunk_bytes=self.chunk_bytes,
                                     background=config.snapshot.background, timeout_s=config.replication.timeout_s,
                                     late=lambda: self.late)
        """The thread that seals, replicates and commits each snapshot (one per world, epochs across them)."""
        self._wire()

    def _wire(self) -> None:
        """Placement, memory and worker of the current world (collective on the side group): at construction and
        again after an in-place hot-swap (:meth:`rewire`)."""
        config = self.config
        # With a checkpoint key every blob crossing the peer channel is signed and checked (replicate/auth.py).
        signer = BlobSigner(checkpoint_key())
        self.peers = PeerReplicator(rank=self.rank, node=self.node, factor=config.replication.factor,
                                    group=self.group, shm_dir=self.dir, job_id=self.job_id,
                                    double_buffer=config.replication.double_buffer, signer=signer)
        self.peers.adopt = functools.partial(spare_slots.adopt, self.dir)  # a spare's buffers made while it waited
        # Differential mode (TierCheck): bases every K steps in the store's slots, differentials in its ring.
        dc = config.differential
        self.ring = DiffRing(dc.base_interval)
        self.store.reset(self.ring.size)
        self.dpeers: PeerReplicator | None = None
        if dc.enabled:
            self.dpeers = PeerReplicator(rank=self.rank, node=self.node, factor=config.replication.factor,
                                         group=self.group, shm_dir=self.dir, job_id=self.job_id,
                                         kind="dreplica", nbuf=self.ring.size, signer=signer)
        if self.tap is not None:
            self.tap.discard()
        self._last_version: int | None = None
        self.active = True
        """Benchmarks flip this to interleave blocks of steps with and without snapshots in one run."""
        self.priority = WorkerPriority(config.snapshot.worker_priority)
        self.writer.start(peers=self.peers, dpeers=self.dpeers, ring=self.ring, priority=self.priority)

    @property
    def committed_version(self) -> int | None:
        """The newest version every rank committed (the writer's all-reduce MIN, or the version restored)."""
        return self.writer.committed_version

    @property
    def committed_base(self) -> int | None:
        """The newest base every rank committed (differentials after it are kept: watermark GC)."""
        return self.writer.committed_base

    def rewire(self, placement: NodePlacement) -> None:
        """In-place hot-swap, after the side group's communicator was swapped (collective on it, every rank of the
        new world at the same point, before ``restore_latest``): the placement of the new world (the spare holds
        the failed node's place) and a manager state like a new one's. This rank's snapshots stay in shared
        memory, where the restore finds them; only this object's handles to them are closed."""
        self.stop_worker()
        self.store.close()  # unregistered (GPU) before it is unmapped
        for peers in (self.peers, self.dpeers):
            if peers is not None:
                peers.close()
        self.node = placement.node
        self._wire()

    def arm_late(self, restored: Any, headroom: int) -> bool:
        """Seal every snapshot with the framework's state posted after its step (:mod:`.late`, before the first
        snapshot); ``restored(section or None)`` at a restore. False (not armed) with ``snapshot.background: false``:
        the inline copy seals in the step, before any post."""
        if not self.config.snapshot.background:
            return False
        if self.late is None:
            self.late = LateState(restored, headroom, timeout_s=self.config.replication.timeout_s)
        return True

    # -- hot path -------------------------------------------------------------------------------------
    def before_optimizer_step(self) -> None:
        job = self.writer.inflight
        if job is None:
            return
        if not job.copied.is_set():
            t0 = time.perf_counter()
            self.priority.boost()  # a worker at idle priority may get no CPU on a busy host: normal until its copy
            if not job.copied.wait(self.config.replication.timeout_s):
                raise SnapshotWorkerError(
                    f"snapshot copy of step {job.snap.version} did not finish within "
                    f"{self.config.replication.timeout_s}s")
            self.timings.blocking_s[-1] += time.perf_counter() - t0
        self.writer.raise_error()

    def after_step(self) -> None:
        self.writer.raise_error()
        version = self.adapter.step()
        if not self.active or version % self.config.snapshot.interval:
            if self.tap is not None:
                self.tap.discard()
            return
        late = self.late.begin(version) if self.late is not None else None  # an unposted previous one: sealed
        t0 = time.perf_counter()
        previous = self.writer.inflight
        if previous is not None and not previous.done.is_set():
            # The previous version is still being sealed/replicated; its slot must not be the target.
            self.priority.boost()
            previous.done.wait(self.config.replication.timeout_s)
            self.writer.raise_error()
        ident = {"version": version, "rank": self.rank, "world_size": self.world, "job_id": self.job_id,
                 "node": self.node}
        # A differential needs the previous version in the chain; any gap (snapshots paused, a restore) and
        # every K-th step take a full base. Every rank decides the same way: the worker's side-group traffic
        # (replication, commit) must match across ranks.
        if (self.tap is not None and self._last_version == version - 1 and self.store.latest is not None
                and version % self.ring.k != 0):
            grads, hypers = self.tap.take()
            obj = {"tensors": grads, "state": {"meta": self.adapter.meta(), "hypers": hypers}}
            snap = prepare(version, obj, {**ident, "kind": "diff"})
            if not self.store.ring_header_reserved:
                self._allocate_ring(snap)
            kind, slot = "diff", self.ring.index(version)
        else:
            if self.tap is not None:
                self.tap.discard()
            derived = self.adapter.derived()  # not copied: checksummed (prepare), re-derived at restore
            obj = {"tensors": dict(captured_of(self.adapter.tensors(), derived)), "state": self.adapter.meta()}
            snap = prepare(version, obj, {**ident, "kind": "base"}, derived)
            if self.store.slots[0] is None:
                self._allocate(snap)
            kind, slot = "base", 0 if self.store.latest is None else 1 - self.store.latest[1]
        self._last_version = version
        hooks.fire(hooks.BEFORE_SEAL, version=version, rank=self.rank, snapshot=snap)
        event = None
        if self._side is not None and _on_device(snap.tensors):
            event = self._side.ready()  # the version is complete on the compute stream; the copy starts after it
        job = Job(snap, slot, event, kind)
        job.late = late
        self.timings.add_timing("blocking_s", 0.0)
        self.writer.submit(job)
        self.timings.blocking_s[-1] += time.perf_counter() - t0

    # -- memory -----------------------------------------------------------------------------------------
    def _allocate(self, snap: PreparedSnapshot) -> None:
        """First snapshot: size and pre-touch both slots, exchange sizes with peers, report memory."""
        self.store.header_reserved = header_reserve(snap, self.late.room() if self.late is not None else 0)
        nbytes = slot_nbytes(self.store.header_reserved, snap.data_nbytes)
        self.store.open_slots(nbytes)
        m = context().membership
        if m is not None:  # for spares, which make their slots while they wait (snapshot/spare_slots.py)
            from .spare_slots import publish_slot_size

            publish_slot_size(m.store, self.rank, nbytes, self.peers.held_buffers())
        self.peers.setup(nbytes)
        state = self.state_nbytes()
        derived = sum(t.numel() * t.element_size() for _, t in snap.derived)
        total = 2 * nbytes + self.peers.held_nbytes()
        log.info("snapshot memory: state %.1f MB (%.1f MB captured%s); tier 1 = 2 slots x %.1f MB; tier 2 holds "
                 "%d replica(s), %.1f MB; total %.1f MB = %.2f x state (bound (2 + replication factor) x state = %d x)",
                 state / 1e6, snap.data_nbytes / 1e6,
                 f", {derived / 1e6:.1f} MB of parameters re-derived from the masters at restore" if derived else "",
                 nbytes / 1e6, len(self.peers.sources), self.peers.held_nbytes() / 1e6, total / 1e6,
                 total / max(state, 1), 2 + self.peers.factor)

    def state_nbytes(self) -> int:
        """Bytes of the rank's live training state: every tensor of the adapter, derived ones included."""
        return sum(t.numel() * t.element_size() for _, t in self.adapter.tensors())

    def _allocate_ring(self, snap: PreparedSnapshot) -> None:
        """First differential: size and pre-touch the ring, exchange sizes with peers, report memory."""
        self.store.ring_header_reserved = header_reserve(snap, self.late.room() if self.late is not None else 0)
        nbytes = slot_nbytes(self.store.ring_header_reserved, snap.data_nbytes)
        self.store.open_ring(nbytes)
        assert self.dpeers is not None  # differential mode
        self.dpeers.setup(nbytes)
        base = self.store.slot(0).nbytes if self.store.slots[0] is not None else 0
        log.info("differential memory: %d x %.1f MB per rank (%.0f%% of a %.1f MB base) plus %.1f MB of peer "
                 "differentials; total snapshot memory %.1f MB", self.ring.size, nbytes / 1e6,
                 100 * nbytes / max(base, 1), base / 1e6, self.dpeers.held_nbytes() / 1e6, self.memory_bytes() / 1e6)

    def memory_bytes(self) -> int:
        total = self.store.nbytes() + self.peers.held_nbytes()
        return total + (self.dpeers.held_nbytes() if self.dpeers is not None else 0)

    # -- misc -------------------------------------------------------------------------------------------
    def metrics(self, step: int) -> dict[str, float]:
        """A few numbers for a training job's own logs (DeepSpeed's monitor, the HF Trainer's logs), cheap enough
        for every step: the blocking time of the newest snapshot whose wait is complete, the newest base's size,
        how many steps the newest globally committed version is behind ``step``, and the snapshot memory."""
        blocking = self.timings.blocking_s
        out: dict[str, float] = {"snapshot_memory_mb": self.memory_bytes() / 2**20}
        if len(blocking) >= 2:
            out["blocking_ms"] = blocking[-2] * 1000.0
        if self.timings.base_nbytes is not None:
            out["snapshot_mb"] = self.timings.base_nbytes / 2**20
        if self.committed_version is not None:
            out["commit_lag_steps"] = float(step - self.committed_version)
        if self.timings.restore_s is not None:
            out["restore_s"] = float(self.timings.restore_s)
        return out

    def stats(self) -> dict[str, Any]:
        """The summary of :attr:`timings` (JSON; the keys benchmarks and job summaries read)."""
        t = self.peers.transport
        return self.timings.as_dict(worker_priority_boosts=self.priority.boosts,
                                    committed_version=self.committed_version, memory_bytes=self.memory_bytes(),
                                    tier2={"factor": self.peers.factor, "signed": t.signer.enabled,
                                           "refused_blobs": t.refused_total + (self.dpeers.transport.refused_total
                                                                               if self.dpeers is not None else 0)})

    # -- restore ----------------------------------------------------------------------------------------
    def restore_latest(self, newer_than: int | None = None) -> int | None:
        """Collective. Restore the newest version every rank can obtain from the memory tiers (:mod:`.restore`);
        ``None`` when there is none, or none newer than ``newer_than`` (a tier-3 base already loaded)."""
        done = self._executor().run(newer_than)
        if done is None:
            return None
        self.store.latest = done.latest
        self.writer.committed_version = done.version
        self.writer.committed_base = done.base
        self.ring.versions = {self.ring.index(v): v for v in done.ring_of}
        self._last_version = None  # the next snapshot is a base: the chain restarts from the restored state
        return done.version

    def _executor(self) -> RestoreExecutor:
        return RestoreExecutor(adapter=self.adapter, config=self.config, rank=self.rank, world=self.world,
                               node=self.node, job_id=self.job_id, group=self.group, store=self.store,
                               peers=self.peers, dpeers=self.dpeers, ring=self.ring, differential=self.tap is not None,
                               late=self.late, stats=self.timings, elastic=self.shrink_allowed)

    def _scan(self, verify: bool) -> tuple[Any, dict[int, int], dict[int, int]]:
        """(report, version -> slot, version -> ring entry) of what this rank holds (headers only unless
        ``verify``); kept for ``ResilientRuntime._say_if_never_restored``, which reads ``report.local``."""
        report, own = self._executor().scan(verify)
        return report, own.slot_of, own.ring_of

    def quiesce(self, timeout_s: float = 10.0) -> None:
        """Hot-swap: stop snapshotting. Waits (bounded) until the in-flight copy is done, so no stale worker
        writes into a slot the next manager will use; replication of that version may fail with the dead
        group, which is expected and not raised."""
        self.active = False
        if self.late is not None:
            self.late.drop()  # a step that failed before its state was posted is never sealed
        self.writer.quiesce(timeout_s)

    def stop_worker(self, timeout_s: float = 30.0) -> None:
        """Quiesce, then wait (bounded) until the worker thread has exited: after an in-place hot-swap no stale
        worker may issue a collective on the side group's new communicator. Call it after the dead generation's
        communicators are parked (their collectives then fail at once)."""
        self.writer.stop(self.quiesce, timeout_s)

    def wait_idle(self) -> None:
        """Wait (``replication.timeout_s`` at most) for the snapshot in flight, in short slices so that the
        launcher's notice (``rebuild.notice``, inside an armed region) can stop the wait; raise its error."""
        self.writer.wait_idle()

    def close(self) -> None:
        if not self.writer.close():  # it may still enqueue a copy into a slot: leave them pinned
            log.warning("snapshot worker still running at close: its %d pinned slot(s) stay registered",
                        len(self._pinner))
        else:
            self._pinner.release_all()  # the slots stay mapped (readable) as ordinary memory


def _on_device(tensors: list[torch.Tensor]) -> bool:
    """Whether a snapshot has tensors in device memory (then it is copied on the side stream)."""
    return any(t.is_cuda for t in tensors)
