"""The restore executor of the memory tiers (``SnapshotManager.restore_latest``): every rank, collective, main thread.

One executor runs every plan of the planner (:mod:`.plan`), in one loop:

1. **observe**: an elastic restore's census of each node's directory (once); this world's reports of what each
   rank holds (own slots and ring, replicas held for others), all-gathered as JSON;
2. **plan** (pure, the same on every rank): :class:`.plan.RestorePlanner`;
3. **obtain and check before use**: a same-size plan fetches what a rank lost from its holder and checks the copy
   each rank restores from; an elastic plan checks every copy its providers will serve. Every rank learns every
   refusal; a refused copy is excluded (a same-size restore scans again with every checksum, an elastic one
   leaves the file out) and the loop plans again;
4. **apply**: copy into the live state (a same-size plan: then replay the differentials; an elastic plan: run
   the moves and assemble the new partitions, :mod:`.reshard`).

The data flow is drawn in docs/architecture.md ("Data flow of a recovery after a restart").
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..cluster.comm import allgather_json
from ..config import DeadpoolConfig
from ..recovery.reshard import REPLICATED, ReplicatedLayout
from ..recovery.timeline import write_event
from ..replicate.peer import PeerReplicator
from .differential import DiffRing
from .format import StreamVerifier, header_len_of, tensor_checksum
from .late import LateState
from .plan import (
    MAX_ELASTIC_ROUNDS,
    Copy,
    ElasticPlan,
    Fresh,
    KeepBase,
    NoCommonVersionError,
    RankReport,
    RecoveryError,
    RestorePlan,
    RestorePlanner,
    SameSizePlan,
)
from .reshard import assemble, assemble_whole
from .slots import probe_received, restore_from
from .state import RankStateAdapter
from .stats import SnapshotStats
from .tier1 import DIFF_KIND, SLOT_KIND, OwnCopies, TierOneStore

log = logging.getLogger("deadpool_ext")


def _unusable(p: dict[str, Any]) -> str:
    """A copy refused by the check before use, as the log and the error name it."""
    what = (f"replica of step {p['version']} fetched from rank {p['holder']}" if p["from"] == "peer"
            else f"tier-1 slot {p['slot']} of step {p['version']}")
    return f"rank {p['rank']}: {what} is unusable ({p['why']})"


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore left in place, for the write path: the version restored, the base it came from and where
    that base now lies (None after an elastic restore: no slot of the new world holds it), the differentials
    this rank holds (version -> ring entry)."""

    version: int
    base: int
    latest: tuple[int, int] | None
    ring_of: dict[int, int]


