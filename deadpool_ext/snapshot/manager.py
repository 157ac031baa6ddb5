"""Snapshots every iteration, off the critical path: tier 1 (local shared memory) and tier 2 (peer memory).

Call order (every rank; the runtime does this):

1. ``SnapshotManager(adapter, config)`` - collective: gathers every rank's node name, places replicas,
   creates a gloo side group used only by snapshot traffic.
2. ``restore_latest()`` - collective, main thread, before training: agree on a version, fetch what is
   missing from peers, restore in place. Returns the version or ``None``.
3. Per optimizer step: ``before_optimizer_step()`` then (after the step) ``after_step()``.
4. ``close()``.

The hazard and how it is avoided: the background worker copies *live* parameter, master-weight and optimizer
tensors. Forward and backward only read them (ZeRO keeps gradients in separate buffers); the optimizer step
overwrites them in place. ``before_optimizer_step`` therefore waits until the copy of the previous version is
done - in steady state it already is, since the copy ran during forward and backward. Checksums, replication
and the global commit happen after that point, on the copied bytes, and never block the step.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..cluster.comm import allgather_json
from ..config import DeadpoolConfig
from ..distributed import default_job_id, node_name
from ..memory.agent import claim_directory, ensure_agent
from ..memory.shm import ShmSegment, job_shm_dir, segment_name
from ..recovery.agree import RankReport, RecoveryError, choose_version
from .differential import DiffRing, GradTap
from .format import tensor_checksum
from .peer import PeerReplicator
from .slots import PreparedSnapshot, SlotWriter, header_reserve, prepare, probe_slot, restore_from, slot_nbytes
from .state import RankStateAdapter

log = logging.getLogger("deadpool_ext")


class SnapshotWorkerError(RuntimeError):
    pass


class _Job:
    __slots__ = ("snap", "slot", "copied", "done", "event", "kind")

    def __init__(self, snap: PreparedSnapshot, slot: int, event: Any, kind: str = "base") -> None:
        self.snap, self.slot, self.event, self.kind = snap, slot, event, kind
        self.copied = threading.Event()
        self.done = threading.Event()


class SnapshotManager:
    def __init__(self, adapter: RankStateAdapter, config: DeadpoolConfig) -> None:
        self.adapter = adapter
        self.config = config
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.job_id = config.job_id or default_job_id()
        self.node = _simulated_node(config) or node_name()
        shm_root = os.environ.get("DEADPOOL_SHM_ROOT") or config.local.shm_root
        if shm_root != config.local.shm_root and self.rank == 0:
            log.info("shared memory root %s set by deadpool-run (config says %s)", shm_root, config.local.shm_root)
        self.dir = job_shm_dir(shm_root, self.job_id, self.node)
        os.makedirs(self.dir, exist_ok=True)
        launcher = int(os.environ.get("DEADPOOL_LAUNCHER_PID", os.getppid()))
        if self._first_on_node():
            keep = float(config.local.keep_after_exit_s)
            claim_directory(self.dir, launcher, keep_s=keep)
            ensure_agent(self.dir, launcher, keep_s=keep)
        timeout = timedelta(seconds=max(config.replication.timeout_s, config.recovery.timeout_s))
        # Snapshot traffic never shares a communicator with training collectives (which may be NCCL).
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.peers = PeerReplicator(rank=self.rank, node=self.node, factor=config.replication.factor,
                                    group=self.group, shm_dir=self.dir, job_id=self.job_id,
                                    double_buffer=config.replication.double_buffer)
        self.slots: list[ShmSegment | None] = [None, None]
        self.header_reserved = 0
        # Differential mode (TierCheck): bases every K steps in the slots above, differentials in a ring.
        dc = config.differential
        self.tap: GradTap | None = GradTap(adapter, dc.compression) if dc.enabled else None
        self.ring = DiffRing(dc.base_interval)
        self.ring_segs: list[ShmSegment | None] = [None] * self.ring.size
        self.ring_header_reserved = 0
        self.dpeers: PeerReplicator | None = None
        if dc.enabled:
            self.dpeers = PeerReplicator(rank=self.rank, node=self.node, factor=config.replication.factor,
                                         group=self.group, shm_dir=self.dir, job_id=self.job_id,
                                         kind="dreplica", nbuf=self.ring.size)
        self.committed_base: int | None = None
        self._last_version: int | None = None
        self.latest: tuple[int, int] | None = None  # (version, slot) of newest complete local version
        self.committed_version: int | None = None
        self.chunk_bytes = config.snapshot.chunk_mb << 20
        self._inflight: _Job | None = None
        self._error: BaseException | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._stats: dict[str, Any] = {"snapshots": 0, "diffs": 0, "blocking_s": [], "copy_s": [], "seal_s": [],
                                       "replicate_s": [], "commit_s": [], "base_nbytes": None, "diff_nbytes": None}
        self.active = True
        """Benchmarks flip this to interleave blocks of steps with and without snapshots in one run."""
        self._thread: threading.Thread | None = None
        if config.snapshot.background:
            self._thread = threading.Thread(target=self._worker, name="deadpool-snapshot", daemon=True)
            self._thread.start()

    def _first_on_node(self) -> bool:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        n = self.config.local.simulate_nodes
        if n and not os.environ.get("DEADPOOL_NODE"):
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            return local_rank % (local_world // n) == 0
        return local_rank == 0

    # -- hot path -------------------------------------------------------------------------------------
    def before_optimizer_step(self) -> None:
        job = self._inflight
        if job is None:
            return
        if not job.copied.is_set():
            t0 = time.perf_counter()
            if not job.copied.wait(self.config.replication.timeout_s):
                raise SnapshotWorkerError(
                    f"snapshot copy of step {job.snap.version} did not finish within {self.config.replication.timeout_s}s")
            self._stats["blocking_s"][-1] += time.perf_counter() - t0
        self._raise_worker_error()

    def after_step(self) -> None:
        self._raise_worker_error()
        version = self.adapter.step()
        if not self.active or version % self.config.snapshot.interval:
            if self.tap is not None:
                self.tap.discard()
            return
        t0 = time.perf_counter()
        if self._inflight is not None and not self._inflight.done.is_set():
            # The previous version is still being sealed/replicated; its slot must not be the target.
            self._inflight.done.wait(self.config.replication.timeout_s)
            self._raise_worker_error()
        ident = {"version": version, "rank": self.rank, "world_size": self.world, "job_id": self.job_id,
                 "node": self.node}
        # A differential needs the previous version in the chain; any gap (snapshots paused, a restore) and
        # every K-th step take a full base. Every rank decides the same way: the worker's side-group traffic
        # (replication, commit) must match across ranks.
        if (self.tap is not None and self._last_version == version - 1 and self.latest is not None
                and version % self.ring.k != 0):
            grads, hypers = self.tap.take()
            obj = {"tensors": grads, "state": {"meta": self.adapter.meta(), "hypers": hypers}}
            snap = prepare(version, obj, {**ident, "kind": "diff"})
            if not self.ring_header_reserved:
                self._allocate_ring(snap)
            kind, slot = "diff", self.ring.index(version)
        else:
            if self.tap is not None:
                self.tap.discard()
            obj = {"tensors": dict(self.adapter.captured()), "state": self.adapter.meta()}
            snap = prepare(version, obj, {**ident, "kind": "base"}, self.adapter.derived())
            if self.slots[0] is None:
                self._allocate(snap)
            kind, slot = "base", 0 if self.latest is None else 1 - self.latest[1]
        self._last_version = version
        event = None
        if self._stream is not None and any(t.is_cuda for t in snap.tensors):
            event = torch.cuda.Event()
            event.record()
        job = _Job(snap, slot, event, kind)
        self._inflight = job
        self._stats["blocking_s"].append(0.0)
        if self._thread is not None:
            self._queue.put(job)
        else:
            self._run(job)
        self._stats["blocking_s"][-1] += time.perf_counter() - t0

    # -- worker ----------------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            except BaseException as exc:  # surfaced on the main thread at the next hook
                self._error = exc
                log.error("snapshot of step %d failed: %s", job.snap.version, exc)
            finally:
                job.copied.set()
                job.done.set()

    def _run(self, job: _Job) -> None:
        diff = job.kind == "diff"
        if diff:
            self.ring.check_reuse(job.snap.version, self.committed_base)  # watermark GC
            seg, reserved = self.ring_segs[job.slot], self.ring_header_reserved
        else:
            seg, reserved = self.slots[job.slot], self.header_reserved
        assert seg is not None
        writer = SlotWriter(seg.tensor(), reserved, self.chunk_bytes)
        t0 = time.perf_counter()
        writer.invalidate()
        if diff:
            self.ring.versions.pop(job.slot, None)
        elif self.latest is not None and self.latest[1] == job.slot:
            self.latest = None
        if job.event is not None:
            self._stream.wait_event(job.event)
            with torch.cuda.stream(self._stream):
                writer.copy(job.snap, self._stream)
        else:
            writer.copy(job.snap)
        job.copied.set()
        t1 = time.perf_counter()
        blob_len = writer.seal(job.snap)
        if blob_len != seg.nbytes:
            raise RuntimeError(f"snapshot of step {job.snap.version} is {blob_len} bytes, slot is {seg.nbytes}: "
                               "the rank's state changed size, which in-memory snapshots do not support")
        if diff:
            self.ring.stored(job.snap.version)
        else:
            self.latest = (job.snap.version, job.slot)
        t2 = time.perf_counter()
        if diff:
            self.dpeers.replicate(seg.tensor(), blob_len, buf=job.slot)
        else:
            self.peers.replicate(seg.tensor(), blob_len)
        t3 = time.perf_counter()
        flag = torch.tensor([job.snap.version], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        self.committed_version = int(flag.item())
        if not diff and self.committed_version == job.snap.version:
            self.committed_base = job.snap.version
        t4 = time.perf_counter()
        st = self._stats
        st["diffs" if diff else "snapshots"] += 1
        st["diff_nbytes" if diff else "base_nbytes"] = blob_len
        st["copy_s"].append(t1 - t0)
        st["seal_s"].append(t2 - t1)
        st["replicate_s"].append(t3 - t2)
        st["commit_s"].append(t4 - t3)

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise SnapshotWorkerError(f"background snapshot worker failed: {self._error}") from self._error

    # -- memory -----------------------------------------------------------------------------------------
    def _allocate(self, snap: PreparedSnapshot) -> None:
        """First snapshot: size and pre-touch both slots, exchange sizes with peers, report memory."""
        self.header_reserved = header_reserve(snap)
        nbytes = slot_nbytes(self.header_reserved, snap.data_nbytes)
        self._open_slots(nbytes)
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
        self.ring_header_reserved = header_reserve(snap)
        nbytes = slot_nbytes(self.ring_header_reserved, snap.data_nbytes)
        self._open_ring(nbytes)
        self.dpeers.setup(nbytes)
        base = self.slots[0].nbytes if self.slots[0] is not None else 0
        log.info("differential memory: %d x %.1f MB per rank (%.0f%% of a %.1f MB base) plus %.1f MB of peer "
                 "differentials; total snapshot memory %.1f MB", self.ring.size, nbytes / 1e6,
                 100 * nbytes / max(base, 1), base / 1e6, self.dpeers.held_nbytes() / 1e6, self.memory_bytes() / 1e6)

    def _open_ring(self, nbytes: int) -> None:
        for j in range(self.ring.size):
            seg = self.ring_segs[j]
            if seg is None or seg.nbytes != nbytes:
                if seg is not None:
                    seg.close()
                self.ring_segs[j] = ShmSegment.create(segment_name(self.job_id, "diff", self.rank, j), nbytes,
                                                      root=self.dir, touch=True)
                _pin_for_cuda(self.ring_segs[j])

    def _open_slots(self, nbytes: int) -> None:
        for i in (0, 1):
            if self.slots[i] is None or self.slots[i].nbytes != nbytes:
                if self.slots[i] is not None:
                    self.slots[i].close()
                self.slots[i] = ShmSegment.create(segment_name(self.job_id, "snap", self.rank, i), nbytes,
                                                  root=self.dir, touch=True)
                _pin_for_cuda(self.slots[i])

    def memory_bytes(self) -> int:
        total = sum(s.nbytes for s in [*self.slots, *self.ring_segs] if s is not None) + self.peers.held_nbytes()
        return total + (self.dpeers.held_nbytes() if self.dpeers is not None else 0)

    # -- restore ----------------------------------------------------------------------------------------
    def _scan(self, verify: bool) -> tuple[RankReport, dict[int, int], dict[int, int]]:
        """What this rank holds: own slots and ring entries, replicas held for others. ``verify``: checksums
        of every buffer (else headers only: complete, sealed, which version)."""
        report = RankReport(rank=self.rank)
        slot_of: dict[int, int] = {}
        ring_of: dict[int, int] = {}
        files = [("snap", i) for i in (0, 1)] + [("diff", j) for j in range(self.ring.size if self.tap else 0)]
        for kind, i in files:
            path = os.path.join(self.dir, segment_name(self.job_id, kind, self.rank, i))
            if not os.path.exists(path):
                continue
            seg = ShmSegment.open(os.path.basename(path), root=self.dir)
            meta, why = probe_slot(seg.buf, verify=verify)
            what = "slot" if kind == "snap" else "differential ring entry"
            if meta is None and why is None:
                pass  # allocated, never written
            elif meta is None:
                log.warning("tier 1: %s %d of rank %d unusable (%s); falling back to the next source", what, i,
                            self.rank, why)
            elif meta.get("world_size") != self.world or meta.get("rank") != self.rank:
                log.warning("tier 1: %s %d was written by rank %s of a world of %s; ignored", what, i,
                            meta.get("rank"), meta.get("world_size"))
            elif kind == "snap":
                report.local[int(meta["version"])] = int(meta["blob_nbytes"])
                slot_of[int(meta["version"])] = i
            else:
                report.local_diffs[int(meta["version"])] = int(meta["blob_nbytes"])
                ring_of[int(meta["version"])] = i
            seg.close()
        report.replicas = self.peers.scan(verify=verify, world=self.world)
        if self.dpeers is not None:
            report.replica_diffs = self.dpeers.scan(verify=verify, world=self.world)
        return report, slot_of, ring_of

    def restore_latest(self, newer_than: int | None = None) -> int | None:
        """Collective. Restore the newest version every rank can obtain from the memory tiers; ``None`` when
        there is none, or none newer than ``newer_than`` (a tier-3 base already loaded)."""
        from ..chaos.at_step import restore_gate

        restore_gate()  # fault injection only (DEADPOOL_RESTORE_GATE): no-op otherwise
        t0 = time.perf_counter()
        verify = self.config.snapshot.verify_on_restore
        # Checksums only of what is used: every rank verifies the copy it restores from (its own slot, or the
        # blob it fetched) and all ranks agree that every one of them was clean before anything is copied in.
        # If one was not, everyone scans again checking every copy and chooses again, excluding it (the
        # fallback to the next source). Differential mode keeps the full check up front.
        lazy = verify and not self.tap and self.dpeers is None
        while True:
            report, slot_of, ring_of = self._scan(verify=verify and not lazy)
            reports = [RankReport.from_json(r) for r in allgather_json(report.to_json(), group=self.group)]
            try:
                plan = choose_version(reports)
            except RecoveryError:
                self._unopened()  # the caller may continue without memory (a tier-3 base): a clean start
                raise
            if plan is None:
                log.info("no snapshots of job %s in local or peer memory: fresh start", self.job_id)
                return self._unopened()
            if newer_than is not None and plan.version <= newer_than:
                if self.rank == 0:
                    log.info("memory tiers hold step %d, not newer than the tier-3 base of step %d: keeping the base",
                             plan.version, newer_than)
                return self._unopened()
            me = self.rank
            if me == 0:
                log.info("restoring step %d: %d rank(s) from own memory, %d from peer replicas %s%s", plan.version,
                         self.world - len(plan.fetch), len(plan.fetch),
                         {r: h for r, (h, _) in sorted(plan.fetch.items())},
                         f"; bases {sorted(set(plan.base.values()))} + differentials replayed up to {plan.version}"
                         if plan.replays else "")
            base = plan.base.get(me, plan.version)
            fetching = me in plan.fetch
            if fetching:
                self._open_slots(plan.fetch[me][1])
                slot = 0
            else:
                slot = slot_of[base]
                self._open_slots(self.slots_nbytes(slot))
            self.peers.serve_fetches(plan.version, plan.fetch, self.slots[slot].tensor() if fetching else None,
                                     versions=plan.base)
            seg = self.slots[slot]
            problem = None
            if fetching or lazy:
                meta, why = probe_slot(seg.buf, verify=True)
                if meta is None or int(meta["version"]) != base:
                    problem = (f"rank {me}: " + (f"replica of step {base} fetched from rank {plan.fetch[me][0]}"
                                                 if fetching else f"tier-1 slot {slot} of step {base}")
                               + f" is unusable ({why})")
            if lazy:
                problems = [p for p in allgather_json(problem, group=self.group) if p]
                if problems:
                    log.warning("restore of step %d refused before use: %s; checking the checksums of every copy "
                                "and choosing again", plan.version, "; ".join(problems))
                    lazy = False
                    continue
            elif problem is not None:
                raise RecoveryError(f"{problem}; no other copy in memory")
            if fetching:
                log.info("tier 2: fetched and verified step %d from rank %d", base, plan.fetch[me][0])
            break
        ring_of = self._fetch_diffs(plan, ring_of)
        tensors, state, header = restore_from(seg.buf, verify=False)  # verified above (scan, check before use, fetch)
        self.adapter.restore(tensors, state)
        del tensors
        self._verify_derived(header, base)
        replayed = self._replay(plan, ring_of)
        self.latest = (base, slot)
        self.committed_version = plan.version
        self.committed_base = base
        self.ring.versions = {self.ring.index(v): v for v in ring_of}
        self._last_version = None  # the next snapshot is a base: the chain restarts from the restored state
        self.header_reserved = _header_len(seg)
        self.peers.setup(seg.nbytes)
        self._stats["restore_s"] = time.perf_counter() - t0
        self._stats["restored_version"] = plan.version
        self._stats["restored_from"] = "peer" if fetching else "local"
        self._stats["replayed"] = replayed
        return plan.version

    def _unopened(self) -> None:
        """No restore after all (a copy refused before use left no common version): close slots an earlier
        attempt of this restore opened, so the first snapshot sizes them as on a fresh start."""
        if not self.header_reserved:
            for i in (0, 1):
                if self.slots[i] is not None:
                    self.slots[i].close()
                    self.slots[i] = None
        return None

    def _verify_derived(self, header: dict[str, Any], version: int) -> None:
        """Tensors the restore re-derived (not stored) must hash to what they were at capture."""
        recorded = header.get("derived") or {}
        live = dict(self.adapter.derived())
        for name, want in sorted(recorded.items()):
            got = tensor_checksum(live[name]) if name in live else None
            if got != want:
                raise RecoveryError(
                    f"rank {self.rank}: {name} re-derived from the restored step {version} does not match its checksum "
                    f"at capture ({got} != {want}): this engine's parameters are not the masters cast to their dtype; "
                    "set deadpool.snapshot.derive_params to false to capture them")
        if recorded and self.rank == 0:
            log.info("restore: %d parameter buffer(s) re-derived from the masters and verified against their "
                     "checksums at capture", len(recorded))

    def _fetch_diffs(self, plan: Any, ring_of: dict[int, int]) -> dict[int, int]:
        """Differentials of ranks restoring from a peer, into their ring (collective over all ranks, in the
        same order everywhere). Returns version -> ring entry of the differentials this rank now holds."""
        me = self.rank
        mine = plan.fetch_diffs.get(me, {})
        if mine:
            ring_of = {}
            self._open_ring(max(mine.values()))
        for d in sorted({v for vs in plan.fetch_diffs.values() for v in vs}):
            fetch = {r: (plan.fetch[r][0], vs[d]) for r, vs in plan.fetch_diffs.items() if d in vs}
            into = self.ring_segs[self.ring.index(d)].tensor() if me in fetch else None
            self.dpeers.serve_fetches(d, fetch, into)
            if me in fetch:
                meta, why = probe_slot(self.ring_segs[self.ring.index(d)].buf, verify=True)
                if meta is None or int(meta["version"]) != d:
                    raise RecoveryError(f"rank {me}: differential {d} fetched from rank {plan.fetch[me][0]} is "
                                        f"unusable ({why}); no other copy in memory")
                ring_of[d] = self.ring.index(d)
        if mine:
            log.info("tier 2: fetched and verified differentials %d..%d from rank %d", min(mine), max(mine),
                     plan.fetch[me][0])
        return ring_of

    def _replay(self, plan: Any, ring_of: dict[int, int]) -> int:
        """Replay this rank's differentials on the restored base (fused, in batches); every rank then syncs
        parameters from masters if any rank replayed (a collective under ZeRO)."""
        from ..recovery.replay import AdamHyper, StepDiff, replay_fused, replay_naive
        from .differential import replay_targets

        if not plan.replays:
            return 0
        todo = plan.diffs(self.rank)
        stepwise = self.config.differential.replay == "stepwise"
        # Stepwise syncs parameters after every step, a collective under ZeRO: every rank syncs as often as
        # the rank with the longest chain.
        syncs = max(len(plan.diffs(r)) for r in range(self.world)) if stepwise else 1
        t0 = time.perf_counter()
        last_meta = None
        if todo:
            if self.ring_segs[0] is None:  # a restarted process: re-attach to the ring it left behind
                self._open_ring(os.path.getsize(os.path.join(
                    self.dir, segment_name(self.job_id, "diff", self.rank, ring_of[todo[0]]))))
            targets = replay_targets(self.adapter)
            batch_n = 1 if stepwise else self.config.differential.replay_batch
            for b in range(0, len(todo), batch_n):
                batch = []
                for d in todo[b:b + batch_n]:
                    grads, state, header = restore_from(self.ring_segs[ring_of[d]].buf, verify=False)
                    if int(header["version"]) != d:
                        raise RecoveryError(f"rank {self.rank}: ring entry for differential {d} holds {header['version']}")
                    hypers = state["hypers"]
                    if len(hypers) != len(targets):
                        raise RecoveryError(f"rank {self.rank}: differential {d} covers {len(hypers)} of "
                                            f"{len(targets)} master tensors (a skipped step cannot be replayed)")
                    batch.append(StepDiff(grads=[grads[f"grad.{i}"].to(targets[i].param.dtype)
                                                 for i in range(len(targets))],
                                          hypers=[AdamHyper.from_json(hypers[str(i)]) for i in range(len(targets))]))
                    last_meta = state["meta"]
                if stepwise:
                    replay_naive(targets, batch)
                    self.adapter.sync_params_from_masters()
                    syncs -= 1
                else:
                    replay_fused(targets, batch)
        for _ in range(syncs):
            self.adapter.sync_params_from_masters()
        if last_meta is not None:
            self.adapter.restore_meta(last_meta)
            log.info("rank %d: replayed differentials %d..%d on base %d in %.3f s (%s)", self.rank, todo[0], todo[-1],
                     plan.base[self.rank], time.perf_counter() - t0, "stepwise" if stepwise else "fused")
        self._stats["replay_s"] = time.perf_counter() - t0
        return len(todo)

    def slots_nbytes(self, slot: int) -> int:
        path = os.path.join(self.dir, segment_name(self.job_id, "snap", self.rank, slot))
        return os.path.getsize(path)

    # -- misc -------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        st = dict(self._stats)
        for key in ("blocking_s", "copy_s", "seal_s", "replicate_s", "commit_s"):
            vals = sorted(st.pop(key))
            st[f"{key}_median"] = vals[len(vals) // 2] if vals else None
            st[f"{key}_max"] = vals[-1] if vals else None
        st["committed_version"] = self.committed_version
        st["memory_bytes"] = self.memory_bytes()
        return st

    def quiesce(self, timeout_s: float = 10.0) -> None:
        """Hot-swap: stop snapshotting. Waits (bounded) until the in-flight copy is done, so no stale worker
        writes into a slot the next manager will use; replication of that version may fail with the dead
        group, which is expected and not raised."""
        self.active = False
        job = self._inflight
        if job is not None:
            job.copied.wait(timeout_s)
            deadline = time.time() + timeout_s
            while self.latest is None or self.latest[0] != job.snap.version:
                if job.done.is_set() or time.time() > deadline:
                    break
                time.sleep(0.01)
        if self._thread is not None:
            self._queue.put(None)
        self._thread = None

    def wait_idle(self) -> None:
        if self._inflight is not None:
            self._inflight.done.wait(self.config.replication.timeout_s)
        self._raise_worker_error()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.config.replication.timeout_s)
        self._thread = None


def _pin_for_cuda(seg: ShmSegment) -> None:
    """Page-lock a slot so device-to-host copies on the side stream are truly asynchronous (pageable memory
    would make every copy synchronous and stage it through a driver bounce buffer). No-op without CUDA."""
    if not torch.cuda.is_available():
        return
    t = seg.tensor()
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of %s failed (error %s): snapshot copies fall back to pageable memory",
                    seg.name, int(rc))


def _header_len(seg: ShmSegment) -> int:
    import struct

    return struct.unpack("<Q", bytes(seg.buf[8:16]))[0]


def _simulated_node(config: DeadpoolConfig) -> str | None:
    n = config.local.simulate_nodes
    if not n or os.environ.get("DEADPOOL_NODE"):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world % n:
        raise ValueError(f"deadpool config: deadpool.local.simulate_nodes={n} must divide the {local_world} "
                         "processes per host")
    return f"{node_name()}-sim{local_rank // (local_world // n)}"
