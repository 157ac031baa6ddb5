"""A machine joins a running job: ``deadpool-run --join NAME`` on a new host (docs/elastic.md).

Call order, through the store (the job's token is needed to reach it at all):

1. the joiner, a launcher started with the job's ``--store-url``, ``--job-id`` and ``DEADPOOL_STORE_TOKEN``,
   writes ``joined/<NAME>`` (``{"nproc": N, "time": T}``) and starts its N processes as spares, which import
   everything and wait for an assignment (:meth:`Joiner.request`);
2. the coordinator, on its next turn, checks the request: a new node name of ``[A-Za-z][A-Za-z0-9_-]``, as many
   processes as the job's nodes. It answers ``join_ack/<NAME>``: refused with the reason, or admitted, and then
   the node's workers are the job's: a world shrunk by ``--no-spare-policy shrink`` grows to it (as to a
   repaired node: ``resize.py``), otherwise it joins the spare pool (the assignment's ``spares``, written back to
   the store, where a coordinator taking the role over reads it). A coordinator awaiting a spare
   (``--no-spare-policy wait``) gives it the failed ranks at once. The rules are ``decide.py``'s
   (``join_refusal``, ``_Turn.joins``);
3. the joiner prints the answer (:meth:`Joiner.tick`): refused, it stops its processes and exits 2; no answer
   within :data:`JOIN_ACK_S`, it stops them and exits 1. Admitted, it is a follower like any other launcher: it
   reports its workers' exits and obeys fences until the job ends.

A joiner holds no lease (it is not one of the job's ``--hosts``), so it never takes the coordinator role, and
its host's loss is found by its workers' heartbeats and exits, not by a lapsed lease.

A host's launcher started again in a job that still runs (a pod restarted by Kubernetes: the same command line,
the same ``--host-rank``) joins the same way, without a flag: :func:`count_start` finds its host's earlier start
in ``launched/<host rank>`` and it comes back as the spare ``host<R>-<N>`` (docs/multi-host.md).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

from . import keys, values
from .decide import JOIN_RE, JOINED_HOST

log = logging.getLogger("deadpool_ext.launcher")

JOIN_ACK_S = 120.0
"""How long a joiner waits for the coordinator's answer."""
JOIN_STORE_LOST_S = 30.0
"""An admitted joiner whose job's store has not answered for this long stops its processes (the job is gone)."""
JOIN_POLL_S = 1.0
"""How often the coordinator reads the join requests."""


def restarted_name(host_rank: int, starts_before: int, hosts: int, leader_alive: bool) -> str | None:
    """The spare name a host's launcher joins its running job under when it was started before in this job
    (pure): ``host<R>-<N>`` for its N-th start again; None for its first start, for a job of one host (nothing of it
    runs on), or when no launcher coordinates the job now (no live ``leader`` key: the job is gone or starts over,
    and a spare would wait for nobody)."""
    if starts_before < 1 or hosts < 2 or not leader_alive:
        return None
    return f"host{int(host_rank)}-{int(starts_before)}"


def count_start(reads: values.StoreValues, host_rank: int, hosts: int) -> str | None:
    """Every host's launcher (not a ``--join`` machine) at its start, once connected: counts the start in
    ``launched/<host rank>`` and returns the name to join under when it was restarted (its pod restarted by
    Kubernetes, its process started again by a supervisor) into a job that still runs: its lease and its nodes'
    places are gone, so it comes back as a spare, as ``deadpool-run --join`` would (the coordinator admits it and
    fails the nodes it ran before through their lapsed lease and silent heartbeats)."""
    key = keys.launched(host_rank)
    before = reads.get(key, values.launches) or 0
    reads.store.set_json(key, keys.launched_value(before + 1))
    name = restarted_name(host_rank, before, hosts, reads.get(keys.LEADER, values.leader) is not None)
    if before and name is None:
        log.warning("host %d's launcher started before in this job, but %s: it starts as host %d again", host_rank,
                    "the job has one host" if hosts < 2 else "no launcher coordinates the job now", host_rank)
    return name


class Joiner:
    """The joining machine's side (``--join NAME``)."""

    def __init__(self, args: Any, job_id: str) -> None:
        self.args, self.job_id = args, job_id
        self.name: str = args.join
        self.deadline = 0.0
        self.answered = False
        self._store_ok = time.time()

    def request(self, reads: values.StoreValues) -> None:
        """Before the processes start: take the job's --no-spare-policy (its workers must restore as the job's
        do: an elastic restore is collective), then ask to be admitted."""
        store = reads.store
        job_policy = reads.get(keys.LAUNCHER_POLICY, values.policy)
        if job_policy is not None and self.args.no_spare_policy not in (None, job_policy):
            raise SystemExit(f"deadpool-run: --join {self.name}: --no-spare-policy {self.args.no_spare_policy}, "
                             f"but job {self.job_id} runs with {job_policy}: drop the flag")
        if job_policy in ("fail", "wait", "shrink"):
            self.args.no_spare_policy = job_policy
        if store.get(keys.join_request(self.name)) is not None:
            raise SystemExit(f"deadpool-run: --join {self.name}: a machine already asked to join job "
                             f"{self.job_id} under that name; pass another --join NAME")
        self.deadline = time.time() + JOIN_ACK_S
        self.answered = False
        self._store_ok = time.time()
        store.set_json(keys.join_request(self.name), keys.join_request_value(self.args.nproc_per_node))
        log.info("--join %s: asked job %s to admit this node (%d process(es)); its processes start as spares",
                 self.name, self.job_id, self.args.nproc_per_node)

    def tick(self, reads: values.StoreValues) -> int | None:
        """None to go on, else the exit code: refused, unanswered, or (admitted) the job's store gone."""
        name = self.name
        try:
            ack = reads.get(keys.join_answer(name), values.join_ack)
            self._store_ok = time.time()
        except Exception as exc:
            if time.time() - self._store_ok < JOIN_STORE_LOST_S:
                return None
            print(f"deadpool-run: --join {name}: job {self.job_id}'s store has not answered for "
                  f"{JOIN_STORE_LOST_S:.0f}s ({exc}): the job is gone; stopping this node's processes",
                  file=sys.stderr, flush=True)
            return 1
        if self.answered:
            return None
        if ack is None:
            if time.time() < self.deadline:
                return None
            print(f"deadpool-run: --join {name}: no answer from job {self.job_id}'s coordinator within "
                  f"{JOIN_ACK_S:.0f}s (is the job running, with this --store-url and --job-id?)", file=sys.stderr,
                  flush=True)
            return 1
        if not ack.ok:
            print(f"deadpool-run: --join {name}: refused by job {self.job_id}'s coordinator: "
                  f"{ack.why or 'no reason given'}", file=sys.stderr, flush=True)
            return 2
        self.answered = True
        role = "the world grows to it" if ack.role == "grow" else "a spare node"
        print(f"deadpool-run: --join {name}: admitted to job {self.job_id} ({role})", file=sys.stderr, flush=True)
        return None


__all__ = ["JOINED_HOST", "JOIN_ACK_S", "JOIN_POLL_S", "JOIN_RE", "JOIN_STORE_LOST_S", "Joiner"]
