"""The coordination store's contract: every key a job's processes write or read, defined once.

``contract.py`` is the contract of the environment a launcher hands its workers; this module is the contract of
the store they share. For each key: who writes it, who reads it, and its value. Writers build keys and values
with the functions here; readers decode through the bounded schema the key names (``values.py``: size first,
then JSON with a depth bound, then the schema), so a wrong value written by anyone holding the job's token is
one warning line and reads as absent. No other module spells a key: ``tests/unit/test_store_keys.py`` checks
every store call in the package.

One generation, as the keys see it::

    coordinator  ASSIGNMENT (ranks, nodes, spares)  ->  GENERATION(g) "g-1 is dead"
    workers      HEARTBEAT(w) every --heartbeat-s; SLOT_SIZE(r) at the first snapshot; TRAINED(w) when the loop
                 ended (its last step committed); DONE(w) at the end;
                 FAILED(g, w) when a recovery fails; FATAL when the state cannot be recovered;
                 SUSPECT(w) the moment a step's collective fails in generation g (before any verdict)
    launchers    EXIT(w) for every exit they see; FENCED(n) once FENCE(n) is carried out
    coordinator  FENCE(n) for a failed node; DEAD_SPARES; FINISHED; a stopped job's ASSIGNMENT carries ``stop``

Keys live under the job's namespace (``store/base.py``: the store client prefixes every key with the job id);
what is here is the part after it. The generation's own rendezvous (gloo's addresses and counters) lives under
``store.base.rendezvous_prefix`` and is gloo's protocol, not this one.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..preempt import messages
from . import values

MARK = b"1"
"""The value of a key whose presence is the message (GENERATION, DONE, FENCE, FENCED, FINISHED)."""


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One key (``name``) or one family of keys (``name`` ends in ``/``, the rest names a worker, node, rank,
    generation or host)."""

    name: str
    writer: str
    readers: str
    value: str
    schema: Callable[[str, bytes], Any] | None = None
    """The bounded decoder readers use (None: a marker, or a value only people read)."""

    @property
    def family(self) -> bool:
        return self.name.endswith("/")


# -- the keys ---------------------------------------------------------------------------------------------------
ASSIGNMENT = "assignment"
LEADER = "leader"
FINISHED = "finished"
FATAL = "fatal"
DEAD_SPARES = "dead_spares"
JOB_POLICY = "config/no_spare_policy"
"""``deadpool.elastic.no_spare_policy`` of the job's config, written by rank 0 at attach."""
JOB_STRAGGLER = "config/straggler"
"""``deadpool.straggler`` of the job's config (action, factor, window_s), written by rank 0 at attach."""
JOB_FAST_PATHS = "config/fast_paths"
"""Whether the section the job's engine attached with keeps the in-place swap and a spare's build-ahead on, and why
not: a spare that saw no config before its script (a dict built in code) learns it here (``rebuild/fastpaths.py``)."""
LAUNCHER_POLICY = "launcher/no_spare_policy"
"""``--no-spare-policy`` of the first launcher, for machines that join later."""
DRAIN = "drain"
"""A preemption was noticed (SIGTERM to a launcher or to a worker): every rank drains at its next step boundary
(``preempt/``; the value: ``preempt/messages.py`` ``DrainRequest``)."""
DRAINED = "drained"
"""What the drain persisted and which step is safe, as rank 0 saw it (``preempt/messages.py`` ``DrainOutcome``)."""
JOB_GRACE = "config/preempt_grace_s"
"""``deadpool.preemption.grace_s`` of the job's config, written by rank 0 at attach."""

GENERATIONS = "gen/"
HEARTBEATS = "hb/"
EXITS = "exit/"
DONE = "done/"
FAILURES = "failed/"
FENCES = "fence/"
FENCED = "fenced/"
HOSTS = "host/"
DROPPED = "dropped/"
REPAIRED = "repaired/"
JOIN_REQUESTS = "joined/"
JOIN_ANSWERS = "join_ack/"
LAUNCHES = "launched/"
"""``launched/<host rank>``: how many times that host's launcher started in this job; one that finds it already
written was restarted (its pod, by Kubernetes) and comes back as a spare (``launcher/cli.py``)."""
SLOT_SIZES = "slots/"
HELD_BUFFERS = "held/"
"""``held/<rank>``: how many tier-2 replica buffers (each of its sources' slot size) the rank holds, for spares
preparing theirs while they wait (``snapshot/spare_slots.py``)."""
TRAINED = "trained/"
"""``trained/<worker>``: the worker's training loop ended (its last step, and the version committed on every rank
then): a node lost after every rank's did fails nothing (``decide.py`` ``work_done``)."""
CLIENT_STATES = "client_state/"
"""``client_state/<rank>``: the client state the rank's script last gave ``save_checkpoint``, for a spare whose
restored snapshot was taken before that save (a save at step N follows the snapshot of step N)."""
SUSPECTS = "suspect/"
"""``suspect/<worker>``: a survivor's report that a collective of its generation failed (the coordinator then fails
a peer whose heartbeat went quiet after a short age instead of the full detection timeout: ``decide.py``)."""

