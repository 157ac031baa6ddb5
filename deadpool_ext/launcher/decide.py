"""The coordinator's turn as a pure function: ``decide(state, observation) -> Decision(state, actions)``.

Every rule the coordinating launcher applies lives here, over plain dataclasses: no store, no processes, no
clock, no sleep. ``launcher/coordinator.py`` observes (reads the store and this host's processes once per turn
into an :class:`Observation`), calls :func:`decide`, and carries out the :class:`Decision`'s actions in order;
the state it hands to the next turn is the decision's. The actions a decision lists are ``actions.py``'s.
Unit-tested turn by turn in ``tests/unit/test_decide.py``.

One turn, in order:

1. join requests (read once a second): checked, answered, admitted as a spare or, to a shrunk world, as a node
   to grow to (``join.py`` is the joining machine's side);
2. while **awaiting a spare** (no spare was left for a failed node, ``--no-spare-policy wait``): the failed
   nodes' ranks go to the first spare that joined, or the job stops at the deadline. Nothing else is judged
   meanwhile (the failed nodes are fenced already; detection resumes with the next generation);
3. completion (every active worker exited 0 or wrote ``done/``), a worker's fatal report;
4. detection: exits, lost hosts (a lapsed lease), heartbeat age (with a grace after a late turn or a stalled
   store: ``hangs.store_stalled``), a survivor's report of a failed collective (``suspect/``: a quiet peer is
   failed after ``Settings.suspect_age_s`` instead of the detection timeout, :meth:`_Turn.by_report`), hangs by
   progress (``hangs.stalled``); dead spares; with none of these, a straggler evicted (``straggler.py``);
5. no failure: grow a shrunk world to a repaired or joined node once it has formed (``hangs.not_formed``);
6. a failure after the job's work is done finishes it (``done.py``, a plain loop's before detection); any other:
   the failed nodes fenced, and the next generation: spares take the failed nodes' ranks
   (``membership.replace_failed``); with none left, the policy: shrink (``membership.shrink_failed``), await a
   spare until ``--spare-wait-s`` passes, or stop with the line ``final.stop_line`` writes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from ..cluster.assignment import Assignment, Worker
from ..cluster.membership import NoSpareError, grow_into, replace_failed, shrink_failed, spares_ready
from . import keys, values
from .actions import (
    Action,
    AnswerJoin,
    BadKey,
    ClearRepaired,
    Decision,
    Event,
    Fence,
    Finish,
    Log,
    MarkRepaired,
    NoteDropped,
    Publish,
    Say,
    SetSpares,
    Stop,
    WriteDeadSpares,
)
from .done import finish_after_loss, finish_after_recovery
from .final import safe_steps, stop_line
from .hangs import not_formed, prepared_spares, spare_lost_line, stalled, store_stalled

TURN_GAP_S = 1.0
"""A coordinator turn later than this after the previous one (normally 0.1 s apart) means the store stalled."""
JOINED_HOST = -1  # a joined node's host index: none of the job's --hosts (never among those whose lease lapsed)
REPORT_AGES = 2.0
"""A survivor's report of a failed collective counts for this many ``suspect_age_s`` after the coordinator read it: a
lost host's ranks are failed within that; one that explained nothing by then (not a lost peer) no longer counts."""
JOIN_RE = values.NODE_RE  # a joining node's name: part of store keys, worker ids and a shared-memory directory name


# -- what the coordinator knows ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Settings:
    """The launcher's flags the rules read (fixed for the job)."""

    detect_timeout_s: float
    progress_timeout_s: float
    store_outage_s: float
    spare_wait_s: float
    nproc_per_node: int
    policy_flag: str | None = None
    """``--no-spare-policy``, None when not given (the job's config then decides: ``keys.resolve_no_spare_policy``)."""
    keep_memory_on_failure: bool = False
    leased: bool = False
    """Hosts hold etcd leases: a lapsed one is a lost host, and dead spares are written for a successor."""
    master_addr: str = "127.0.0.1"
    """Every published generation's rendezvous address (the coordinator's --host; the port is 0: the store)."""
    host_rank: int = 0
    """The coordinating launcher's --host-rank (recorded with each replacement it publishes)."""
    suspect_age_s: float = 0.0
    """``--suspect-age-s``: once a live rank of the generation reported a failed collective, a rank the coordinator
    has not heard a new heartbeat from for this long is failed (a lost host: its sockets closed, so the survivors'
    collectives fail at once). 0: off, only ``detect_timeout_s``."""


