"""A machine joins a running job: ``deadpool-run --join NAME`` on a new host (docs/elastic.md). A mixin of
:class:`deadpool_ext.launcher.cli.Supervisor`, whose state it uses.

Call order, through the store (the job's token is needed to reach it at all):

1. the joiner, a launcher started with the job's ``--store-url``, ``--job-id`` and ``DEADPOOL_STORE_TOKEN``,
   writes ``joined/<NAME>`` (``{"nproc": N, "time": T}``) and starts its N processes as spares, which import
   everything and wait for an assignment (:meth:`_join_request`);
2. the coordinator, on its next turn, checks the request: a new node name of ``[A-Za-z][A-Za-z0-9_-]``, as many
   processes as the job's nodes. It answers ``join_ack/<NAME>``: refused with the reason, or admitted, and then
   the node's workers are the job's: a world shrunk by ``--no-spare-policy shrink`` grows to it (as to a
   repaired node: ``resize.py``), otherwise it joins the spare pool (the assignment's ``spares``, written back to
   the store, where a coordinator taking the role over reads it). A coordinator waiting for a spare
   (``--no-spare-policy wait``) takes it at once (:meth:`_join_tick`);
3. the joiner prints the answer (:meth:`_joiner_tick`): refused, it stops its processes and exits 2; no answer
   within :data:`JOIN_ACK_S`, it stops them and exits 1. Admitted, it is a follower like any other launcher: it
   reports its workers' exits and obeys fences until the job ends.

A joiner holds no lease (it is not one of the job's ``--hosts``), so it never takes the coordinator role, and
its host's loss is found by its workers' heartbeats and exits, not by a lapsed lease.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from ..cluster.membership import Assignment, Worker
from . import keys, values
from .values import StoreReads

log = logging.getLogger("deadpool_ext.launcher")

JOIN_RE = values.NODE_RE
"""A joining node's name: it becomes part of store keys, worker ids and a shared-memory directory name."""
JOIN_ACK_S = 120.0
"""How long a joiner waits for the coordinator's answer."""
JOIN_STORE_LOST_S = 30.0
"""An admitted joiner whose job's store has not answered for this long stops its processes (the job is gone)."""
JOIN_POLL_S = 1.0
"""How often the coordinator reads the join requests."""
JOINED_HOST = -1
"""The host index of a joined node (it is none of the job's --hosts: never among the hosts whose lease lapsed)."""


