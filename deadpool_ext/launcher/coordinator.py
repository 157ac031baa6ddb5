"""The coordinator's turn: observe -> decide -> act.

The launcher holding the coordinator role calls :meth:`Coordinator.turn` every loop turn (about every 0.1 s):

1. **observe** (:meth:`Coordinator.observe`): one reading of the store and of this host's processes, an
   :class:`~deadpool_ext.launcher.decide.Observation` (exits, ``done/``, heartbeats, survivors' reports of a failed
   collective (``suspect/``), a fatal report, the job's
   no-spare policy, join requests once a second, ``repaired/`` while the world is shrunk; the hosts' leases come
   from the launcher's own turn);
2. **decide** (``decide.py``, pure): the rules, giving the next state and the actions; before it, the straggler
   rule (``straggler.py``, pure, its state kept here) over the same heartbeats: its lines and events carried out,
   and a node it evicts handed to ``decide`` as failed (``Observation.evict``);
3. **act** (:meth:`Coordinator.act`): each action carried out in order: store writes, fences (this host's
   processes killed directly, another host's through ``fence/<node>`` and its acknowledgement), timeline events,
   log lines. The decision's state is kept once every action is carried out: a store that refuses one leaves the
   turn to be decided again from the same state (each action can be repeated: a fence of a fenced node, the same
   generation written twice).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Set
from typing import Any

from ..cluster.assignment import Assignment
from ..store.base import rendezvous_prefix
from . import keys, values
from .actions import (
    Action,
    AnswerJoin,
    BadKey,
    ClearRepaired,
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
from .decide import (
    JOIN_RE,
    JOINED_HOST,
    CoordinatorState,
    JoinRequest,
    Observation,
    Settings,
    decide,
)
from .drain import drained_observation
from .final import stop_cause
from .join import JOIN_POLL_S
from .local import LocalNodes
from .straggler import StragglerSettings, StragglerState, judge, resolve

log = logging.getLogger("deadpool_ext.launcher")


def publish(store: Any, a: Assignment) -> None:
    """Write generation ``a`` (``ASSIGNMENT``) and tell the survivors of the one before to leave it."""
    store.set_json(keys.ASSIGNMENT, a.to_json())
    # a dead generation's rendezvous keys (gloo's addresses and counters) go; the one before may still be read
    if a.generation >= 2:
        for key in store.list(rendezvous_prefix(a.generation - 2)):
            store.delete(key)
    if a.generation > 0:
        # The notification survivors block on (rebuild.worker): generation g-1 is dead, leave it now.
        store.set(keys.generation(a.generation), keys.MARK)


def job_policy(reads: values.StoreValues) -> str | None:
    """``deadpool.elastic.no_spare_policy`` of the job's config as rank 0 wrote it (``keys.JOB_POLICY``); an
    unreachable store or a bad value reads as absent (the policy resolves to the default then)."""
    try:
        return reads.get(keys.JOB_POLICY, values.policy)
    except Exception as exc:  # the store unreachable: the default, said once in the stop line
        log.debug("%s: %s", keys.JOB_POLICY, exc)
        return None


class Coordinator:
    """The coordinator role's shell around :func:`~deadpool_ext.launcher.decide.decide`: its state between turns,
    the store it reads and writes, this host's processes, and the way to another host's (a remote fence)."""

    def __init__(self, state: CoordinatorState, settings: Settings, reads: values.StoreValues, nodes: LocalNodes,
                 event: Callable[..., None], *, fence_timeout_s: float = 15.0,
                 straggler_flags: tuple[str | None, float | None, float | None] = (None, None, None)) -> None:
        self.state, self.settings, self.reads, self.nodes, self.event = state, settings, reads, nodes, event
        self.fence_timeout_s = fence_timeout_s
        self.straggler_flags = straggler_flags
        """``--straggler-action``, ``--straggler-factor``, ``--straggler-window`` (None: not given)."""
        self.straggler = StragglerState()
        self.straggler_settings: StragglerSettings | None = (
            resolve(*straggler_flags, None) if None not in straggler_flags else None)
        """Resolved once the job's ``config/straggler`` is read (or every flag was given); the flags and defaults
        meanwhile."""
        self.straggler_next = 0.0   # monotonic time of the next reading of config/straggler
        self.join_next = 0.0   # monotonic time of the next reading of the join requests
        self.draining = False
        """A preemption's drain is under way (``drain.py``): drained workers are done, spares' exits no failure."""

    @property
    def store(self) -> Any:
        return self.reads.store

    def turn(self, hosts_seen: Set[int] = frozenset(), hosts_now: Set[int] = frozenset(),
             resumed_grace_until: float | None = None) -> int | None:
        """One turn; the launcher's exit code when the job ends (0 finished, 1 stopped), else None."""
        obs = self.observe(hosts_seen, hosts_now, resumed_grace_until)
        obs = drained_observation(obs, self.state.assignment.ranks, draining=self.draining)
        obs = self.stragglers(obs)
        dec = decide(self.state, obs, self.settings)
        for action in dec.actions:
            self.act(action)
        self.state = dec.state
        return dec.exit_code

    # -- observe ----------------------------------------------------------------------------------------------------
    def observe(self, hosts_seen: Set[int] = frozenset(), hosts_now: Set[int] = frozenset(),
                resumed_grace_until: float | None = None) -> Observation:
        reads, store, st = self.reads, self.store, self.state
        exits: dict[str, int] = self.nodes.exits()
        exits.update(reads.items(keys.EXITS, values.exit_rc, values.WORKER_RE))
        fatal = reads.get(keys.FATAL, values.fatal_text)
        # the time first, then what it judges: a worker that finishes (done/) or beats while a slow store answers
        # these reads is seen as such, never as silent since an older ``now``
        now = time.time()
        done = frozenset(k[len(keys.DONE):] for k in store.list(keys.DONE))
        beats = reads.items(keys.HEARTBEATS, values.heartbeat, values.WORKER_RE)
        reports = reads.items(keys.SUSPECTS, values.suspect, values.WORKER_RE)
        trained = reads.items(keys.TRAINED, values.trained, values.WORKER_RE)
        joins = None
        if time.monotonic() >= self.join_next:   # the join requests are read once a second at most
            self.join_next = time.monotonic() + JOIN_POLL_S
            joins = self.join_requests()
        repaired = tuple(k[len(keys.REPAIRED):] for k in sorted(store.list(keys.REPAIRED))) if st.shrunk else ()
        return Observation(now=now, exits=exits, done=done, beats=beats, fatal=fatal,
                           hosts_seen=frozenset(hosts_seen), hosts_now=frozenset(hosts_now),
                           job_policy=None if self.settings.policy_flag else job_policy(reads),
                           joins=joins, repaired=repaired, resumed_grace_until=resumed_grace_until, reports=reports,
                           trained=trained)

    def stragglers(self, obs: Observation) -> Observation:
        """The straggler rule's turn (``straggler.py``) over this turn's heartbeats: its lines and events carried out
        now, a node it evicts handed to ``decide`` as failed. Not while a drain or a wait for a spare holds the
        job."""
        st = self.state
        if self.draining or st.awaiting is not None:
            return obs
        settings = self.straggler_settings
        if settings is None:
            job = None
            if time.monotonic() >= self.straggler_next:   # read once a second until rank 0 wrote it
                self.straggler_next = time.monotonic() + 1.0
                try:
                    job = self.reads.get(keys.JOB_STRAGGLER, values.straggler_config)
                except Exception as exc:  # the store unreachable: the flags and defaults meanwhile
                    log.debug("%s: %s", keys.JOB_STRAGGLER, exc)
            settings = resolve(*self.straggler_flags, job)
            if job is not None:
                self.straggler_settings = settings
        spares = [n for n in st.assignment.spares if n not in st.dead_spares]
        verdict = judge(self.straggler, obs.beats, st.assignment, spares, obs.now, settings)
        self.straggler = verdict.state
        for action in verdict.actions:
            self.act(action)
        return dataclasses.replace(obs, evict=verdict.evict) if verdict.evict else obs

    def join_requests(self) -> tuple[JoinRequest, ...]:
        """The requests not judged yet, each with the answer given before (a coordinator before this one's)."""
        out = []
        for key, raw in sorted(self.store.list(keys.JOIN_REQUESTS).items()):
            name = key[len(keys.JOIN_REQUESTS):]
            if name in self.state.join_decided:
                continue
            earlier = self.reads.get(keys.join_answer(name), values.join_ack) if JOIN_RE.fullmatch(name) else None
            out.append(JoinRequest(name, raw, None if earlier is None else earlier.ok))
        return tuple(out)

    # -- act --------------------------------------------------------------------------------------------------------
    def act(self, action: Action) -> None:
        store = self.store
        if isinstance(action, Event):
            self.event(**action.fields)
        elif isinstance(action, Log):
            log.log(action.level, "%s", action.text)
        elif isinstance(action, Say):
            print(f"deadpool-run: {action.text}", file=sys.stderr, flush=True)
        elif isinstance(action, BadKey):
            self.reads.bad(values.BadValue(action.key, action.what))
            if action.delete:
                store.delete(action.key)
        elif isinstance(action, Fence):
            self.fence(action.node)
            if action.drop_memory:
                self.nodes.drop_memory(action.node)
        elif isinstance(action, WriteDeadSpares):
            store.set_json(keys.DEAD_SPARES, list(action.nodes))
        elif isinstance(action, AnswerJoin):
            store.set_json(keys.join_answer(action.name), keys.join_answer_value(action.ok, action.why, action.role))
        elif isinstance(action, MarkRepaired):
            store.set_json(keys.repaired(action.node), keys.repaired_value(joined=True))
        elif isinstance(action, ClearRepaired):
            store.delete(keys.repaired(action.node))
        elif isinstance(action, NoteDropped):
            for node in action.nodes:
                store.set_json(keys.dropped(node), keys.dropped_value(action.generation))
        elif isinstance(action, SetSpares):
            store.set_json(keys.ASSIGNMENT, action.assignment.to_json())
        elif isinstance(action, Publish):
            publish(store, action.assignment)
            self.event(**action.event, published_at=time.time())
        elif isinstance(action, Finish):
            store.set(keys.FINISHED, keys.MARK)
        elif isinstance(action, Stop):
            self.event(event="stopped", reason=action.reason, **({} if action.exits is None else {
                "cause": stop_cause(action.exits), "exits": dict(action.exits)}), **dict(action.safe or {}))
            if action.assignment is not None:
                store.set_json(keys.ASSIGNMENT, keys.stopped_assignment(action.assignment.to_json(), action.reason))
            print(f"deadpool-run: {action.said}", file=sys.stderr, flush=True)
        else:  # pragma: no cover - every Action is handled above (mypy checks the union)
            raise TypeError(f"unknown coordinator action {action!r}")

    def fence(self, node: str) -> None:
        """Kill every process of ``node``: directly on this host, else through its host's launcher."""
        if node in self.nodes.local:
            self.nodes.kill(node)
        else:
            self.fence_remote(node)

    def fence_remote(self, node: str) -> None:
        """Ask the launcher of ``node``'s host to kill its processes and drop its memory; wait for the ack, or, with
        leases, for that launcher's lease to lapse (it stops its own workers before the store can expire it, so a
        host whose key is gone runs nothing of the job)."""
        store = self.store
        host = self.state.roster.node_host.get(node, JOINED_HOST)
        store.set(keys.fence(node), keys.MARK)
        deadline = time.monotonic() + self.fence_timeout_s
        while True:
            try:
                if store.get(keys.fenced(node)) is not None:
                    return
                if self.settings.leased and host != JOINED_HOST and store.get(keys.host(host)) is None:
                    # a joined node has no lease
                    log.info("node %s: its host %d's lease has lapsed, so its launcher stopped its workers", node, host)
                    return
            except Exception as exc:
                log.warning("fence of %s: %s", node, exc)
            if time.monotonic() > deadline:
                # an unreachable host is as good as fenced for the new generation
                log.warning("no fence acknowledgement from the launcher of %s within %.0fs", node,
                            self.fence_timeout_s)
                return
            time.sleep(0.05)


__all__ = ["Coordinator", "job_policy", "publish"]