SPECS: tuple[KeySpec, ...] = (
    KeySpec(ASSIGNMENT, "coordinator (launcher/cli.py publish, join.py, resize.py stop)",
            "every launcher, every worker (rebuild/worker.py join)",
            "Assignment.to_json() (+ 'stop': the message when the coordinator stopped the job)", values.assignment),
    KeySpec(GENERATIONS, "coordinator, right after ASSIGNMENT of generation g >= 1",
            "survivors' heartbeat threads (rebuild/worker.py) and the generation's rendezvous (dead key)",
            "marker: generation g - 1 is dead"),
    KeySpec(HEARTBEATS, "each worker's heartbeat thread (rebuild/worker.py)", "coordinator (hang detection)",
            "{'t', 'step', 'step_at', 'coll', 'still_s', 'pace'} (rebuild/progress.py)", values.heartbeat),
    KeySpec(EXITS, "the launcher that ran the worker, for every exit", "coordinator",
            "{'rc': exit status (negative: the signal), 'time'}", values.exit_rc),
    KeySpec(DONE, "a worker whose training finished", "coordinator (completion; no hang while it shuts down)",
            "marker"),
    KeySpec(TRAINED, "a worker whose training loop ended, its last snapshot drained (integrations/base.py "
            "mark_trained)", "coordinator (a node lost after the job's work is done: decide.py work_done)",
            "{'generation', 'step', 'committed'}", values.trained),
    KeySpec(CLIENT_STATES, "each rank at its script's save_checkpoint, or before the first one a survivor's loop "
            "counters as it recovers (integrations/deepspeed/checkpoint_calls.py)",
            "a spare whose load_checkpoint is served from a snapshot older than the script's newest save",
            "{'saved': the client state's JSON-able part, 'at': the engine's counters}", values.client_state),
    KeySpec(FAILURES, "a worker whose recovery failed in generation g", "people (deadpool inspect / a store dump)",
            "{'time', 'error'}: the key is failed/<generation>/<worker>"),
    KeySpec(SUSPECTS, "a worker whose step's collective failed, before it waits for the verdict (rebuild/recover.py)",
            "coordinator (a quiet peer failed early: decide.py by_report)",
            "{'generation', 'time', 'what'}: one per worker, the newest report", values.suspect),
    KeySpec(FATAL, "a worker with unrecoverable state (first writer wins)", "coordinator (stops the job)",
            f"UTF-8 text of at most {values.MAX_TEXT} bytes", values.fatal_text),
    KeySpec(FINISHED, "coordinator, once every active worker is done", "every launcher (exits 0)", "marker"),
    KeySpec(FENCES, "coordinator, for a failed node", "the launcher that runs the node", "marker"),
    KeySpec(FENCED, "the node's launcher, once its processes are dead and its memory dropped", "coordinator",
            "marker"),
    KeySpec(HOSTS, "each host's launcher, under its lease (etcd)", "coordinator (a lost host)",
            "the launcher's leader record", None),
    KeySpec(LEADER, "the launcher that wins the election, under its lease", "every launcher",
            "{'host_rank', 'host'} (launcher/leader.py)", values.leader),
    KeySpec(DEAD_SPARES, "coordinator", "a launcher taking the coordinator role over", "a list of node names",
            values.node_list),
    KeySpec(DROPPED, "coordinator, for a node a shrink left out", "the node's launcher (--repair-after-s)",
            "{'time', 'generation'}", values.record_time),
    KeySpec(REPAIRED, "a node's launcher after its repair, or the coordinator admitting a joined machine",
            "coordinator (grow)", "{'time'[, 'joined']}", values.record_time),
    KeySpec(JOIN_REQUESTS, "a machine started with --join NAME", "coordinator", "{'nproc', 'time'}",
            values.join_nproc),
    KeySpec(JOIN_ANSWERS, "coordinator", "the joining machine", "{'ok', 'why', 'as': 'grow' | 'spare'}",
            values.join_ack),
    KeySpec(LAUNCHES, "each host's launcher at its start (not a --join machine)",
            "the same host's launcher started again (launcher/cli.py: it comes back as a spare)",
            "{'starts', 'time'}", values.launches),
    KeySpec(SLOT_SIZES, "each rank at its first snapshot (snapshot/spare_slots.py)",
            "spares preparing their slots", "an int: the rank's slot bytes", values.slot_size),
    KeySpec(HELD_BUFFERS, "each rank at its first snapshot (snapshot/spare_slots.py)",
            "spares preparing their replica buffers", "an int: the replica buffers the rank holds",
            values.held_buffers),
    KeySpec(JOB_POLICY, "rank 0 at attach (integrations/base.py)", "coordinator (no_spare_policy)",
            "one of fail, wait, shrink", values.policy),
    KeySpec(JOB_STRAGGLER, "rank 0 at attach (integrations/base.py)", "coordinator (launcher/straggler.py)",
            "{'action', 'factor', 'window_s'}", values.straggler_config),
    KeySpec(JOB_FAST_PATHS, "rank 0 at attach, before its engine is built (integrations/deepspeed)",
            "spares and late joiners that saw no config before the script (rebuild/fastpaths.py)",
            "{'in_place', 'build_ahead', 'why'}", values.fast_paths),
    KeySpec(LAUNCHER_POLICY, "the first coordinator, when --no-spare-policy is given",
            "a machine joining with --join", "one of fail, wait, shrink", values.policy),
    KeySpec(DRAIN, "a launcher on SIGTERM, or a worker's drain watcher on its own SIGTERM (first writer wins; "
            "launcher/drain.py, preempt/worker.py)", "every worker's drain watcher, every launcher",
            "{'requested_at', 'by'}", messages.drain_request),
    KeySpec(DRAINED, "rank 0 once its drain is decided (integrations/deepspeed/drain.py)",
            "every launcher (its final line, launcher/drain.py)",
            "{'step', 'persisted', 'safe', 'url', 'seconds', 'why', 'nbytes', 'written_at'}", messages.drain_outcome),
    KeySpec(JOB_GRACE, "rank 0 at attach (preempt/worker.py)", "every launcher without --preempt-grace-s",
            "seconds", messages.grace_seconds),
)
BY_NAME = {s.name: s for s in SPECS}

