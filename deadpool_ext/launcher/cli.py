"""deadpool-run: a torchrun-like launcher with pre-started spare nodes and runtime hot-swap.

    deadpool-run --nnodes 3 --nproc-per-node 1 --spare-nodes 1 scripts/pretrain_gpt.py \\
        --deepspeed_config configs/gpt_tiny_zero3_cpu.json --train-iters 30 --metrics-out m.jsonl

On one host every node is simulated (its own failure domain: its own shared-memory directory). The launcher:

- serves the coordination store (embedded, token-protected, on ``--host``, loopback by default) and one c10d
  store per generation;
- starts active and spare workers (spares import everything and wait for an assignment);
- watches them: a process that exits non-zero is a crash; one whose heartbeat is older than
  ``--detect-timeout-s`` is hung and is SIGKILLed (fenced);
- on a failure, fences the whole failed node (kills its processes, drops its memory: a lost node), picks a
  spare node, and publishes the next generation's assignment; survivors rebuild their communicators
  in-process and the spare restores the failed ranks' state from peer replicas;
- owns each node's tier-1 shared memory and removes it when the job ends.

No spare left: the job stops with an error naming the failed node (``--no-spare-policy fail``, default), waits
``--spare-wait-s`` for a machine to join as a spare (``wait``; ``deadpool-run --join``, ``join.py``) before
stopping, or continues on fewer data-parallel ranks (``shrink``, ``resize.py``, docs/elastic.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from ..cluster.membership import Assignment, Worker, initial_assignment
from ..memory.shm import job_shm_dir
from ..store.base import StoreAuthError, StoreError, parse_store_endpoints, rendezvous_prefix
from . import contract, keys, values
from .args import (  # noqa: F401 - the command line's names, re-exported for callers of this module
    _LOG_LEVELS,
    MAX_NODES,
    MAX_PROCS_PER_NODE,
    MAX_SECONDS,
    MAX_WORKERS,
    _script_error,
    build_parser,
    check_args,
    malloc_env,
)
from .contract import HotSwapEnv
from .join import JOINED_HOST, JoinNodes
from .lapse import LeaseLapse
from .leader import LeaderElection, LeaseStore, supports_leases
from .resize import ElasticResize
from .watch import HeartbeatWatch

log = logging.getLogger("deadpool_ext.launcher")

TURN_GAP_S = 1.0
"""A coordinator turn later than this after the previous one (normally 0.1 s apart) means the store stalled."""
STORE_TIMEOUT_S = 10.0
"""Request timeout of the launcher's store client: an answer slower than this is an outage (the lease decides)."""