@dataclass(frozen=True, slots=True)
class Roster:
    """Every node and process of the job, those admitted to join it included."""

    workers: tuple[Worker, ...]
    active_nodes: tuple[str, ...]
    """The job's own active nodes: a world on fewer nodes is shrunk."""
    spare_nodes: tuple[str, ...]
    node_host: Mapping[str, int]
    """node -> the host (launcher) that runs it; :data:`JOINED_HOST` for a joined machine."""

    def node_workers(self, node: str) -> list[str]:
        return [w.worker_id for w in self.workers if w.node == node]

    def admit(self, name: str, nproc: int) -> Roster:
        return Roster(workers=(*self.workers, *(Worker(f"{name}.{i}", name, i) for i in range(nproc))),
                      active_nodes=self.active_nodes,
                      spare_nodes=self.spare_nodes if name in self.spare_nodes else (*self.spare_nodes, name),
                      node_host={**self.node_host, name: JOINED_HOST})


@dataclass(frozen=True, slots=True)
class AwaitSpare:  # a failure found no spare: --no-spare-policy wait holds the job until one joins or the deadline
    failed_nodes: frozenset[str]
    deadline: float
    policy: str


@dataclass(frozen=True, slots=True)
class CoordinatorState:
    """What the coordinator carries from one turn to the next."""

    assignment: Assignment
    roster: Roster
    last_turn: float
    """Time of the previous turn (a late one means the store stalled for everyone)."""
    formed_after: float = 0.0
    """When the current assignment was published: it has formed once every rank finished a step since."""
    grace_until: float = 0.0
    """Heartbeat-based detection waits until then (a stalled store, a late turn, a lease that resumed)."""
    seen_hb: Mapping[str, float] = field(default_factory=dict)
    """Active worker -> its last heartbeat's time."""
    spare_hb: Mapping[str, float] = field(default_factory=dict)
    """Live spare worker -> its last heartbeat's time (what tells a stalled store from hung workers)."""
    progress: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    """Active worker -> its last heartbeat's progress sample (restarts with each generation)."""
    heard_hb: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    """Active worker -> (its last heartbeat's ``t``, the turn's ``now`` when the coordinator first read it, the same
    for the heartbeat before; -inf when none was read): how long the coordinator has heard nothing new, on its own
    clock (a report's rule; no worker's clock in it)."""
    reports_heard: Mapping[str, tuple[int, float, float]] = field(default_factory=dict)
    """Rank of the current generation -> (generation, ``time``, the turn's ``now`` when first read) of its report of
    a failed collective (``suspect/``); each is recorded in the timeline once."""
    dead_spares: frozenset[str] = frozenset()
    join_decided: frozenset[str] = frozenset()
    """Join requests already answered by this coordinator (each is judged once)."""
    awaiting: AwaitSpare | None = None
    stall_logged: bool = False
    all_in_collective_logged: bool = False
    grow_wait_logged: tuple[int, str] | None = None

    @property
    def shrunk(self) -> bool:
        """The world runs on fewer nodes than the job started with."""
        return len(set(self.assignment.nodes.values())) < len(self.roster.active_nodes)


def taken_over(state: CoordinatorState, assignment: Assignment, dead_spares: Set[str], now: float) -> CoordinatorState:
    """This launcher (again) holds the coordinator role: the assignment and the dead spares come from the store;
    when the assignment formed is not known (a step on every rank from now on tells), heartbeats restart."""
    return dataclasses.replace(state, assignment=assignment, last_turn=now, formed_after=now, seen_hb={},
                               heard_hb={}, reports_heard={}, dead_spares=state.dead_spares | frozenset(dead_spares),
                               awaiting=None)


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """``joined/<name>`` as read: the raw request, and the answer a coordinator gave before (None: none usable)."""

    name: str
    raw: bytes
    earlier_ok: bool | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """One turn's reading of the store and of this host's processes."""

    now: float
    exits: Mapping[str, int] = field(default_factory=dict)
    """Worker -> exit status, of every worker that exited (this host's processes, other hosts' ``exit/``)."""
    done: frozenset[str] = frozenset()
    """Workers whose training finished (``done/``)."""
    beats: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    """Worker -> its heartbeat now (``hb/``, decoded; a missing or bad one is absent)."""
    fatal: str | None = None
    hosts_seen: frozenset[int] = frozenset()
    """Every host whose launcher ever held its lease (``leased`` only)."""
    hosts_now: frozenset[int] = frozenset()
    """The hosts whose lease is alive this turn."""
    job_policy: str | None = None
    """``deadpool.elastic.no_spare_policy`` of the job's config (``keys.JOB_POLICY``; read without the flag)."""
    joins: tuple[JoinRequest, ...] | None = None
    """The join requests, on the turns they are read (None: not this turn)."""
    repaired: tuple[str, ...] = ()
    """The names under ``repaired/`` (read while the world is shrunk)."""
    resumed_grace_until: float | None = None
    """This launcher's lease resumed after a pause: no heartbeat could be written meanwhile; detection waits."""
    reports: Mapping[str, values.Report] = field(default_factory=dict)
    """Worker -> its newest report of a failed collective (``suspect/``, decoded; a bad one is absent)."""
    trained: Mapping[str, values.Trained] = field(default_factory=dict)  # worker -> its loop's end (trained/)
    evict: Mapping[str, str] = field(default_factory=dict)  # worker -> why: a straggler's node (straggler.py)