class RestoreExecutor:
    """Runs one restore. Every collaborator is passed in; the executor owns none of them."""

    def __init__(self, *, adapter: RankStateAdapter, config: DeadpoolConfig, rank: int, world: int, node: str,
                 job_id: str, group: Any, store: TierOneStore, peers: PeerReplicator, dpeers: PeerReplicator | None,
                 ring: DiffRing, differential: bool, late: LateState | None, stats: SnapshotStats,
                 elastic: bool) -> None:
        self.adapter, self.config, self.rank, self.world, self.node = adapter, config, rank, world, node
        self.job_id, self.group, self.store, self.peers, self.dpeers = job_id, group, store, peers, dpeers
        self.ring, self.differential, self.late, self.stats, self.elastic = ring, differential, late, stats, elastic
        self._replayed_header: dict[str, Any] | None = None
        self._parts = (0.0, 0.0)  # seconds of (plan, obtain) of the same-size restore that is applied

    # -- observe ------------------------------------------------------------------------------------------
    def scan(self, verify: bool) -> tuple[RankReport, OwnCopies]:
        """What this rank holds: own slots and ring entries, replicas held for others. ``verify``: checksums
        of every buffer (else headers only: complete, sealed, which version)."""
        own = self.store.scan(world=self.world, verify=verify, ring=self.differential)
        report = RankReport(rank=self.rank, local=own.bases, local_diffs=own.diffs)
        report.replicas = self.peers.scan(verify=verify, world=self.world)
        if self.dpeers is not None:
            report.replica_diffs = self.dpeers.scan(verify=verify, world=self.world)
        return report, own

    def _planner(self, newer_than: int | None) -> RestorePlanner:
        if not self.elastic:
            return RestorePlanner(world=self.world, newer_than=newer_than)
        new_json = self.adapter.partition_layout()
        # A replicated layout names each rank's shard: every rank needs all of the new world's (one exchange).
        news_replicated = ([ReplicatedLayout.from_json(j) for j in allgather_json(new_json, group=self.group)]
                           if isinstance(new_json, dict) and new_json.get("rule") == REPLICATED else None)
        why = getattr(self.adapter, "why_no_layout", lambda: "")() if new_json is None else ""
        return RestorePlanner(world=self.world, newer_than=newer_than, elastic_allowed=True, new_layout=new_json,
                              news_replicated=news_replicated, why_no_layout=why)

    def _census(self) -> list[list[Copy]]:
        """Every node's copies (its first rank reports them), all-gathered."""
        nodes = allgather_json(self.node, group=self.group)
        reporter = nodes.index(self.node) == self.rank
        return allgather_json(self.store.census() if reporter else [], group=self.group)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, newer_than: int | None) -> Restored | None:
        """Collective. Restore the newest version every rank can obtain; None when there is none, or none newer
        than ``newer_than`` (a tier-3 base already loaded)."""
        t0 = time.perf_counter()
        census = self._census() if self.elastic else []
        planner = self._planner(newer_than)
        verify = self.config.snapshot.verify_on_restore
        # Checksums only of what is used: every rank verifies the copy it restores from (its own slot, or the
        # blob it fetched) and all ranks agree that every one of them was clean before anything is copied in.
        # If one was not, everyone scans again checking every copy and chooses again, excluding it (the
        # fallback to the next source). Differential mode keeps the full check up front.
        lazy = verify and not self.differential
        # What this restore did, the same on every rank (stats.restore): the outcome, the plan, and every copy
        # refused by the check before use.
        record: dict[str, Any] = {"outcome": None, "refused_before_use": []}
        self.stats.restore = record
        refused: set[tuple[int, str]] = set()
        for _ in range(MAX_ELASTIC_ROUNDS):
            try:
                elastic = planner.elastic(census, refused)
            except RecoveryError as exc:  # the newest state in memory cannot be resharded onto this world
                record.update(outcome="failed", error=str(exc))
                raise
            if isinstance(elastic, KeepBase):
                record.update(outcome="kept_tier3_base", version=elastic.version, tier3_base=elastic.tier3_base)
                if self.rank == 0:
                    log.info("memory tiers hold step %d (a world of %d ranks), not newer than the tier-3 base of "
                             "step %d: keeping the base", elastic.version, elastic.world, elastic.tier3_base)
                return None
            if isinstance(elastic, ElasticPlan):
                problems = [p for p in allgather_json(self._check_served(elastic), group=self.group) if p]
                if problems:
                    refused.update((p["provider"], p["file"]) for p in problems)
                    if self.rank == 0:
                        log.warning("elastic restore of step %d refused before use: %s; choosing again from the other "
                                    "copies", elastic.version, "; ".join(
                                        f"rank {p['rank']}'s copy {p['file']} on rank {p['provider']} ({p['why']})"
                                        for p in problems))
                    continue
                return self._apply_elastic(elastic, refused, newer_than, t0)
            report, own = self.scan(verify=verify and not lazy)
            reports = [RankReport.from_json(r) for r in allgather_json(report.to_json(), group=self.group)]
            try:
                decision = planner.same_size(reports)
            except RecoveryError as exc:
                record.update(outcome="no_common_version" if isinstance(exc, NoCommonVersionError) else "failed",
                              error=str(exc))
                self.store.close_unused()  # the caller may continue without memory (a tier-3 base): a clean start
                raise
            if isinstance(decision, Fresh):
                record["outcome"] = "fresh"
                log.info("no snapshots of job %s in local or peer memory: fresh start", self.job_id)
                self.store.close_unused()
                return None
            if isinstance(decision, KeepBase):
                record.update(outcome="kept_tier3_base", version=decision.version, tier3_base=decision.tier3_base)
                if self.rank == 0:
                    log.info("memory tiers hold step %d, not newer than the tier-3 base of step %d: keeping the base",
                             decision.version, decision.tier3_base)
                self.store.close_unused()
                return None
            t_plan = time.perf_counter()
            problem = self._obtain(decision, own, check=lazy)
            if lazy:
                problems = [p for p in allgather_json(problem, group=self.group) if p]
                if problems:
                    record["refused_before_use"].extend(problems)
                    log.warning("restore of step %d refused before use: %s; checking the checksums of every copy "
                                "and choosing again", decision.version, "; ".join(map(_unusable, problems)))
                    lazy = False
                    continue
            elif problem is not None:
                raise RecoveryError(f"{_unusable(problem)}; no other copy in memory")
            self._parts = (t_plan - t0, time.perf_counter() - t_plan)
            return self._apply_same_size(decision.plan, own, record, newer_than, t0)
        raise NoCommonVersionError(f"elastic restore: every candidate copy was refused after {MAX_ELASTIC_ROUNDS} "
                                   "rounds")

    # -- a same-size plan --------------------------------------------------------------------------------------
    def _obtain(self, decision: SameSizePlan, own: OwnCopies, *, check: bool) -> dict[str, Any] | None:
        """Open the slot this rank restores from (its own, or slot 0 sized for the fetch), run the fetches
        (collective), and check the copy before use where it was fetched or ``check``; the problem, or None."""
        plan, me = decision.plan, self.rank
        if me == 0:
            log.info("restoring step %d: %d rank(s) from own memory, %d from peer replicas %s%s", plan.version,
                     self.world - len(plan.fetch), len(plan.fetch), {r: h for r, (h, _) in sorted(plan.fetch.items())},
                     f"; bases {sorted(set(plan.base.values()))} + differentials replayed up to {plan.version}"
                     if plan.replays else "")
        base = plan.base.get(me, plan.version)
        fetching = me in plan.fetch
        if fetching:
            self.store.open_slots(plan.fetch[me][1])
            slot = 0
        else:
            slot = own.slot_of[base]
            self.store.open_slots(self.store.file_nbytes(SLOT_KIND, slot))
        self._slot = slot
        seg = self.store.slot(slot)
        # A fetched copy's checksums are checked while it arrives (piece by piece); the rest of the check
        # before use (MAGIC, header, decodable) once it is in.
        verifier = StreamVerifier(seg.buf[:plan.fetch[me][1]]) if fetching else None
        self.peers.serve_fetches(plan.version, plan.fetch, seg.tensor() if fetching else None,
                                 versions=plan.base, progress=verifier.advance if verifier else None)
        problem: dict[str, Any] | None = None
        if fetching or check:
            meta, why = probe_received(seg.buf, verifier)
            if meta is None or int(meta["version"]) != base:
                problem = {"rank": me, "version": base, "why": why,
                           **({"from": "peer", "holder": plan.fetch[me][0]} if fetching
                              else {"from": "local", "slot": slot})}
        self._verifier = verifier
        return problem

    def _apply_same_size(self, plan: RestorePlan, own: OwnCopies, record: dict[str, Any], newer_than: int | None,
                         t0: float) -> Restored:
        me = self.rank
        base = plan.base.get(me, plan.version)
        seg = self.store.slot(self._slot)
        if self._verifier is not None:
            early = self.stats.fetch_checked_early = self._verifier.hashed_early / max(1, self._verifier.upto)
            log.info("tier 2: fetched and verified step %d from rank %d (%.0f%% of its bytes checked while the "
                     "rest arrived)", base, plan.fetch[me][0], 100 * early)
        ring_of = self._fetch_diffs(plan, own.ring_of)
        tensors, state, header = restore_from(seg.buf, verify=False)  # verified above (scan, check before use, fetch)
        self.adapter.restore(tensors, state)
        del tensors
        verify_derived(self.adapter, me, header, base)
        replayed = self._replay(plan, ring_of)
        if self.late is not None:  # the framework's step-end state of the version restored (snapshot/late.py)
            self.late.restored(self._replayed_header or header, plan.version)
        self.store.header_reserved = header_len_of(seg.buf)
        self.peers.setup_later(seg.nbytes)  # the replica buffers: made by the worker, off the recovery path
        st = self.stats
        st.restore_s, st.restored_version, st.replayed = time.perf_counter() - t0, plan.version, replayed
        plan_s, obtain_s = self._parts
        st.restore_parts = {"plan_s": round(plan_s, 4), "obtain_s": round(obtain_s, 4),
                            "apply_s": round(st.restore_s - plan_s - obtain_s, 4)}
        st.restored_from = "peer" if me in plan.fetch else "local"
        record.update(outcome="restored", version=plan.version, tier3_base=newer_than,
                      fetched_from={str(r): h for r, (h, _) in sorted(plan.fetch.items())},
                      bases={str(r): plan.base.get(r, plan.version) for r in range(self.world)},
                      fetched_diffs={str(r): sorted(vs) for r, vs in sorted(plan.fetch_diffs.items()) if vs})
        return Restored(version=plan.version, base=base, latest=(base, self._slot), ring_of=ring_of)

    def _fetch_diffs(self, plan: RestorePlan, ring_of: dict[int, int]) -> dict[int, int]:
        """Differentials of ranks restoring from a peer, into their ring (collective over all ranks, in the
        same order everywhere). Returns version -> ring entry of the differentials this rank now holds."""
        me = self.rank
        mine = plan.fetch_diffs.get(me, {})
        if mine:
            ring_of = {}
            self.store.open_ring(max(mine.values()))
        for d in sorted({v for vs in plan.fetch_diffs.values() for v in vs}):
            fetch = {r: (plan.fetch[r][0], vs[d]) for r, vs in plan.fetch_diffs.items() if d in vs}
            entry = self.store.ring_entry(self.ring.index(d)) if me in fetch else None
            assert self.dpeers is not None  # differentials to fetch: differential mode
            check = StreamVerifier(entry.buf[:fetch[me][1]]) if entry is not None else None
            self.dpeers.serve_fetches(d, fetch, entry.tensor() if entry is not None else None,
                                      progress=check.advance if check else None)
            if entry is not None:
                meta, why = probe_received(entry.buf, check)
                if meta is None or int(meta["version"]) != d:
                    raise RecoveryError(f"rank {me}: differential {d} fetched from rank {plan.fetch[me][0]} is "
                                        f"unusable ({why}); no other copy in memory")
                ring_of[d] = self.ring.index(d)
        if mine:
            log.info("tier 2: fetched and verified differentials %d..%d from rank %d", min(mine), max(mine),
                     plan.fetch[me][0])
        return ring_of

    def _replay(self, plan: RestorePlan, ring_of: dict[int, int]) -> int:
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
            if self.store.ring[0] is None:  # a restarted process: re-attach to the ring it left behind
                self.store.open_ring(self.store.file_nbytes(DIFF_KIND, ring_of[todo[0]]))
            targets = replay_targets(self.adapter)
            batch_n = 1 if stepwise else self.config.differential.replay_batch
            for b in range(0, len(todo), batch_n):
                batch = []
                for d in todo[b:b + batch_n]:
                    grads, state, header = restore_from(self.store.ring_entry(ring_of[d]).buf, verify=False)
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
        self.stats.replay_s = time.perf_counter() - t0
        return len(todo)

    # -- an elastic plan ---------------------------------------------------------------------------------------
    def _check_served(self, plan: ElasticPlan) -> dict[str, Any] | None:
        """Checksums of the copies this rank serves (the first refused one reported)."""
        for r in sorted({r for r, _ in plan.moves}):
            provider, b = plan.providers[r]
            if provider != self.rank:
                continue
            why = self.store.check_copy(b["file"], rank=r, version=plan.version)
            if why is not None:
                return {"provider": self.rank, "file": b["file"], "rank": r, "why": why}
        return None

    def _apply_elastic(self, plan: ElasticPlan, refused: set[tuple[int, str]], newer_than: int | None,
                       t0: float) -> Restored:
        me = self.rank
        if me == 0:
            tiers = plan.tiers()
            log.info("elastic: restoring step %d of a world of %d ranks onto %d ranks, resharded from memory "
                     "(%d copies from tier 1, %d from tier 2 replicas; no storage read)", plan.version, plan.world_old,
                     plan.world_new, tiers.count(1), tiers.count(2))
            write_event(event="resharded", version=plan.version, from_world=plan.world_old, to_world=plan.world_new,
                        tier1_copies=tiers.count(1), tier2_copies=tiers.count(2), storage_reads=0)
        if plan.replicated:
            tensors, meta, drawn, memory = assemble_whole(me, self.store.dir, self.peers.transport, plan)
        else:
            tensors, meta, drawn, memory = assemble(me, self.store.dir, self.peers.transport, plan)
        self.adapter.restore_resharded(tensors, meta)
        del tensors
        seconds = time.perf_counter() - t0
        # This rank holds no slot of the new world yet (the first snapshot sizes them as on a fresh start); the
        # restored version counts as committed.
        self.stats.restore = {"outcome": "resharded", "version": plan.version, "from_world": plan.world_old,
                              **memory, "to_world": plan.world_new, "tier3_base": newer_than,
                              "refused_before_use": sorted(f"{p}:{f}" for p, f in refused),
                              "providers": {str(r): [p, b["tier"]] for r, (p, b) in sorted(plan.providers.items())},
                              "drawn_from": drawn}
        st = self.stats
        st.restore_s, st.restored_version, st.restored_from, st.replayed = seconds, plan.version, "resharded", 0
        log.info("rank %d: new %s from old ranks %s in %.2f s", me, "state taken whole" if plan.replicated
                 else "partition assembled", drawn, seconds)
        return Restored(version=plan.version, base=plan.version, latest=None, ring_of={})