class JoinNodes(StoreReads):
    args: Any
    store: Any
    job_id: str
    workers: list[Worker]
    spare_nodes: list[str]
    active_nodes: list[str]
    node_host: dict[str, int]
    assignment: Assignment

    if TYPE_CHECKING:  # provided by the Supervisor and its other mixins
        def event(self, **rec: Any) -> None: ...

        def no_spare_policy(self) -> str: ...

    # -- the joiner -------------------------------------------------------------------------------------
    @property
    def joining(self) -> bool:
        return bool(getattr(self.args, "join", None))

    def _join_request(self) -> None:
        """Before the processes start: take the job's --no-spare-policy (its workers must restore as the job's
        do: an elastic restore is collective), then ask to be admitted."""
        job_policy = self.values.get(keys.LAUNCHER_POLICY, values.policy)
        if job_policy is not None and self.args.no_spare_policy not in (None, job_policy):
            raise SystemExit(f"deadpool-run: --join {self.args.join}: --no-spare-policy {self.args.no_spare_policy}, "
                             f"but job {self.job_id} runs with {job_policy}: drop the flag")
        if job_policy in ("fail", "wait", "shrink"):
            self.args.no_spare_policy = job_policy
        if self.store.get(keys.join_request(self.args.join)) is not None:
            raise SystemExit(f"deadpool-run: --join {self.args.join}: a machine already asked to join job "
                             f"{self.job_id} under that name; pass another --join NAME")
        self._join_deadline = time.time() + JOIN_ACK_S
        self._join_answered = False
        self.store.set_json(keys.join_request(self.args.join), keys.join_request_value(self.args.nproc_per_node))
        log.info("--join %s: asked job %s to admit this node (%d process(es)); its processes start as spares",
                 self.args.join, self.job_id, self.args.nproc_per_node)

    def _joiner_tick(self) -> int | None:
        """None to go on, else the exit code: refused, unanswered, or (admitted) the job's store gone."""
        name = self.args.join
        try:
            ack = self.values.get(keys.join_answer(name), values.join_ack)
            self._join_store_ok = time.time()
        except Exception as exc:
            if time.time() - getattr(self, "_join_store_ok", time.time()) < JOIN_STORE_LOST_S:
                return None
            print(f"deadpool-run: --join {name}: job {self.job_id}'s store has not answered for "
                  f"{JOIN_STORE_LOST_S:.0f}s ({exc}): the job is gone; stopping this node's processes",
                  file=sys.stderr, flush=True)
            return 1
        if self._join_answered:
            return None
        if ack is None:
            if time.time() < self._join_deadline:
                return None
            print(f"deadpool-run: --join {name}: no answer from job {self.job_id}'s coordinator within "
                  f"{JOIN_ACK_S:.0f}s (is the job running, with this --store-url and --job-id?)", file=sys.stderr,
                  flush=True)
            return 1
        if not ack.ok:
            print(f"deadpool-run: --join {name}: refused by job {self.job_id}'s coordinator: "
                  f"{ack.why or 'no reason given'}", file=sys.stderr, flush=True)
            return 2
        self._join_answered = True
        role = "the world grows to it" if ack.role == "grow" else "a spare node"
        print(f"deadpool-run: --join {name}: admitted to job {self.job_id} ({role})", file=sys.stderr, flush=True)
        return None

    # -- the coordinator ----------------------------------------------------------------------------------
    def _join_tick(self, a: Assignment) -> Assignment:
        """Answer every new join request (the store is read once a second at most); returns the current
        assignment (with a spare added, if one joined)."""
        now = time.monotonic()
        if now < self.__dict__.get("_join_next", 0.0):
            return a
        self._join_next = now + JOIN_POLL_S
        decided: set[str] = self.__dict__.setdefault("_join_decided", set())
        for key, raw in sorted(self.store.list(keys.JOIN_REQUESTS).items()):
            name = key[len(keys.JOIN_REQUESTS):]
            if name in decided:
                continue
            decided.add(name)
            # answered by a coordinator before this one (or written by anyone holding the token): its answer
            # decides nothing until the request passes the same checks here
            earlier = self.values.get(keys.join_answer(name), values.join_ack) if JOIN_RE.fullmatch(name) else None
            why = self._join_refusal(name, raw)
            if why is not None:
                if earlier is None or earlier.ok:
                    self.store.set_json(keys.join_answer(name), keys.join_answer_value(False, why))
                    self.event(event="join_refused", node=name[:80], why=why)
                    log.warning("join of node %s refused: %s", values.echo(name, 80), why)
                continue
            if earlier is not None:  # learn the workers a coordinator before this one admitted
                if earlier.ok:
                    self._admit(name)
                continue
            self._admit(name)
            shrunk = len(set(a.nodes.values())) < len(self.active_nodes) and self.no_spare_policy() == "shrink"
            if shrunk:  # grown to on the coordinator's next turn without a failure (resize._grow_tick)
                self.store.set_json(keys.repaired(name), keys.repaired_value(joined=True))
            else:
                a = Assignment.from_json({**a.to_json(), "spares": [*a.spares, name]})
                self.store.set_json(keys.ASSIGNMENT, a.to_json())
                self.assignment = a
            role = "grow" if shrunk else "spare"
            self.store.set_json(keys.join_answer(name), keys.join_answer_value(True, role=role))
            self.event(event="joined", node=name, role=role, generation=a.generation)
            print(f"deadpool-run: node {name} joined the job ({self.args.nproc_per_node} process(es)): "
                  + ("the shrunk world grows to it" if shrunk else "a spare node"), file=sys.stderr, flush=True)
        return a

    def _join_refusal(self, name: str, raw: bytes) -> str | None:
        if not JOIN_RE.fullmatch(name):
            return (f"node name {name[:80]!r}: must be 1-63 characters of [A-Za-z0-9_-], the first a letter "
                    "(--join NAME)")
        if name in {w.node for w in self.workers}:
            return f"node name {name!r} is taken by a node of this job: pass another --join NAME"
        try:
            req = values.decode_json(keys.join_request(name), raw)
        except values.BadValue as exc:
            return f"the join request is not usable: {exc}"
        nproc = req.get("nproc") if isinstance(req, dict) else None
        if type(nproc) is not int or nproc != self.args.nproc_per_node:
            return (f"the joining node has {values.echo(nproc)} process(es), this job's nodes have "
                    f"{self.args.nproc_per_node}: pass --nproc-per-node {self.args.nproc_per_node}")
        return None

    def _admit(self, name: str) -> None:
        self.workers.extend(Worker(f"{name}.{i}", name, i) for i in range(self.args.nproc_per_node))
        if name not in self.spare_nodes:
            self.spare_nodes.append(name)
        self.node_host[name] = JOINED_HOST