_TAIL = re.compile(r"[A-Za-z0-9_.-]{1,80}")


def _key(family: str, *parts: object) -> str:
    """``family`` + the parts joined by ``/``; every part is a name, a number or a worker id (never a path)."""
    tail = [str(p) for p in parts]
    for p in tail:
        if not _TAIL.fullmatch(p):
            raise ValueError(f"store key {family}...: {p!r} is not a name (allowed: {_TAIL.pattern})")
    return family + "/".join(tail)


def generation(g: int) -> str:
    return _key(GENERATIONS, int(g))


def heartbeat(worker: str) -> str:
    return _key(HEARTBEATS, worker)


def exit_of(worker: str) -> str:
    return _key(EXITS, worker)


def done(worker: str) -> str:
    return _key(DONE, worker)


def failure(g: int, worker: str) -> str:
    return _key(FAILURES, int(g), worker)


def fence(node: str) -> str:
    return _key(FENCES, node)


def fenced(node: str) -> str:
    return _key(FENCED, node)


def host(host_rank: int) -> str:
    return _key(HOSTS, int(host_rank))


def dropped(node: str) -> str:
    return _key(DROPPED, node)


def repaired(node: str) -> str:
    return _key(REPAIRED, node)


def join_request(name: str) -> str:
    return _key(JOIN_REQUESTS, name)


def join_answer(name: str) -> str:
    """The answer to a join request goes under the name the request used, whatever it is: a refused name
    (``../x``, too long) must still hear why. A store key is a flat string, never joined to a path."""
    return JOIN_ANSWERS + name[:4096]


def launched(host_rank: int) -> str:
    return _key(LAUNCHES, int(host_rank))


def launched_value(starts: int) -> dict[str, Any]:
    return {"starts": int(starts), "time": time.time()}


def slot_size(rank: int) -> str:
    return _key(SLOT_SIZES, int(rank))


def held_buffers(rank: int) -> str:
    return _key(HELD_BUFFERS, int(rank))


def client_state(rank: int) -> str:
    return _key(CLIENT_STATES, int(rank))


def suspect(worker: str) -> str:
    return _key(SUSPECTS, worker)


def trained(worker: str) -> str:
    return _key(TRAINED, worker)


def worker_keys(worker: str) -> tuple[str, ...]:
    """What a worker leaves behind (cleared before its node is started again)."""
    return exit_of(worker), done(worker), heartbeat(worker), suspect(worker), trained(worker)


def node_keys(node: str) -> tuple[str, ...]:
    """What fencing a node leaves behind (cleared before it is started again)."""
    return fence(node), fenced(node), dropped(node)


# -- values writers build -----------------------------------------------------------------------------------------
def heartbeat_value(sample: dict[str, Any]) -> dict[str, Any]:
    """``HEARTBEATS``: the time and the progress sample (``rebuild/progress.py``)."""
    return {"t": time.time(), **sample}