class Supervisor(LeaseLapse, HeartbeatWatch, ElasticResize, JoinNodes):
    def __init__(self, args: argparse.Namespace) -> None:
        for flag in ("nproc_per_node",) if getattr(args, "join", None) else ("nnodes", "nproc_per_node"):
            if getattr(args, flag) < 1:
                raise SystemExit(f"deadpool-run: --{flag.replace('_', '-')} must be >= 1")
        if args.spare_nodes < 0:
            raise SystemExit("deadpool-run: --spare-nodes must be >= 0")
        self.args = args
        self._arena_logged = False
        self.job_id = args.job_id or f"dp{secrets.token_hex(4)}"
        self.token = os.environ.get(contract.STORE_TOKEN) or secrets.token_hex(16)
        self.active_nodes = [f"node{i}" for i in range(args.nnodes)]
        self.spare_nodes = [f"spare{i}" for i in range(args.spare_nodes)]
        self.workers = [Worker(f"{n}.{i}", n, i) for n in self.active_nodes + self.spare_nodes
                        for i in range(args.nproc_per_node)]
        if not 0 <= args.host_rank < args.hosts:
            raise SystemExit(f"deadpool-run: --host-rank {args.host_rank} must be in [0, --hosts {args.hosts})")
        if args.hosts > 1 and (not args.job_id or contract.STORE_TOKEN not in os.environ):
            raise SystemExit("deadpool-run: with --hosts > 1 every launcher needs the same --job-id and the same "
                             "DEADPOOL_STORE_TOKEN in its environment")
        if args.host_rank > 0 and not args.store_url:
            raise SystemExit("deadpool-run: a follower launcher (--host-rank > 0) needs --store-url of the job's store")
        self.leader = args.host_rank == 0
        self.local_nodes = {n for i, n in enumerate(self.active_nodes) if i % args.hosts == args.host_rank} | \
                           {n for j, n in enumerate(self.spare_nodes) if j % args.hosts == args.host_rank}
        self.node_host = {n: i % args.hosts for i, n in enumerate(self.active_nodes)} | \
                         {n: j % args.hosts for j, n in enumerate(self.spare_nodes)}
        if self.joining:  # one node of its own, a follower without a lease (launcher/join.py)
            if not (args.store_url and args.job_id and contract.STORE_TOKEN in os.environ):
                raise SystemExit("deadpool-run: --join needs the job's --store-url, --job-id and its "
                                 "DEADPOOL_STORE_TOKEN in the environment")
            self.active_nodes, self.spare_nodes, self.leader = [], [args.join], False
            self.workers = [Worker(f"{args.join}.{i}", args.join, i) for i in range(args.nproc_per_node)]
            self.local_nodes, self.node_host = {args.join}, {args.join: JOINED_HOST}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.dead_spares: set[str] = set()
        self.election: LeaderElection | None = None  # on an etcd store; None: host 0 leads for good
        self.hosts_seen: set[int] = set()   # every host whose launcher ever held its lease
        self.hosts_now: set[int] = set()    # the hosts whose lease is alive, as of this loop turn
        self.seen_hb: dict[str, float] = {}
        self.spare_hb: dict[str, float] = {}   # live spares' heartbeat times (a store stall leaves them stale too)
        self._stall_logged = False
        self.progress: dict[str, dict[str, Any]] = {}   # worker -> its last heartbeat's progress sample
        self.formed_after = 0.0  # when the current assignment was published (resize: a grow waits for it to form)
        self._all_in_collective_logged = False
        self._last_turn = time.time()
        self._grace_until = 0.0   # epoch seconds: heartbeat-based detection waits after a store outage
        self._reported: set[str] = set()
        self._fenced: set[str] = set()
        self._fence_once = threading.Lock()
        self.started = False  # every local worker spawned: errors from here on are the job's, not start-up's
        try:
            self.timeline = open(args.timeline, "a") if args.timeline else None
        except OSError as exc:
            raise SystemExit(f"deadpool-run: --timeline {args.timeline}: cannot open it for appending: "
                             f"{exc.strerror or exc}") from None
        # A worker's exit wakes the watch loop at once instead of at its next 0.1 s tick: SIGCHLD writes a byte
        # to this pipe (signal.set_wakeup_fd, from C: no Python lock is taken in the handler).
        self._wake_r: int | None = None
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.signal(signal.SIGCHLD, lambda *_: None)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._wake_r = r

    # -- events -------------------------------------------------------------------------------------
    def event(self, **rec: Any) -> None:
        rec.setdefault("time", time.time())
        rec.setdefault("source", "launcher")
        log.info("%s", json.dumps(rec))
        if self.timeline is not None:
            self.timeline.write(json.dumps(rec) + "\n")
            self.timeline.flush()

    # -- processes ----------------------------------------------------------------------------------
    def _spawn(self, w: Worker, role: str) -> None:
        env = dict(os.environ)
        env.pop(contract.NO_SPARE_POLICY, None)  # set below only when this launcher was given the flag
        env.update(HotSwapEnv(store_url=self.store_url, token=self.token, job_id=self.job_id, worker_id=w.worker_id,
                              node=w.node, role=role, launcher_pid=os.getpid(), heartbeat_s=self.args.heartbeat_s,
                              watch_s=self.args.watch_s, shm_root=self.args.shm_root,
                              no_spare_policy=self.args.no_spare_policy or None,
                              spare_slots=getattr(self.args, "spare_slots", "prepare")).to_environ())
        env.update({
            contract.LOCAL_RANK: str(w.local_index), contract.LOCAL_WORLD_SIZE: str(self.args.nproc_per_node),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
            # GPU path: on an NCCL error, abort the communicators but keep the process (it rebuilds in-process).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
        })
        env.update(malloc_env(self.args.malloc_arena_max, os.environ, log=not self._arena_logged))
        self._arena_logged = True
        if self.timeline is not None:
            env[contract.TIMELINE] = os.path.abspath(self.args.timeline)
        for k in (contract.RANK, contract.WORLD_SIZE, contract.MASTER_ADDR, contract.MASTER_PORT,
                  contract.USE_AGENT_STORE):
            env.pop(k, None)
        # Through the runner: the hook on deepspeed.initialize and the process group exist before the script starts.
        self.procs[w.worker_id] = subprocess.Popen([sys.executable, "-m", "deadpool_ext.run", self.args.script,
                                                    *self.args.script_args], env=env)

    def _node_procs(self, node: str) -> list[str]:
        return [w.worker_id for w in self.workers if w.node == node]

    def _kill_node(self, node: str) -> None:
        if node not in self.local_nodes:
            self._fence_remote(node)
            return
        for wid in self._node_procs(node):
            p = self.procs.get(wid)
            if p is not None and p.poll() is None:
                p.kill()
        for wid in self._node_procs(node):
            p = self.procs.get(wid)
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    log.error("worker %s did not die after SIGKILL", wid)

    def _fence_remote(self, node: str) -> None:
        """Ask the launcher of ``node``'s host to kill its processes and drop its memory; wait for the ack, or, on
        an etcd store, for that launcher's lease to lapse (it stops its own workers before the store can expire
        it, so a host whose key is gone runs nothing of the job)."""
        # on etcd, the host's key vanishes at the latest one lease after its launcher's last renewal
        timeout_s = max(15.0, 1.5 * self.args.leader_ttl_s) if self.election is not None else 15.0
        self.store.set(keys.fence(node), keys.MARK)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.store.get(keys.fenced(node)) is not None:
                    return
                if (self.election is not None and self.node_host.get(node, JOINED_HOST) != JOINED_HOST
                        and self.store.get(keys.host(self.node_host[node])) is None):  # a joined node has no lease
                    log.info("node %s: its host %d's lease has lapsed, so its launcher stopped its workers",
                             node, self.node_host[node])
                    return
            except Exception as exc:
                log.warning("fence of %s: %s", node, exc)
            if time.monotonic() > deadline:
                # an unreachable host is as good as fenced for the new generation
                log.warning("no fence acknowledgement from the launcher of %s within %.0fs", node, timeout_s)
                return
            time.sleep(0.05)

    def _drop_memory(self, node: str) -> None:
        if node not in self.local_nodes:
            return  # the node's own launcher drops it when fenced
        shutil.rmtree(job_shm_dir(self.args.shm_root, self.job_id, node), ignore_errors=True)

    # -- stores -------------------------------------------------------------------------------------
    def _drop_rendezvous(self, generation: int) -> None:
        """Remove a dead generation's rendezvous keys (gloo's addresses and counters) from the store."""
        if generation < 0:
            return
        prefix = rendezvous_prefix(generation)
        for key in self.store.list(prefix):
            self.store.delete(key)

    def publish(self, a: Assignment) -> Assignment:
        # master_port 0: the generation's rendezvous is in this store, under the job's token (store/rendezvous.py);
        # no unauthenticated c10d port is served
        a = Assignment.from_json({**a.to_json(), "master_port": 0, "master_addr": self.args.host})
        self.store.set_json(keys.ASSIGNMENT, a.to_json())
        self._drop_rendezvous(a.generation - 2)   # survivors of the generation before may still read theirs
        if a.generation > 0:
            # The notification survivors block on (rebuild.worker): generation g-1 is dead, leave it now.
            self.store.set(keys.generation(a.generation), keys.MARK)
        self.assignment = a
        self.formed_after = time.time()  # the generation has formed once every rank finished a step since
        return a

    # -- main loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        from ..store import connect

        self.server = None
        try:  # from here on whatever was started (store, workers) is stopped again, start-up error or not
            if self.args.store_url:
                self.store_url = self.args.store_url
                if self.leader and self.store_url.startswith("etcd://"):
                    from ..store.connect import etcd_http_endpoints
                    from ..store.etcd import bootstrap_etcd_auth

                    members = etcd_http_endpoints(parse_store_endpoints(self.store_url)[1])
                    for i, member in enumerate(members):  # auth is the cluster's: one member that answers does it
                        try:
                            bootstrap_etcd_auth(member, self.token)
                            break
                        except StoreError as exc:
                            if isinstance(exc, StoreAuthError) or i == len(members) - 1:
                                raise
                            log.warning("etcd member %s: %s; trying the next one", member, exc)
            else:
                from ..store.embedded import EmbeddedStoreServer

                self.server = EmbeddedStoreServer(host=self.args.host, port=self.args.store_port, token=self.token)
                self.server.start()
                self.store_url = self.server.url
            self.store = connect(self.store_url, self.token, self.job_id, STORE_TIMEOUT_S)
            if supports_leases(self.store) and not self.joining:
                self.election = LeaderElection(
                    cast(LeaseStore, self.store),
                    lambda t: cast(LeaseStore, connect(self.store_url, self.token, self.job_id, t)),
                    self.args.host_rank, self.args.leader_ttl_s, on_pause=self._pause, on_resume=self._resume,
                    on_lost=self._self_fence, outage_s=self.args.store_outage_s, host=self.args.host)
            elif self.args.hosts > 1:
                log.warning("--hosts %d on the embedded store: it lives in host 0's launcher, so losing host 0 ends "
                            "the job (no other launcher can take the coordinator role over). Use --store-url "
                            "etcd://... for a job that survives any host (docs/multi-host.md)", self.args.hosts)
            if self.leader:
                if self.election is not None:
                    self._campaign_first()
                a0 = self.publish(initial_assignment(self.workers, self.active_nodes, self.spare_nodes))
                if self.args.no_spare_policy:  # for machines that join later (their workers restore alike)
                    self.store.set_json(keys.LAUNCHER_POLICY, self.args.no_spare_policy)
                self.event(event="start", job_id=self.job_id, generation=0, world_size=a0.world_size,
                           store=self.store_url, active_nodes=self.active_nodes, spare_nodes=self.spare_nodes,
                           hosts=self.args.hosts, host_rank=self.args.host_rank)
            else:
                raw = self.store.wait([keys.ASSIGNMENT], 120.0)[keys.ASSIGNMENT]
                a0 = values.assignment(keys.ASSIGNMENT, raw).assignment
                self.assignment = a0
                if self.joining:
                    self._join_request()
            for w in self.workers:
                if w.node in self.local_nodes:
                    self._spawn(w, "active" if w.worker_id in a0.ranks else "spare")
            self.started = True
            return self._loop()
        finally:
            self._shutdown()

    def _campaign_first(self) -> None:
        """Host 0 takes the coordinator role before the first assignment (a lease left by an earlier launcher of
        this job id lapses within --leader-ttl-s)."""
        from .leader import LEADING, LOST

        election = self.election
        assert election is not None
        deadline = time.monotonic() + 2 * self.args.leader_ttl_s + 5
        while (state := election.tick()) != LEADING:
            holder = election.leader()
            if state == LOST or time.monotonic() > deadline:
                raise RuntimeError(f"host 0 could not take the coordinator role within "
                                   f"{2 * self.args.leader_ttl_s + 5}s (held by {holder}; another launcher of job "
                                   f"{self.job_id} is running?)")
            time.sleep(0.2)

    # -- every launcher, every turn -----------------------------------------------------------------
    def _host_tick(self) -> int | None:
        """This host's part: report its workers' exits, obey fences, keep the lease; an exit code to stop."""
        if self.joining and (rc := self._joiner_tick()) is not None:
            return rc
        if self.election is None and self.leader:
            self._repair_tick()
            return None  # one coordinator for good, on this host: it sees its own processes directly
        if self.election is not None:
            from .leader import LOST, PAUSED

            state = self.election.tick()
            if state == LOST:
                self._self_fence(self.election.lost_why or "its lease is no longer valid")
            if state == PAUSED:
                return None  # workers stopped until the store answers again (self._pause / self._resume)
            try:
                self.hosts_now = self._hosts_alive()   # read once per turn; the coordinator's part uses it too
                self.hosts_seen |= self.hosts_now
            except Exception as exc:
                log.debug("host list: %s", exc)
        try:
            if self.store.get(keys.FINISHED) is not None:
                return 0
            published = self.values.get(keys.ASSIGNMENT, values.assignment)
        except Exception as exc:  # the store unreachable for a moment: the lease decides when that is fatal
            log.debug("store: %s", exc)
            return None
        if published is not None and published.stop:
            return 1
        for wid, p in self.procs.items():
            rc = p.poll()
            if rc is not None and wid not in self._reported:
                # every exit, a clean one too: a worker that finished while the store was unreachable could not
                # record done/<worker>, and the coordinator must not take its silence for a hang
                self.store.set_json(keys.exit_of(wid), keys.exit_value(rc))
                self._reported.add(wid)   # only once it is written: an outage leaves it for the next turn
        for node in self.local_nodes - self._fenced:
            if self.store.get(keys.fence(node)) is not None:
                self._fenced.add(node)
                for wid in self._node_procs(node):
                    self._reported.add(wid)
                    if self.procs[wid].poll() is None:
                        self.procs[wid].kill()
                shutil.rmtree(job_shm_dir(self.args.shm_root, self.job_id, node), ignore_errors=True)
                self.store.set(keys.fenced(node), keys.MARK)
        self._repair_tick()
        return None

    def _leads(self) -> bool:
        if self.election is None:
            return bool(self.leader)
        return self.election.leading

    def _take_over(self) -> None:
        """This launcher holds the coordinator role now (host 0 at the start, or another launcher after the
        coordinator was lost): the job's state comes from the store."""
        self._last_turn = time.time()
        published = self.values.get(keys.ASSIGNMENT, values.assignment)
        if published is None:  # missing or unusable (logged): the next turn tries again, the loop goes on
            raise values.BadValue(keys.ASSIGNMENT, "took the coordinator role over but the store holds no usable "
                                                "assignment")
        self.assignment = published.assignment
        self.formed_after = time.time()  # not known when it formed: a step on every rank from now on tells
        self.dead_spares |= set(self.values.get(keys.DEAD_SPARES, values.node_list) or [])
        self.seen_hb.clear()
        self.event(event="leader", host_rank=self.args.host_rank, generation=self.assignment.generation,
                   took_over_at=time.time(), hosts_alive=sorted(self._hosts_alive()))
        if self.args.host_rank != 0 or self.assignment.generation > 0:
            log.warning("host %d took the coordinator role over (generation %d)", self.args.host_rank,
                        self.assignment.generation)

    def _hosts_alive(self) -> set[int]:
        return {i for k in self.store.list(keys.HOSTS) if (i := values.host_index(k)) is not None}

    def _sleep_until_child_exit(self, timeout_s: float) -> None:
        if self._wake_r is None:
            time.sleep(timeout_s)
            return
        ready, _, _ = select.select([self._wake_r], [], [], timeout_s)
        if ready:
            try:
                while os.read(self._wake_r, 512):
                    pass
            except BlockingIOError:
                pass

    def _loop(self) -> int:
        """Every launcher: this host's part each turn; the coordinator's part while it holds the role."""
        led_before = self.leader and self.election is None
        while True:
            self._sleep_until_child_exit(0.1)
            try:
                rc = self._host_tick()
            except StoreError as exc:
                log.warning("host %d: %s", self.args.host_rank, exc)
                continue
            if rc is not None:
                return rc
            if not self._leads():
                led_before = False
                continue
            try:
                if not led_before:
                    self._take_over()
                    led_before = True
                rc = self._coordinate()
            except values.BadValue as exc:  # a value no schema takes: said once a minute per key, never fatal
                self.values.bad(exc)
                continue
            except StoreError as exc:  # the store gone for a moment: the lease decides what that means
                log.warning("coordinator: %s", exc)
                continue
            if rc is not None:
                return rc

    def _coordinate(self) -> int | None:
        """One turn of the coordinator: completion, fatal reports, crashes, hangs, lost hosts; a failure gets
        the failed nodes fenced and the next generation published."""
        seen_hb = self.seen_hb
        a = self._join_tick(self.assignment)
        active = set(a.ranks)
        rcs: dict[str, int | None] = {w.worker_id: None for w in self.workers}
        rcs.update({wid: p.poll() for wid, p in self.procs.items()})
        rcs.update(self.values.items(keys.EXITS, values.exit_rc, values.WORKER_RE))
        if all(rcs.get(w) == 0 or self.store.get(keys.done(w)) is not None for w in active):
            self.store.set(keys.FINISHED, keys.MARK)
            self.event(event="finished", generation=a.generation)
            return 0
        msg = self.values.get(keys.FATAL, values.fatal_text)
        if msg is not None:
            self.event(event="stopped", reason=msg)
            print(f"deadpool-run: stopping the job, a worker reports unrecoverable state:\n{msg}",
                  file=sys.stderr, flush=True)
            return 1
        failed: dict[str, str] = {}
        for wid in active:
            rc = rcs.get(wid)
            if rc is not None and rc != 0:
                failed[wid] = f"exited with {'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}"
        lost_hosts: set[int] = set()
        if self.election is not None:
            lost_hosts = self.hosts_seen - self.hosts_now
            for wid in active - set(failed):
                h = self.node_host.get(a.nodes[wid], JOINED_HOST)
                if h in lost_hosts:
                    failed[wid] = f"host {h} lost (its launcher's lease lapsed)"
        now = time.time()
        gap = now - self._last_turn
        self._last_turn = now
        if gap > TURN_GAP_S:
            # This turn came late (the store was slow for everyone, e.g. an etcd member lost and its leader being
            # re-elected): no worker could write a heartbeat meanwhile either, so staleness says nothing yet.
            self._grace_until = max(self._grace_until, now + self.args.detect_timeout_s)
            log.info("coordinator: %.1fs since its last turn (store slow); heartbeats get %.0fs of grace", gap,
                     self.args.detect_timeout_s)
        for wid in active - set(failed):
            if rcs.get(wid) is not None:
                continue
            if self.store.get(keys.done(wid)) is not None:
                continue
            beat = self.values.get(keys.heartbeat(wid), values.heartbeat)
            if beat is not None:
                seen_hb[wid] = float(beat["t"])
                self.progress[wid] = beat
            if wid in seen_hb and now - seen_hb[wid] > self.args.detect_timeout_s:
                failed[wid] = f"hung: no heartbeat for {now - seen_hb[wid]:.1f}s (SIGKILLed to fence it)"
        self._store_stall(active, now, any(v.startswith("hung") for v in failed.values()))
        if now < self._grace_until:  # the store was unreachable for everyone: heartbeats restart
            for wid in list(failed):
                if failed[wid].startswith("hung"):
                    del failed[wid]
        else:
            failed.update(self._stalled(active - set(failed), now))
        spares_lost = False
        for w in self.workers:
            if w.node in self.spare_nodes and w.node not in self.dead_spares and w.worker_id not in active:
                if rcs[w.worker_id] is not None or self.node_host[w.node] in lost_hosts:
                    self.dead_spares.add(w.node)
                    spares_lost = True
                    why = (f"host {self.node_host[w.node]} lost" if rcs[w.worker_id] is None
                           else f"exited with {rcs[w.worker_id]}")
                    self._kill_node(w.node)
                    self.event(event="spare_lost", node=w.node, detail=why)
        if spares_lost and self.election is not None:
            self.store.set_json(keys.DEAD_SPARES, sorted(self.dead_spares))
        if not failed:
            self._grow_tick(a)
            return None
        failed_nodes = {a.nodes[w] for w in failed}
        self.event(event="failure", generation=a.generation, detected_at=now,
                   failed={w: {"rank": a.ranks[w], "node": a.nodes[w], "why": why} for w, why in failed.items()})
        for node in failed_nodes:
            self._kill_node(node)
            if not self.args.keep_memory_on_failure:
                self._drop_memory(node)
        for wid in list(seen_hb):
            if a.nodes.get(wid) in failed_nodes:
                del seen_hb[wid]
        self.progress.clear()   # every rank's counters restart with the next generation's first step
        self._all_in_collective_logged = False
        new = self._next_assignment(a, failed_nodes)
        if new is None:
            return 1
        new = self.publish(new)
        for wid in new.ranks:
            seen_hb.pop(wid, None)  # grace: a spare's first heartbeat after taking over
        self.event(event="assignment", generation=new.generation, replaced=new.replaced,
                   published_at=time.time(), spares_left=list(new.spares), host_rank=self.args.host_rank)
        return None

    def _shutdown(self) -> None:
        if self.election is not None:
            self.election.close()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        for node in self.local_nodes:
            self._drop_memory(node)
        if self.server is not None:
            self.server.stop()
        if self.timeline is not None:
            self.timeline.close()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    level = os.environ.get(contract.LOG_LEVEL, "INFO").upper()
    if level not in _LOG_LEVELS:
        print(f"deadpool-run: {contract.LOG_LEVEL}={os.environ[contract.LOG_LEVEL]!r}: must be one of "
              f"{', '.join(_LOG_LEVELS)}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=level, format="[deadpool-run] %(levelname)s %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if getattr(args, "host_plan", None):
        log.info("%s", args.host_plan)
    sup = Supervisor(args)
    try:
        return sup.run()
    except Exception as exc:
        # Before every worker runs, an error is the set-up's (a port taken, a store unreachable): one line.
        # Afterwards, or with --debug / DEADPOOL_LOG_LEVEL=DEBUG, the traceback as before.
        if sup.started or args.debug or level == "DEBUG":
            raise
        print(f"deadpool-run: cannot start the job: {_one_line(exc)} (--debug shows the traceback)",
              file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