# -- the rules ---------------------------------------------------------------------------------------------------
def decide(state: CoordinatorState, obs: Observation, settings: Settings) -> Decision:
    """One coordinator turn (see the module's docstring for the order)."""
    turn = _Turn(state, obs, settings)
    turn.run()
    return Decision(turn.state, tuple(turn.actions))


def policy_of(settings: Settings, obs: Observation) -> str:
    """The no-spare policy in force this turn (``keys.resolve_no_spare_policy``: the flag, the job's, fail)."""
    return keys.resolve_no_spare_policy(settings.policy_flag, obs.job_policy).policy


def join_refusal(name: str, raw: bytes, roster: Roster, nproc_per_node: int) -> str | None:
    """Why a join request is refused, None to admit it."""
    if not JOIN_RE.fullmatch(name):
        return (f"node name {name[:80]!r}: must be 1-63 characters of [A-Za-z0-9_-], the first a letter "
                "(--join NAME)")
    if name in {w.node for w in roster.workers}:
        return f"node name {name!r} is taken by a node of this job: pass another --join NAME"
    try:
        req = values.decode_json(keys.join_request(name), raw)
    except values.BadValue as exc:
        return f"the join request is not usable: {exc}"
    nproc = req.get("nproc") if isinstance(req, dict) else None
    if type(nproc) is not int or nproc != nproc_per_node:
        return (f"the joining node has {values.echo(nproc)} process(es), this job's nodes have "
                f"{nproc_per_node}: pass --nproc-per-node {nproc_per_node}")
    return None


