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
stopping, or continues on fewer data-parallel ranks (``shrink``, docs/elastic.md). Every such rule is
``decide.py``'s; ``coordinator.py`` observes and acts around it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from ..cluster.assignment import Assignment, Worker
from ..cluster.membership import initial_assignment
from ..store.base import StoreAuthError, StoreError, parse_store_endpoints
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
    is_wildcard,
    malloc_env,
    worker_arena_max,
)
from .coordinator import Coordinator, publish
from .decide import JOINED_HOST, CoordinatorState, Roster, Settings, taken_over
from .drain import LauncherDrain
from .hostlist import place_nodes
from .join import Joiner, count_start
from .lapse import LeaseLapse
from .leader import LeaderElection, LeaseStore, supports_leases
from .local import LocalNodes
from .metrics import MetricsServer, private_timeline
from .resize import repair_tick

log = logging.getLogger("deadpool_ext.launcher")

STORE_TIMEOUT_S = 10.0
"""Request timeout of the launcher's store client: an answer slower than this is an outage (the lease decides)."""
LEADER_STORE_WAIT_S = 60.0
"""How long a follower waits for host 0's embedded store to answer: srun and a hostfile's ssh start every launcher
at once, so the followers' first connect may come before host 0 listens."""


class Supervisor:
    """One launcher, composed of: this host's nodes (``local.LocalNodes``), its lease's callbacks
    (``lapse.LeaseLapse``), a joining machine's side (``join.Joiner``, with ``--join``) and, while it holds the
    role, the coordinator (``coordinator.Coordinator``: observe -> ``decide.py`` -> act)."""

    def __init__(self, args: argparse.Namespace) -> None:
        for flag in ("nproc_per_node",) if getattr(args, "join", None) else ("nnodes", "nproc_per_node"):
            if getattr(args, flag) < 1:
                raise SystemExit(f"deadpool-run: --{flag.replace('_', '-')} must be >= 1")
        if args.spare_nodes < 0:
            raise SystemExit("deadpool-run: --spare-nodes must be >= 0")
        self.args = args
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
        self.node_host = place_nodes(self.active_nodes, self.spare_nodes, args.hosts)
        self.local_nodes = {n for n, h in self.node_host.items() if h == args.host_rank}
        self.joiner: Joiner | None = None
        if getattr(args, "join", None):  # one node of its own, a follower without a lease (launcher/join.py)
            if not (args.store_url and args.job_id and contract.STORE_TOKEN in os.environ):
                raise SystemExit("deadpool-run: --join needs the job's --store-url, --job-id and its "
                                 "DEADPOOL_STORE_TOKEN in the environment")
            self._as_joiner(args.join)
        self._local_nodes()
        self.drain = LauncherDrain(getattr(args, "preempt_grace_s", None), args.host_rank, self.event)
        self.coordinator: Coordinator | None = None   # while this launcher holds the coordinator role
        self.election: LeaderElection | None = None  # on an etcd store; None: host 0 leads for good
        self.hosts_seen: set[int] = set()   # every host whose launcher ever held its lease
        self.hosts_now: set[int] = set()    # the hosts whose lease is alive, as of this loop turn
        self._values: values.StoreValues | None = None
        self._started_at = time.time()   # the coordinator's first turn is judged late against it
        self.started = False  # every local worker spawned: errors from here on are the job's, not start-up's
        self.metrics: MetricsServer | None = None
        self._drop_timeline: Callable[[], None] | None = None
        if getattr(args, "metrics_port", None) is not None and not args.timeline:  # the ledger reads a timeline
            args.timeline, self._drop_timeline = private_timeline(self.job_id)
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

    def _as_joiner(self, name: str) -> None:
        """This launcher runs one node of its own, ``name``, as a machine joining the job (``launcher/join.py``)."""
        self.args.join = name
        self.active_nodes, self.spare_nodes, self.leader = [], [name], False
        self.workers = [Worker(f"{name}.{i}", name, i) for i in range(self.args.nproc_per_node)]
        self.local_nodes, self.node_host = {name}, {name: JOINED_HOST}
        self.joiner = Joiner(self.args, self.job_id)

    def _local_nodes(self) -> None:
        self.nodes = LocalNodes(self.args, self.job_id, self.token, self.workers, self.local_nodes, self.event)
        self.lapse = LeaseLapse(self.nodes, self.args, self.event)

    @property
    def values(self) -> values.StoreValues:
        """The launcher's one reader of store values, for the current ``self.store`` (a bad value is logged once a
        minute per key, whoever reads it)."""
        if self._values is None or self._values.store is not self.store:
            self._values = values.StoreValues(self.store)
        return self._values

    # -- events -------------------------------------------------------------------------------------
    def event(self, **rec: Any) -> None:
        rec.setdefault("time", time.time())
        rec.setdefault("source", "launcher")
        log.info("%s", json.dumps(rec))
        if self.timeline is not None:
            self.timeline.write(json.dumps(rec) + "\n")
            self.timeline.flush()

    # -- stores -------------------------------------------------------------------------------------
    def publish(self, a: Assignment) -> Assignment:
        """Write generation ``a`` with this launcher's rendezvous address (master_port 0: the generation's
        rendezvous is in the job's store, under its token, store/rendezvous.py; no unauthenticated c10d port is
        served)."""
        a = dataclasses.replace(a, master_port=0, master_addr=self.args.host)
        publish(self.store, a)
        return a

    def settings(self) -> Settings:
        args = self.args
        return Settings(detect_timeout_s=args.detect_timeout_s, progress_timeout_s=args.progress_timeout_s,
                        store_outage_s=args.store_outage_s, spare_wait_s=args.spare_wait_s,
                        nproc_per_node=args.nproc_per_node, policy_flag=args.no_spare_policy or None,
                        keep_memory_on_failure=bool(args.keep_memory_on_failure), leased=self.election is not None,
                        master_addr=args.host, host_rank=args.host_rank, suspect_age_s=args.suspect_age_s)

    def coordinate(self, assignment: Assignment) -> Coordinator:
        """This launcher holds the coordinator role from now on, the job at ``assignment``: its first turn."""
        roster = Roster(workers=tuple(self.workers), active_nodes=tuple(self.active_nodes),
                        spare_nodes=tuple(self.spare_nodes), node_host=dict(self.node_host))
        state = CoordinatorState(assignment=assignment, roster=roster, last_turn=self._started_at)
        # on etcd, the host's key vanishes at the latest one lease after its launcher's last renewal
        fence_s = max(15.0, 1.5 * self.args.leader_ttl_s) if self.election is not None else 15.0
        flags = (getattr(self.args, "straggler_action", None), getattr(self.args, "straggler_factor", None),
                 getattr(self.args, "straggler_window", None))
        self.coordinator = Coordinator(state, self.settings(), self.values, self.nodes, self.event,
                                       fence_timeout_s=fence_s, straggler_flags=flags)
        return self.coordinator

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
            self.nodes.store_url = self.store_url
            self.serve_metrics()
            self.store = self._connect()
            if self.joiner is None and (again := count_start(self.values, self.args.host_rank, self.args.hosts)):
                print(f"deadpool-run: host {self.args.host_rank}'s launcher started before in job {self.job_id} (a "
                      f"pod or process started again): its lease and its nodes' places are gone, so it comes back "
                      f"as a spare of the running job, as --join {again}", file=sys.stderr, flush=True)
                self._as_joiner(again)
                self._local_nodes()
                self.nodes.store_url = self.store_url
            if supports_leases(self.store) and self.joiner is None:
                self.election = LeaderElection(
                    cast(LeaseStore, self.store),
                    lambda t: cast(LeaseStore, connect(self.store_url, self.token, self.job_id, t)),
                    self.args.host_rank, self.args.leader_ttl_s, on_pause=self.lapse.pause,
                    on_resume=self.lapse.resume, on_lost=self.lapse.self_fence, outage_s=self.args.store_outage_s,
                    host=self.args.host)
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
                           hosts=self.args.hosts, host_rank=self.args.host_rank,
                           malloc_arena_max=worker_arena_max(self.args.malloc_arena_max, os.environ))
            else:
                raw = self.store.wait([keys.ASSIGNMENT], 120.0)[keys.ASSIGNMENT]
                a0 = values.assignment(keys.ASSIGNMENT, raw).assignment
                if self.joiner is not None:
                    self.joiner.request(self.values)
            for w in self.workers:
                if w.node in self.local_nodes:
                    self.nodes.spawn(w, "active" if w.worker_id in a0.ranks else "spare")
            self.started = True
            if self.leader and self.election is None:
                self.coordinate(a0)   # host 0 leads for good from the first turn
            rc = self._loop()
            if rc == 0:
                self._let_others_see_the_end()
            return rc
        finally:
            self._shutdown()

    def serve_metrics(self) -> None:
        """``--metrics-port``: the goodput ledger on ``--metrics-addr`` (default ``--host``), before any worker."""
        if getattr(self.args, "metrics_port", None) is None:
            return
        addr = self.args.metrics_addr or self.args.host
        if is_wildcard(addr):
            log.warning("--metrics-addr %s: the metrics endpoint listens on every interface, as asked", addr)
        self.metrics = MetricsServer(addr, self.args.metrics_port, self.args.timeline, self.job_id)
        port = self.metrics.start()
        self.event(event="metrics", host_rank=self.args.host_rank, addr=addr, port=port)

    def _let_others_see_the_end(self) -> None:
        """A job that finished, on the store this launcher serves, with launchers on other hosts or machines that
        joined: the store outlives the job by :data:`FINISHED_LINGER_S`, so that each of them reads ``finished``
        at its next turn (0.1 s) and ends with status 0, instead of finding the store gone (a joiner then ends with
        status 1 after ``JOIN_STORE_LOST_S``: "the job is gone")."""
        if self.server is None or self.coordinator is None:
            return
        if all(h == self.args.host_rank for h in self.coordinator.state.roster.node_host.values()):
            return
        log.info("job finished: the store stays up %.0f s for the other launchers to read it", FINISHED_LINGER_S)
        time.sleep(FINISHED_LINGER_S)

    def _connect(self) -> Any:
        """The job's store; a follower on host 0's embedded store retries a refused connect (host 0 not listening
        yet) for up to :data:`LEADER_STORE_WAIT_S`."""
        from ..store import connect

        waits = self.server is None and self.store_url.startswith("dp://")
        deadline = time.monotonic() + LEADER_STORE_WAIT_S
        while True:
            try:
                return connect(self.store_url, self.token, self.job_id, STORE_TIMEOUT_S)
            except StoreAuthError:
                raise
            except StoreError as exc:
                if not waits:
                    raise
                if time.monotonic() > deadline:
                    raise StoreError(f"{exc} (waited {LEADER_STORE_WAIT_S:g}s for host 0's launcher to serve it)"
                                     ) from exc
                time.sleep(0.2)

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
        if self.joiner is not None and (rc := self.joiner.tick(self.values)) is not None:
            return rc
        repair_s = getattr(self.args, "repair_after_s", 0.0)
        if self.election is None and self.leader:
            repair_tick(self.nodes, self.values, repair_s, self.event)
            return None  # one coordinator for good, on this host: it sees its own processes directly
        if self.election is not None:
            from .leader import LOST, PAUSED

            state = self.election.tick()
            if state == LOST:
                self.lapse.self_fence(self.election.lost_why or "its lease is no longer valid")
            if state == PAUSED:
                return None  # workers stopped until the store answers again (LeaseLapse.pause / resume)
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
        self.nodes.report_exits(self.store)
        self.nodes.obey_fences(self.store)
        repair_tick(self.nodes, self.values, repair_s, self.event)
        return None

    def _leads(self) -> bool:
        if self.election is None:
            return bool(self.leader)
        return self.election.leading

    def _take_over(self) -> None:
        """This launcher holds the coordinator role now (host 0 at the start, or another launcher after the
        coordinator was lost): the job's state comes from the store."""
        now = time.time()
        published = self.values.get(keys.ASSIGNMENT, values.assignment)
        if published is None:  # missing or unusable (logged): the next turn tries again, the loop goes on
            raise values.BadValue(keys.ASSIGNMENT, "took the coordinator role over but the store holds no usable "
                                                "assignment")
        a = published.assignment
        dead_spares = set(self.values.get(keys.DEAD_SPARES, values.node_list) or [])
        if self.coordinator is None:
            self.coordinate(a)
        assert self.coordinator is not None
        self.coordinator.state = taken_over(self.coordinator.state, a, dead_spares, now)
        self.event(event="leader", host_rank=self.args.host_rank, generation=a.generation,
                   took_over_at=time.time(), hosts_alive=sorted(self._hosts_alive()))
        if self.args.host_rank != 0 or a.generation > 0:
            log.warning("host %d took the coordinator role over (generation %d)", self.args.host_rank, a.generation)

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
        """Every launcher: this host's part each turn; the coordinator's turn while it holds the role."""
        led_before = self.leader and self.election is None
        while True:
            self._sleep_until_child_exit(0.1)
            if (rc := self._drain_turn()) is not None:
                return rc
            try:
                rc = self._host_tick()
            except StoreError as exc:
                log.warning("host %d: %s", self.args.host_rank, exc)
                continue
            if rc is not None:
                return self._drain_end(stopped=rc == 1) if self.drain.active else rc
            if not self._leads():
                led_before = False
                continue
            try:
                if not led_before or self.coordinator is None:
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
                return self._drain_end(stopped=rc == 1) if self.drain.active else rc

    def _drain_turn(self) -> int | None:
        """A preemption's drain (``drain.py``), first in every turn once the workers run: the request written (a
        SIGTERM to this launcher) or read (another launcher's, a worker's); then, once this host's workers of the
        current generation exited or the budget is spent, the final line and the exit status."""
        if not self.started:
            return None
        try:
            if not self.drain.tick(self.store, self.values):
                return None
        except StoreError as exc:  # the store gone for a moment: the next turn tries again, the budget runs
            log.warning("drain: %s", exc)
            if not self.drain.active:
                return None
        if self.coordinator is not None:
            self.coordinator.draining = True
        ranks, local, exits = self._drain_view()
        if self.drain.over(ranks, local, exits, time.time(), self.values):
            return self._drain_end()
        return None

    def _drain_view(self) -> tuple[tuple[str, ...], set[str], dict[str, int]]:
        """The current generation's workers, this host's, and the exits of this host's processes."""
        try:
            published = self.values.get(keys.ASSIGNMENT, values.assignment)
        except Exception as exc:  # the store gone: this host's processes still tell
            log.debug("drain: %s", exc)
            published = None
        local = {w.worker_id for w in self.nodes.workers}
        ranks = tuple(published.assignment.ranks) if published is not None else tuple(
            wid for wid in local if self.nodes.procs.get(wid) is not None)
        return ranks, local, self.nodes.exits()

    def _drain_end(self, *, stopped: bool = False) -> int:
        """The drain's end on this host: the line, the status; what is left (spares, a late worker) SIGKILLed."""
        ranks, local, exits = self._drain_view()
        rc = self.drain.end(self.values, ranks, local, exits, stopped=stopped)
        self.nodes.kill_all()
        return rc

    def _coordinate(self) -> int | None:
        """One turn of the coordinator (``coordinator.py``: observe -> decide -> act)."""
        assert self.coordinator is not None
        return self.coordinator.turn(self.hosts_seen, self.hosts_now, self.lapse.take_resumed())

    def _shutdown(self) -> None:
        if self.election is not None:
            self.election.close()
        self.nodes.stop_all()
        if self.server is not None:
            self.server.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.timeline is not None:
            self.timeline.close()
        if self._drop_timeline is not None:
            self._drop_timeline()


FINISHED_LINGER_S = 3.0
"""How long a served store outlives a finished job that has launchers elsewhere (thirty of their turns)."""


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

    def on_sigterm(*_: Any) -> None:
        # Once the workers run, a SIGTERM (a preemption) drains the job (launcher/drain.py); before, it ends the
        # launcher as it always did.
        if not sup.started:
            sys.exit(143)
        sup.drain.notice()

    signal.signal(signal.SIGTERM, on_sigterm)
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