def straggler_value(config: Any) -> dict[str, Any]:
    """``JOB_STRAGGLER``: the job's ``deadpool.straggler`` section (a ``config.StragglerConfig``)."""
    return {"action": config.action, "factor": float(config.factor), "window_s": float(config.window_s)}


def exit_value(rc: int) -> dict[str, Any]:
    return {"rc": int(rc), "time": time.time()}


def failure_value(what: str) -> dict[str, Any]:
    return {"time": time.time(), "error": what[:500]}


def trained_value(generation: int, step: int, committed: int | None) -> dict[str, Any]:
    """``TRAINED``: the generation the loop ended in, its last step, and the version committed on every rank then."""
    return {"generation": int(generation), "step": int(step),
            "committed": None if committed is None else int(committed)}


def suspect_value(generation: int, what: str) -> dict[str, Any]:
    """``SUSPECTS``: the generation whose collective failed, when (the worker's clock), and the error, shortened."""
    return {"generation": int(generation), "time": time.time(), "what": what[:values.MAX_REPORT]}


def fast_paths_value(in_place: bool, build_ahead: bool, why: str | None) -> dict[str, Any]:
    """``JOB_FAST_PATHS``: the attached section's fast paths and why one is off, shortened."""
    return {"in_place": bool(in_place), "build_ahead": bool(build_ahead), "why": (why or "")[:values.MAX_REPORT]}


def fatal_value(what: str) -> bytes:
    return what.encode()[:values.MAX_TEXT]


def dropped_value(generation: int) -> dict[str, Any]:
    return {"time": time.time(), "generation": int(generation)}


def repaired_value(joined: bool = False) -> dict[str, Any]:
    return {"time": time.time(), "joined": True} if joined else {"time": time.time()}


def join_request_value(nproc: int) -> dict[str, Any]:
    return {"nproc": int(nproc), "time": time.time()}


def join_answer_value(ok: bool, why: str = "", role: str = "") -> dict[str, Any]:
    if ok:
        return {"ok": True, "as": role}
    return {"ok": False, "why": why[:values.MAX_TEXT]}


def stopped_assignment(assignment_json: dict[str, Any], message: str) -> dict[str, Any]:
    """``ASSIGNMENT`` of a job the coordinator stopped: the last assignment and the message every process shows."""
    return {**assignment_json, "stop": message[:values.MAX_TEXT]}


# -- no_spare_policy: its one resolution ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NoSparePolicy:
    """What a job does when a node fails and no spare is left, and where that came from."""

    policy: str
    source: str


def resolve_no_spare_policy(flag: str | None, job_config: str | None) -> NoSparePolicy:
    """The one rule, for the launcher and the workers alike: ``--no-spare-policy`` (handed to workers as
    ``DEADPOOL_NO_SPARE_POLICY``) wins; else the job's ``deadpool.elastic.no_spare_policy`` (the coordinator reads
    it from ``JOB_POLICY``); else ``fail``."""
    if flag in values.POLICIES:
        return NoSparePolicy(str(flag), "--no-spare-policy")
    if job_config in values.POLICIES:
        return NoSparePolicy(str(job_config), "deadpool.elastic.no_spare_policy")
    return NoSparePolicy("fail", "the default")


__all__ = [
    "ASSIGNMENT", "BY_NAME", "DEAD_SPARES", "DONE", "DRAIN", "DRAINED", "JOB_GRACE",
    "DROPPED", "EXITS", "FAILURES", "FATAL", "FENCED", "FENCES",
    "FINISHED", "GENERATIONS", "HEARTBEATS", "HOSTS", "JOB_FAST_PATHS", "JOB_POLICY", "JOB_STRAGGLER", "JOIN_ANSWERS",
    "JOIN_REQUESTS", "LAUNCHES",
    "KeySpec", "LAUNCHER_POLICY", "LEADER", "MARK", "NoSparePolicy", "REPAIRED", "SLOT_SIZES", "HELD_BUFFERS", "SPECS",
    "SUSPECTS",
    "TRAINED", "done", "dropped", "dropped_value", "exit_of", "exit_value", "failure", "failure_value",
    "fast_paths_value", "fatal_value", "straggler_value", "fence", "fenced", "generation", "heartbeat",
    "heartbeat_value", "held_buffers", "host",
    "join_answer", "join_answer_value", "join_request", "join_request_value", "launched", "launched_value",
    "node_keys", "repaired", "repaired_value",
    "resolve_no_spare_policy", "slot_size", "stopped_assignment", "suspect", "suspect_value", "trained",
    "trained_value", "worker_keys",
]