class _Turn:
    """One call of :func:`decide`: the state as it evolves through the turn, and the actions so far."""

    def __init__(self, state: CoordinatorState, obs: Observation, settings: Settings) -> None:
        self.state, self.obs, self.settings = state, obs, settings
        self.actions: list[Action] = []

    def update(self, **changes: Any) -> None:
        self.state = dataclasses.replace(self.state, **changes)

    def run(self) -> None:
        if self.obs.resumed_grace_until is not None:
            self.update(seen_hb={}, heard_hb={}, progress={}, grace_until=self.obs.resumed_grace_until)
        self.joins()
        if self.state.awaiting is not None:
            self.update(last_turn=self.obs.now)   # turns keep their pace meanwhile: no store stall to make up for
            self.next_generation(self.state.awaiting)
            return
        if self.finished_or_fatal():
            return
        a, obs = self.state.assignment, self.obs  # a plain loop's last step lost, seen once a spare took over:
        ended = frozenset(w for w in a.ranks if obs.exits.get(w) == 0 or w in obs.done)
        if after := finish_after_recovery(a, obs.trained, ended, obs.reports):
            self.actions += after
            return
        failed = self.detect() or {w: why for w, why in obs.evict.items() if w in a.ranks}
        if not failed:
            self.grow()
            return
        if done := finish_after_loss(a, obs.trained, failed, not self.settings.keep_memory_on_failure, ended):
            self.actions += done  # the job's work is done
        else:
            self.failure(failed)

    # -- 1. joins ----------------------------------------------------------------------------------------------
    def joins(self) -> None:
        if self.obs.joins is None:
            return
        s, nproc = self.settings, self.settings.nproc_per_node
        for req in sorted(self.obs.joins, key=lambda r: r.name):
            name = req.name
            if name in self.state.join_decided:
                continue
            self.update(join_decided=self.state.join_decided | {name})
            # an earlier answer (a coordinator before this one, or anyone holding the token) decides nothing
            # until the request passes the same checks here
            earlier = req.earlier_ok if JOIN_RE.fullmatch(name) else None
            why = join_refusal(name, req.raw, self.state.roster, nproc)
            if why is not None:
                if earlier is None or earlier:
                    self.actions += [AnswerJoin(name, False, why=why),
                                     Event({"event": "join_refused", "node": name[:80], "why": why}),
                                     Log(logging.WARNING, f"join of node {values.echo(name, 80)} refused: {why}")]
                continue
            if earlier is not None:  # learn the workers a coordinator before this one admitted
                if earlier:
                    self.update(roster=self.state.roster.admit(name, nproc))
                continue
            self.update(roster=self.state.roster.admit(name, nproc))
            grow = self.state.shrunk and policy_of(s, self.obs) == "shrink"
            a = self.state.assignment
            if grow:  # grown to on a later turn without a failure (grow())
                self.actions.append(MarkRepaired(name))
            else:
                a = dataclasses.replace(a, spares=(*a.spares, name))
                self.update(assignment=a)
                self.actions.append(SetSpares(a))
            role = "grow" if grow else "spare"
            self.actions += [AnswerJoin(name, True, role=role),
                             Event({"event": "joined", "node": name, "role": role, "generation": a.generation}),
                             Say(f"node {name} joined the job ({nproc} process(es)): "
                                 + ("the shrunk world grows to it" if grow else "a spare node"))]

    # -- 3. completion -----------------------------------------------------------------------------------------
    def finished_or_fatal(self) -> bool:
        a, obs = self.state.assignment, self.obs
        if all(obs.exits.get(w) == 0 or w in obs.done for w in a.ranks):
            self.actions += [Finish(a.generation), Event({"event": "finished", "generation": a.generation})]
            return True
        if obs.fatal is not None:
            self.actions.append(Stop(obs.fatal, "stopping the job, a worker reports unrecoverable state:\n"
                                     + obs.fatal))
            return True
        return False

    # -- 4. detection ------------------------------------------------------------------------------------------
    def lost_hosts(self) -> frozenset[int]:
        return self.obs.hosts_seen - self.obs.hosts_now if self.settings.leased else frozenset()

    def detect(self) -> dict[str, str]:
        """worker -> why, of every active worker found failed this turn; spares found dead are fenced."""
        a, obs, s = self.state.assignment, self.obs, self.settings
        active = set(a.ranks)
        failed: dict[str, str] = {}
        for wid in sorted(active):
            rc = obs.exits.get(wid)
            if rc is not None and rc != 0:
                failed[wid] = f"exited with {'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}"
        lost = self.lost_hosts()
        if lost:
            for wid in sorted(active - set(failed)):
                h = self.state.roster.node_host.get(a.nodes[wid], JOINED_HOST)
                if h in lost:
                    failed[wid] = f"host {h} lost (its launcher's lease lapsed)"
        now = obs.now
        gap = now - self.state.last_turn
        self.update(last_turn=now)
        if gap > TURN_GAP_S:
            # This turn came late (the store was slow for everyone, e.g. an etcd member lost and its leader being
            # re-elected): no worker could write a heartbeat meanwhile either, so staleness says nothing yet.
            self.update(grace_until=max(self.state.grace_until, now + s.detect_timeout_s))
            self.actions.append(Log(logging.INFO, f"coordinator: {gap:.1f}s since its last turn (store slow); "
                                                  f"heartbeats get {s.detect_timeout_s:.0f}s of grace"))
        seen_hb, progress = dict(self.state.seen_hb), dict(self.state.progress)
        heard_hb = dict(self.state.heard_hb)
        for wid in sorted(active - set(failed)):
            if obs.exits.get(wid) is not None or wid in obs.done:
                continue
            beat = obs.beats.get(wid)
            if beat is not None:
                seen_hb[wid] = float(beat["t"])
                progress[wid] = beat
                if wid not in heard_hb or heard_hb[wid][0] != seen_hb[wid]:
                    heard_hb[wid] = (seen_hb[wid], now, heard_hb[wid][1] if wid in heard_hb else -math.inf)
            if wid in seen_hb and now - seen_hb[wid] > s.detect_timeout_s:
                failed[wid] = f"hung: no heartbeat for {now - seen_hb[wid]:.1f}s (SIGKILLed to fence it)"
        self.update(seen_hb=seen_hb, progress=progress, heard_hb=heard_hb)
        failed.update(self.by_report(active - set(failed) - {w for w in active if w in obs.done
                                                               or obs.exits.get(w) is not None},
                                     explained=bool(failed)))
        self.store_stall(active, any(v.startswith("hung") for v in failed.values()))
        if now < self.state.grace_until:  # the store was unreachable for everyone: heartbeats restart
            failed = {w: why for w, why in failed.items() if not why.startswith("hung")}
        else:
            failed.update(self.by_progress(active - set(failed)))
        self.dead_spares(active, lost)
        return failed

    def by_report(self, live: set[str], explained: bool) -> dict[str, str]:
        """A survivor's report of a failed collective (``suspect/<worker>``) shortens heartbeat detection: while a
        rank of the current generation whose own heartbeat is fresh reported one (read within
        :data:`REPORT_AGES` x ``suspect_age_s``: a lost host's ranks are unheard by then), a
        rank the coordinator has heard no new heartbeat from for ``suspect_age_s``, while it heard two from the
        reporter, is failed. A report alone fails nobody whose heartbeat is fresh (a flapping or lying reporter
        cannot evict a healthy peer), nor anyone on a turn that found a failure otherwise (``explained``: an exit,
        a lapsed lease; the reports are that failure's); one of another generation, or from a rank not in it (a
        fenced node, a spare, a name of nobody), is ignored; a reporter is never failed by a report (it wrote one:
        it is alive). Each new report is recorded (``suspect`` event)."""
        st, obs, s = self.state, self.obs, self.settings
        a, now, limit = st.assignment, obs.now, s.suspect_age_s
        heard = {w: r for w, r in st.reports_heard.items() if r[0] == a.generation and w in a.ranks}
        for wid, report in sorted(obs.reports.items()):
            if wid not in a.ranks or report.generation != a.generation:
                continue
            old = heard.get(wid)
            if old is not None and old[:2] == (report.generation, report.time):
                continue
            heard[wid] = (report.generation, report.time, now)
            self.actions.append(Event({"event": "suspect", "generation": a.generation, "reporter": wid,
                                       "rank": a.ranks[wid], "reported_at": report.time, "heard_at": now,
                                       "what": report.what}))
        self.update(reports_heard=heard)
        if limit <= 0 or explained:
            return {}

        def quiet(w: str) -> float | None:   # since the coordinator first read w's newest heartbeat
            h = st.heard_hb.get(w)
            return None if h is None else now - h[1]

        def fresh(w: str) -> bool:
            return (q := quiet(w)) is not None and q <= limit

        reporters = sorted((at, w) for w, (_, _, at) in heard.items()
                           if w in live and now - at <= REPORT_AGES * limit and fresh(w))
        if not reporters:
            return {}
        by = reporters[0][1]
        failed = {}
        for wid in sorted(live - set(heard)):
            q = quiet(wid)
            # ... and some reporter beat twice since: the host is not merely as starved as everyone (its beat late)
            if q is not None and q > limit and any(st.heard_hb[r][2] > st.heard_hb[wid][1] for _, r in reporters):
                failed[wid] = (f"hung: no heartbeat for {q:.1f}s after rank {a.ranks[by]} ({by}) reported a failed "
                               "collective (SIGKILLed to fence it)")
        return failed

    def store_stall(self, active: set[str], any_hung: bool) -> None:
        """Every heartbeat stale at once, the live spares' too: the store took nobody's writes, no hang. Detection waits
        (a grace of the detection timeout after such a turn), at most --store-outage-s from the oldest; said once."""
        if not any_hung:
            self.update(stall_logged=False)
            return
        st, s, now = self.state, self.settings, self.obs.now
        spare_hb = dict(st.spare_hb)
        for w in st.roster.workers:
            wid = w.worker_id
            if w.node not in st.roster.spare_nodes or w.node in st.dead_spares or wid in active:
                spare_hb.pop(wid, None)
                continue
            beat = self.obs.beats.get(wid)
            if beat is not None:
                spare_hb[wid] = float(beat["t"])
        self.update(spare_hb=spare_hb)
        beats = {**{w: st.seen_hb[w] for w in active if w in st.seen_hb}, **spare_hb}
        if not store_stalled(beats, now, s.detect_timeout_s):
            self.update(stall_logged=False)
            return
        if now - min(beats.values()) > s.store_outage_s:
            return
        self.update(grace_until=max(self.state.grace_until, now + s.detect_timeout_s))
        if not self.state.stall_logged:
            self.update(stall_logged=True)
            self.actions.append(Log(logging.WARNING, (
                f"coordinator: every heartbeat is {now - max(beats.values()):.1f}s old or more, the spares' too: "
                f"the store took no worker's writes (not a hang); heartbeat detection waits up to "
                f"--store-outage-s {s.store_outage_s:.0f}s")))

    def by_progress(self, active: set[str]) -> dict[str, str]:
        """Hangs by progress (``hangs.stalled``), said once when every rank is inside a collective."""
        limit = self.settings.progress_timeout_s
        failed, all_in_collective = stalled(self.state.progress, active, self.obs.now, limit)
        if all_in_collective and not self.state.all_in_collective_logged:
            self.update(all_in_collective_logged=True)
            self.actions.append(Log(logging.WARNING, (
                f"no rank finished a step for {limit:.0f}s and every rank is inside a collective: no rank can be "
                "singled out; left to the collective timeout")))
        return failed

    def dead_spares(self, active: set[str], lost: frozenset[int]) -> None:
        st = self.state  # only the assignment's spares: a spare that took ranks since fails as a node
        dead = set(st.dead_spares)
        for w in st.roster.workers:
            if w.node not in st.assignment.spares or w.node in dead or w.worker_id in active:
                continue
            rc = self.obs.exits.get(w.worker_id)
            h = st.roster.node_host.get(w.node, JOINED_HOST)
            if rc is not None or h in lost:
                dead.add(w.node)
                detail = f"host {h} lost" if rc is None else f"exited with {rc}"
                left = [n for n in st.assignment.spares if n not in dead]
                self.actions += [Fence(w.node, drop_memory=False),
                                 Event({"event": "spare_lost", "node": w.node, "detail": detail}),
                                 Log(logging.WARNING, spare_lost_line(w.worker_id, rc, detail, left))]
        if dead != st.dead_spares:
            self.update(dead_spares=frozenset(dead))
            if self.settings.leased:
                self.actions.append(WriteDeadSpares(tuple(sorted(dead))))

    # -- 5. grow -----------------------------------------------------------------------------------------------
    def grow(self) -> None:
        st, obs = self.state, self.obs
        a = st.assignment
        if not st.shrunk or policy_of(self.settings, obs) != "shrink":
            return
        known = {w.node for w in st.roster.workers}
        for node in sorted(obs.repaired):
            if node not in known:  # only a node of this job, or one admitted by the join checks, is grown to
                self.actions.append(BadKey(keys.REPAIRED + node, "names no node of this job (nor one admitted to "
                                                                "join it)", delete=True))
                continue
            if node in set(a.nodes.values()):
                self.actions.append(ClearRepaired(node))
                continue
            ids = st.roster.node_workers(node)
            if any(wid in obs.exits for wid in ids):
                continue  # a process of the repaired node already died: not offered
            if any(wid not in obs.beats for wid in ids):
                continue  # its processes are still starting (no heartbeat yet): the world trains on meanwhile
            waiting = not_formed(a.ranks, st.progress, st.formed_after)
            if waiting:
                if st.grow_wait_logged != (a.generation, node):
                    self.update(grow_wait_logged=(a.generation, node))
                    self.actions.append(Log(logging.INFO, (
                        f"node {node} is ready to join; the grow waits until generation {a.generation} "
                        f"({a.world_size} ranks) has finished a step on every rank (not yet: "
                        + ", ".join(waiting[:4]) + (" ..." if len(waiting) > 4 else "") + ")")))
                return
            new = self.normalized(grow_into(a, list(st.roster.workers), node))
            self.publish(new, {"event": "assignment", "generation": new.generation, "grown": [node],
                               "world_size": new.world_size})
            self.actions += [ClearRepaired(node),
                             Say(f"node {node} joins: growing to {new.world_size} ranks (was {a.world_size}), the "
                                 "state resharded from memory")]
            return

    # -- 6. failure --------------------------------------------------------------------------------------------
    def failure(self, failed: dict[str, str]) -> None:
        st, now = self.state, self.obs.now
        a = st.assignment
        failed_nodes = frozenset(a.nodes[w] for w in failed)
        self.actions.append(Event({"event": "failure", "generation": a.generation, "detected_at": now,
                                   "failed": {w: {"rank": a.ranks[w], "node": a.nodes[w], "why": why}
                                              for w, why in failed.items()}}))
        self.actions += [Fence(n, drop_memory=not self.settings.keep_memory_on_failure) for n in sorted(failed_nodes)]
        self.update(seen_hb={w: t for w, t in st.seen_hb.items() if a.nodes.get(w) not in failed_nodes},
                    heard_hb={w: h for w, h in st.heard_hb.items() if a.nodes.get(w) not in failed_nodes},
                    progress={},   # every rank's counters restart with the next generation's first step
                    all_in_collective_logged=False)
        policy = policy_of(self.settings, self.obs)
        wait_s = self.settings.spare_wait_s if policy == "wait" else 0.0
        self.next_generation(AwaitSpare(failed_nodes, now + wait_s, policy))

    def next_generation(self, waiting: AwaitSpare) -> None:
        """Spares take the failed nodes' ranks; with none left, the policy: shrink, await a spare until the
        deadline, or stop (said, and written to the store)."""
        st = self.state
        a = st.assignment
        try:
            new = replace_failed(a, list(st.roster.workers), waiting.failed_nodes, st.dead_spares,
                                 prepared=prepared_spares(self.obs.beats))
        except NoSpareError as no_spare:
            exc: NoSpareError = no_spare
            if waiting.policy == "shrink":
                try:
                    new = shrink_failed(a, waiting.failed_nodes, st.dead_spares)
                except NoSpareError as none_left:
                    exc = none_left
                else:
                    self.actions += [Say(f"{exc}; --no-spare-policy shrink: continuing without node(s) "
                                         f"{list(new.shrunk)} on {new.world_size} ranks (was {a.world_size}), the "
                                         "state resharded from memory"),
                                     NoteDropped(new.shrunk, new.generation)]
                    self.publish_replacement(new)
                    return
            if self.obs.now >= waiting.deadline:
                exits = {wid: self.obs.exits.get(wid) for wid, node in a.nodes.items() if node in waiting.failed_nodes}
                msg = stop_line(str(exc), waiting.policy, exits, safe := safe_steps(self.obs.beats))
                self.update(awaiting=None)
                self.actions.append(Stop(msg, msg, assignment=a, exits=exits, safe=safe))
                return
            if st.awaiting is None:
                self.actions.append(Log(logging.WARNING, (
                    f"{exc}; --no-spare-policy {waiting.policy}: waiting up to "
                    f"{waiting.deadline - self.obs.now:.0f}s for a machine to join as a spare (deadpool-run --join)")))
            self.update(awaiting=waiting)
            return
        self.publish_replacement(new)

    def publish_replacement(self, new: Assignment) -> None:
        new = self.normalized(new)
        self.update(awaiting=None)
        ready = spares_ready(self.state.assignment, new, list(self.state.roster.workers),
                             prepared_spares(self.obs.beats))
        self.actions += [Say(f"node {failed} is replaced by spare {spare}, " + (
            "whose engine was built ahead for its ranks" if ready.get(failed) else "built ahead for other ranks or "
            "not at all: it relabels its engine or builds one")) for failed, spare in sorted(new.replaced.items())]
        self.publish(new, {"event": "assignment", "generation": new.generation, "replaced": new.replaced,
                           "shrunk": list(new.shrunk), "world_size": new.world_size, "built_ahead": ready,
                           "spares_left": list(new.spares), "host_rank": self.settings.host_rank})

    def normalized(self, a: Assignment) -> Assignment:
        # master_port 0: the generation's rendezvous is in the job's store, under its token (store/rendezvous.py)
        return dataclasses.replace(a, master_port=0, master_addr=self.settings.master_addr)

    def publish(self, new: Assignment, event: Mapping[str, Any]) -> None:
        # grace for every rank of the new generation: a spare's first heartbeat after taking over
        self.update(assignment=new, formed_after=self.obs.now, reports_heard={},
                    seen_hb={w: t for w, t in self.state.seen_hb.items() if w not in new.ranks},
                    heard_hb={w: h for w, h in self.state.heard_hb.items() if w not in new.ranks})
        self.actions.append(Publish(new, event))