def verify_derived(adapter: RankStateAdapter, rank: int, header: dict[str, Any], version: int) -> None:
    """Tensors the restore re-derived (not stored) must hash to what they were at capture."""
    recorded = header.get("derived") or {}
    live = dict(adapter.derived())
    for name, want in sorted(recorded.items()):
        got = tensor_checksum(live[name]) if name in live else None
        if got != want:
            raise RecoveryError(
                f"rank {rank}: {name} re-derived from the restored step {version} does not match its checksum "
                f"at capture ({got} != {want}): this engine's parameters are not the masters cast to their dtype; "
                "set deadpool.snapshot.derive_params to false to capture them")
    if recorded and rank == 0:
        log.info("restore: %d parameter buffer(s) re-derived from the masters and verified against their "
                 "checksums at capture", len(recorded))


def shrink_allowed(config: DeadpoolConfig) -> bool:
    """Whether a restore may reshard from a world of another size: ``--no-spare-policy shrink`` or
    ``deadpool.elastic.no_spare_policy: shrink`` (resolved once, by :func:`deadpool_ext.launcher.keys.
    resolve_no_spare_policy`)."""
    from ..launcher.contract import worker_env
    from ..launcher.keys import resolve_no_spare_policy

    hs = worker_env().hot_swap
    flag = hs.no_spare_policy if hs is not None else None
    return resolve_no_spare_policy(flag, config.elastic.no_spare_policy).policy == "shrink"

