"""Elastic grow: a node dropped by a shrink comes back and the job grows to it (docs/elastic.md). A mixin of
:class:`deadpool_ext.launcher.cli.Supervisor`, whose state it uses.

Call order, through the store (so it works on one host and across hosts alike):

1. the coordinator, publishing a shrink, writes ``dropped/<node>`` (:meth:`_note_dropped`);
2. the launcher of that node's host, ``--repair-after-s`` later (the stand-in for a repaired machine on this
   test bed; 0: never), clears what the node's dead processes left in the store (exit, done, heartbeat, fence
   records), starts its processes again as spares and writes ``repaired/<node>`` (:meth:`_repair_tick`);
3. the coordinator, on a turn with no failure, grows the shrunk world by one repaired (or joined:
   ``join.py``) node whose processes all live and beat (:meth:`_grow_tick`), once the shrunk world has formed:
   every one of its ranks finished a step since it was published (``hangs.not_formed``; a grow published while
   the survivors still rebuild the shrunk world would abandon that rebuild half done). Everyone keeps their
   rank, the node's processes take the next ones. The survivors get the new generation's notice like any other (the
   step in flight is redone), every rank rebuilds on the larger world and the restore reshards from memory.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from ..cluster.membership import Assignment, NoSpareError, Worker, grow_into, replace_failed, shrink_failed
from . import keys, values
from .final import stop_line
from .hangs import not_formed
from .values import StoreReads

log = logging.getLogger("deadpool_ext.launcher")


class ElasticResize(StoreReads):
    args: Any
    store: Any
    progress: dict[str, dict[str, Any]]
    formed_after: float
    _grow_wait_logged: tuple[int, str] | None = None
    procs: dict[str, subprocess.Popen[bytes]]
    workers: list[Worker]
    dead_spares: set[str]
    local_nodes: set[str]
    active_nodes: list[str]
    seen_hb: dict[str, float]
    _reported: set[str]
    _fenced: set[str]

    if TYPE_CHECKING:  # provided by the Supervisor
        def event(self, **rec: Any) -> None: ...

        def _spawn(self, w: Worker, role: str) -> None: ...

        def publish(self, a: Assignment) -> Assignment: ...

        def _join_tick(self, a: Assignment) -> Assignment: ...

    def no_spare_policy(self) -> str:
        """:func:`keys.resolve_no_spare_policy` of ``--no-spare-policy`` and the job's config (``keys.JOB_POLICY``,
        read only when the flag is not given; an unreachable store reads as absent)."""
        job = None
        if not self.args.no_spare_policy:
            try:
                job = self.values.get(keys.JOB_POLICY, values.policy)
            except Exception as exc:  # the store unreachable: the default, said once in the stop line
                log.debug("%s: %s", keys.JOB_POLICY, exc)
        return keys.resolve_no_spare_policy(self.args.no_spare_policy, job).policy

    def _note_dropped(self, new: Assignment) -> None:
        for node in new.shrunk:
            self.store.set_json(keys.dropped(node), keys.dropped_value(new.generation))

    def _repair_tick(self) -> None:
        wait = getattr(self.args, "repair_after_s", 0.0)
        if not wait:
            return
        for node, dropped_at in self.values.items(keys.DROPPED, values.record_time).items():
            if node not in self.local_nodes:
                continue
            if time.time() - dropped_at < wait:
                continue
            for w in (w for w in self.workers if w.node == node):
                for k in keys.worker_keys(w.worker_id):
                    self.store.delete(k)
                self._reported.discard(w.worker_id)
                self._spawn(w, "spare")
            for k in keys.node_keys(node):
                self.store.delete(k)
            self._fenced.discard(node)
            self.store.set_json(keys.repaired(node), keys.repaired_value())
            self.event(event="repaired", node=node)
            print(f"deadpool-run: node {node} repaired (--repair-after-s {wait:g}): its processes started again, "
                  "waiting to join the job", file=sys.stderr, flush=True)

    def _grow_tick(self, a: Assignment) -> None:
        if len(set(a.nodes.values())) >= len(self.active_nodes) or self.no_spare_policy() != "shrink":
            return  # the policy (a store read without the flag) only once the world is shrunk
        known = {w.node for w in self.workers}
        for key in sorted(self.store.list(keys.REPAIRED)):
            node = key[len(keys.REPAIRED):]
            if node not in known:  # only a node of this job, or one admitted by the join checks, is grown to
                self.values.bad(values.BadValue(key, "names no node of this job (nor one admitted to join it)"))
                self.store.delete(key)
                continue
            if node in set(a.nodes.values()):
                self.store.delete(key)
                continue
            ids = [w.worker_id for w in self.workers if w.node == node]
            if any(self.store.get(keys.exit_of(wid)) is not None
                   or (wid in self.procs and self.procs[wid].poll() is not None) for wid in ids):
                continue  # a process of the repaired node already died: not offered
            if any(self.store.get(keys.heartbeat(wid)) is None for wid in ids):
                continue  # its processes are still starting (no heartbeat yet): the world trains on meanwhile
            waiting = not_formed(a.ranks, self.progress, self.formed_after)
            if waiting:
                if self._grow_wait_logged != (a.generation, node):
                    self._grow_wait_logged = (a.generation, node)
                    log.info("node %s is ready to join; the grow waits until generation %d (%d ranks) has finished "
                             "a step on every rank (not yet: %s)", node, a.generation, a.world_size,
                             ", ".join(waiting[:4]) + (" ..." if len(waiting) > 4 else ""))
                return
            new = self.publish(grow_into(a, self.workers, node))
            self.store.delete(key)
            for wid in new.ranks:
                self.seen_hb.pop(wid, None)
            self.event(event="assignment", generation=new.generation, grown=[node], published_at=time.time(),
                       world_size=new.world_size)
            print(f"deadpool-run: node {node} joins: growing to {new.world_size} ranks (was {a.world_size}), the "
                  "state resharded from memory", file=sys.stderr, flush=True)
            return

    def _exits_on(self, a: Assignment, nodes: set[str]) -> dict[str, int | None]:
        """Exit status of every worker of ``nodes``: this host's processes, other hosts' from the store."""
        exits: dict[str, int | None] = dict(self.values.items(keys.EXITS, values.exit_rc, values.WORKER_RE))
        exits.update({wid: p.poll() for wid, p in self.procs.items()})
        return {wid: exits.get(wid) for wid, node in a.nodes.items() if node in nodes}

    def _next_assignment(self, a: Assignment, failed_nodes: set[str]) -> Assignment | None:
        """The generation after a failure: spares take the failed nodes' ranks; with none left, the policy (shrink,
        wait for a spare to join, or stop). None: the job stops (said, and written to the store)."""
        policy = self.no_spare_policy()
        deadline = time.time() + (self.args.spare_wait_s if policy == "wait" else 0)
        while True:
            try:
                return replace_failed(a, self.workers, failed_nodes, self.dead_spares)
            except NoSpareError as no_spare:
                exc: NoSpareError = no_spare
                if policy == "shrink":
                    try:
                        new = shrink_failed(a, failed_nodes, self.dead_spares)
                    except NoSpareError as none_left:
                        exc = none_left
                    else:
                        print(f"deadpool-run: {exc}; --no-spare-policy shrink: continuing without node(s) "
                              f"{list(new.shrunk)} on {new.world_size} ranks (was {a.world_size}), the state "
                              "resharded from memory", file=sys.stderr, flush=True)
                        self._note_dropped(new)
                        return new
                if time.time() >= deadline:
                    msg = stop_line(str(exc), policy, self._exits_on(a, failed_nodes))
                    self.event(event="stopped", reason=msg)
                    self.store.set_json(keys.ASSIGNMENT, keys.stopped_assignment(a.to_json(), msg))
                    print(f"deadpool-run: {msg}", file=sys.stderr, flush=True)
                    return None
                time.sleep(0.5)
                a = self._join_tick(a)  # a machine joining meanwhile (deadpool-run --join) is a spare
