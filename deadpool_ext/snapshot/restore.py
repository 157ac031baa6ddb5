"""The restore protocol of the memory tiers (``SnapshotManager.restore_latest``), every rank, collective.

Kept apart from the write path (:mod:`.manager`): what a rank holds (``_scan``), the agreement on a version,
fetches from peers, the check before use, the copy into the live state, the replay of differentials. The
data flow is drawn in docs/architecture.md ("Data flow of a recovery after a restart").
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ..cluster.comm import allgather_json
from ..memory.shm import ShmSegment, segment_name
from ..recovery.agree import NoCommonVersionError, RankReport, RecoveryError, choose_version
from .format import StreamVerifier, header_len_of, tensor_checksum
from .slots import probe_received, probe_slot, restore_from

if TYPE_CHECKING:
    from ..config import DeadpoolConfig
    from ..memory.pinned import HostPinner
    from ..replicate.peer import PeerReplicator
    from .differential import DiffRing, GradTap
    from .late import LateState
    from .state import RankStateAdapter

log = logging.getLogger("deadpool_ext")


def _opened(seg: ShmSegment | None) -> ShmSegment:
    """A segment that ``_open_slots`` / ``_open_ring`` opened before this use."""
    assert seg is not None, "shared-memory segment used before it was opened"
    return seg


def _unusable(p: dict[str, Any]) -> str:
    """A copy refused by the check before use, as the log and the error name it."""
    what = (f"replica of step {p['version']} fetched from rank {p['holder']}" if p["from"] == "peer"
            else f"tier-1 slot {p['slot']} of step {p['version']}")
    return f"rank {p['rank']}: {what} is unusable ({p['why']})"


class MemoryRestore:
    """The restore half of :class:`deadpool_ext.snapshot.manager.SnapshotManager` (a mixin: it works on the
    manager's slots, ring and replicators)."""

    adapter: RankStateAdapter
    config: DeadpoolConfig
    rank: int
    world: int
    job_id: str
    dir: str
    group: Any
    peers: PeerReplicator
    dpeers: PeerReplicator | None
    tap: GradTap | None
    ring: DiffRing
    slots: list[ShmSegment | None]
    ring_segs: list[ShmSegment | None]
    header_reserved: int
    latest: tuple[int, int] | None
    committed_version: int | None
    committed_base: int | None
    _last_version: int | None
    _stats: dict[str, Any]
    _pinner: HostPinner
    late: LateState | None
    """The framework's state posted after each step (``snapshot/late.py``), handed back with the version restored."""
    _replayed_header: dict[str, Any] | None
    reshard_memory: dict[str, int]
    """What the last elastic restore held beyond the state (``snapshot/reshard.py``)."""

    if TYPE_CHECKING:  # provided by SnapshotManager
        def _open_slots(self, nbytes: int) -> None: ...

        def _open_ring(self, nbytes: int) -> None: ...

    def slots_nbytes(self, slot: int) -> int:
        path = os.path.join(self.dir, segment_name(self.job_id, "snap", self.rank, slot))
        return os.path.getsize(path)

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
            what = "slot" if kind == "snap" else "differential ring entry"
            try:
                seg = ShmSegment.open(os.path.basename(path), root=self.dir)
            except OSError as exc:  # refused (not this user's, a link) or gone: not a copy to restore from
                log.warning("tier 1: %s %d of rank %d unusable (%s); falling back to the next source", what, i,
                            self.rank, exc)
                continue
            meta, why = probe_slot(seg.buf, verify=verify, restorable=True)
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
        if self.elastic():
            from .reshard import elastic_restore

            handled, version = elastic_restore(self, newer_than)  # type: ignore[arg-type]  # self is the manager
            if handled:
                return version
        t0 = time.perf_counter()
        verify = self.config.snapshot.verify_on_restore
        # Checksums only of what is used: every rank verifies the copy it restores from (its own slot, or the
        # blob it fetched) and all ranks agree that every one of them was clean before anything is copied in.
        # If one was not, everyone scans again checking every copy and chooses again, excluding it (the
        # fallback to the next source). Differential mode keeps the full check up front.
        lazy = verify and not self.tap and self.dpeers is None
        # What this restore did, the same on every rank (stats()["restore"]): the outcome, the plan, and every
        # copy refused by the check before use.
        record: dict[str, Any] = {"outcome": None, "refused_before_use": []}
        self._stats["restore"] = record
        while True:
            report, slot_of, ring_of = self._scan(verify=verify and not lazy)
            reports = [RankReport.from_json(r) for r in allgather_json(report.to_json(), group=self.group)]
            try:
                plan = choose_version(reports)
            except RecoveryError as exc:
                record.update(outcome="no_common_version" if isinstance(exc, NoCommonVersionError) else "failed",
                              error=str(exc))
                self._unopened()  # the caller may continue without memory (a tier-3 base): a clean start
                raise
            if plan is None:
                record["outcome"] = "fresh"
                log.info("no snapshots of job %s in local or peer memory: fresh start", self.job_id)
                self._unopened()
                return None
            if newer_than is not None and plan.version <= newer_than:
                record.update(outcome="kept_tier3_base", version=plan.version, tier3_base=newer_than)
                if self.rank == 0:
                    log.info("memory tiers hold step %d, not newer than the tier-3 base of step %d: keeping the base",
                             plan.version, newer_than)
                self._unopened()
                return None
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
            seg = _opened(self.slots[slot])
            # A fetched copy's checksums are checked while it arrives (piece by piece); the rest of the check
            # before use (MAGIC, header, decodable) once it is in.
            check = StreamVerifier(seg.buf[:plan.fetch[me][1]]) if fetching else None
            self.peers.serve_fetches(plan.version, plan.fetch, seg.tensor() if fetching else None,
                                     versions=plan.base, progress=check.advance if check else None)
            problem: dict[str, Any] | None = None
            if fetching or lazy:
                meta, why = probe_received(seg.buf, check)
                if meta is None or int(meta["version"]) != base:
                    problem = {"rank": me, "version": base, "why": why,
                               **({"from": "peer", "holder": plan.fetch[me][0]} if fetching
                                  else {"from": "local", "slot": slot})}
            if lazy:
                problems = [p for p in allgather_json(problem, group=self.group) if p]
                if problems:
                    record["refused_before_use"].extend(problems)
                    log.warning("restore of step %d refused before use: %s; checking the checksums of every copy "
                                "and choosing again", plan.version, "; ".join(map(_unusable, problems)))
                    lazy = False
                    continue
            elif problem is not None:
                raise RecoveryError(f"{_unusable(problem)}; no other copy in memory")
            if check is not None:
                early = self._stats["fetch_checked_early"] = check.hashed_early / max(1, check.upto)
                log.info("tier 2: fetched and verified step %d from rank %d (%.0f%% of its bytes checked while the "
                         "rest arrived)", base, plan.fetch[me][0], 100 * early)
            break
        ring_of = self._fetch_diffs(plan, ring_of)
        tensors, state, header = restore_from(seg.buf, verify=False)  # verified above (scan, check before use, fetch)
        self.adapter.restore(tensors, state)
        del tensors
        self._verify_derived(header, base)
        self._replayed_header = None
        replayed = self._replay(plan, ring_of)
        if self.late is not None:  # the framework's step-end state of the version restored (snapshot/late.py)
            self.late.restored(self._replayed_header or header, plan.version)
        self.latest = (base, slot)
        self.committed_version = plan.version
        self.committed_base = base
        self.ring.versions = {self.ring.index(v): v for v in ring_of}
        self._last_version = None  # the next snapshot is a base: the chain restarts from the restored state
        self.header_reserved = header_len_of(seg.buf)
        self.peers.setup(seg.nbytes)
        self._stats["restore_s"] = time.perf_counter() - t0
        self._stats["restored_version"] = plan.version
        self._stats["restored_from"] = "peer" if fetching else "local"
        self._stats["replayed"] = replayed
        record.update(outcome="restored", version=plan.version, tier3_base=newer_than,
                      fetched_from={str(r): h for r, (h, _) in sorted(plan.fetch.items())},
                      bases={str(r): plan.base.get(r, plan.version) for r in range(self.world)},
                      fetched_diffs={str(r): sorted(vs) for r, vs in sorted(plan.fetch_diffs.items()) if vs})
        return plan.version

    def elastic(self) -> bool:
        """Whether a restore may reshard from a world of another size: ``--no-spare-policy shrink`` or
        ``deadpool.elastic.no_spare_policy: shrink``."""
        from ..launcher.contract import worker_env
        from ..launcher.keys import resolve_no_spare_policy

        hs = worker_env().hot_swap
        flag = hs.no_spare_policy if hs is not None else None
        return resolve_no_spare_policy(flag, self.config.elastic.no_spare_policy).policy == "shrink"

    def note_resharded(self, version: int, record: dict[str, Any], drawn: list[int], seconds: float) -> None:
        """After an elastic restore: this rank holds no slot of the new world yet (the first snapshot sizes them
        as on a fresh start); the restored version counts as committed."""
        self._stats["restore"] = {**record, "drawn_from": drawn}
        self.latest = None
        self.committed_version = version
        self.committed_base = version
        self._last_version = None
        self.ring.versions = {}
        self._stats["restore_s"] = seconds
        self._stats["restored_version"] = version
        self._stats["restored_from"] = "resharded"
        self._stats["replayed"] = 0

    def _unopened(self) -> None:
        """No restore after all (a copy refused before use left no common version): close slots an earlier
        attempt of this restore opened, so the first snapshot sizes them as on a fresh start."""
        if not self.header_reserved:
            for i in (0, 1):
                seg = self.slots[i]
                if seg is not None:
                    self._pinner.close(seg)  # unregistered (GPU) before it is unmapped
                    self.slots[i] = None

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
            into = _opened(self.ring_segs[self.ring.index(d)]).tensor() if me in fetch else None
            assert self.dpeers is not None  # differentials to fetch: differential mode
            entry = _opened(self.ring_segs[self.ring.index(d)]).buf if me in fetch else None
            check = StreamVerifier(entry[:fetch[me][1]]) if entry is not None else None
            self.dpeers.serve_fetches(d, fetch, into, progress=check.advance if check else None)
            if entry is not None:
                meta, why = probe_received(entry, check)
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
                    grads, state, header = restore_from(_opened(self.ring_segs[ring_of[d]]).buf, verify=False)
                    if int(header["version"]) != d:
                        raise RecoveryError(f"rank {self.rank}: ring entry for differential {d} "
                                            f"holds {header['version']}")
                    hypers = state["hypers"]
                    if len(hypers) != len(targets):
                        raise RecoveryError(f"rank {self.rank}: differential {d} covers {len(hypers)} of "
                                            f"{len(targets)} master tensors (a skipped step cannot be replayed)")
                    batch.append(StepDiff(grads=[grads[f"grad.{i}"].to(targets[i].param.dtype)
                                                 for i in range(len(targets))],
                                          hypers=[AdamHyper.from_json(hypers[str(i)]) for i in range(len(targets))]))
                    last_meta, self._replayed_header = state["meta"], header
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
