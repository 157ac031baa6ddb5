"""A spare's side of a hot-swap before its assignment: its engine built ahead of any failure, then the wait.

Why: a spare that waits for its assignment before it builds anything makes the survivors wait, after the failure,
for everything its script does before the first step (imports, tokenizer, dataset, model, the DeepSpeed engine):
seconds on a tiny model, minutes on a real job. A spare built ahead has done all of it before the failure, so an
assignment costs only joining the survivors' communicators and the restore.

Call order (a deadpool-run spare whose config has ``hot_swap.in_place`` and ``hot_swap.spare_build_ahead``, the
defaults):

1. :func:`build_ahead` (``distributed.init_distributed``, before the script's first line under ``deadpool_ext.run``):
   the published assignment says the world; the spare takes the ranks of the node it shadows
   (``cluster/membership.py`` :func:`prepared_rank`: the i-th spare the (i+1)-th node), builds its default group
   *solo* for that rank (``rebuild/swap.py``) and says so in its heartbeats (``prepared``: the coordinator prefers
   it for that node's ranks, ``launcher/decide.py``);
2. the script runs up to its engine: ``deepspeed.initialize`` builds it alone, as a spare after an assignment
   always did (``integrations/deepspeed``);
3. :func:`await_assignment` (in ``register``, i.e. at the end of ``deepspeed.initialize``, before the runtime is
   made): the ``spare_ready`` timeline event (prologue and engine build, each timed; whether it can take any
   node's ranks, and if not what blocks it: the one start-up line), then the wait. :func:`takeover` (pure) decides
   how it takes its assignment. The ranks it built for (``as_built``), or another rank of the same world
   (``relabel``: the process's groups (``rebuild/swap.py`` :func:`relabel`) and the framework's objects
   (:class:`Relabel`, ``integrations/deepspeed/takeover.py``) set to the new rank, in well under a millisecond):
   the join is pending (``pending_live``) and the script's ``resume()`` joins the survivors and restores the
   assigned rank's state, RNG included (``Recovery.join_survivors``). Otherwise (a blocker, another world size, a
   resize): the process starts again from its first line (:func:`start_again`, one log line naming why), which is
   the path of a spare that never built ahead. The wait is inside ``deepspeed.initialize`` on purpose: a script
   reads its rank from the engine (or ``dist.get_rank()``) right after it returns, so the relabel must come
   first; returning a spare's engine before its assignment would hand the script the build-time rank.

The spare's life is one state machine, the same for every framework (:class:`SpareLife`, held by the process's
context; :data:`NEXT` lists the transitions, and a transition not there raises :class:`SpareStateError`)::

    starting ──> building_ahead ──> waiting ──> joining ──> joined
        │              │               │           ^
        │              v               v           │
        │           failed          building ──────┘ (in place) ──> joined (a rebuild: every rank's groups live)
        └──> waiting (cannot build ahead: before its script) / building (started again, already assigned)

- ``starting``: the process runs, nothing decided (``run.py``, ``distributed.init_distributed``);
- ``building_ahead``: its groups solo for the shadowed node's ranks, the script builds its engine (step 1-2);
- ``waiting``: for an assignment, its engine built (step 3, in the framework's call) or, when it could not build
  ahead, before its script (the reason is the one start-up line);
- ``building``: assigned, it builds for its assignment: started again from its script's first line
  (:func:`start_again`), or the plain path of a spare that did not build ahead;
- ``joining``: it holds its assigned ranks, its groups solo, and joins the survivors' communicators at the script's
  ``resume()`` (``Recovery.join_survivors``);
- ``joined``: its state restored (the ``recover`` timeline event of role ``spare``): a worker like the others;
- ``failed``: its script failed before any assignment (:func:`start_up_failure_said`); the launcher's
  ``spare_lost`` says the same of a spare process that died.

Each transition is a ``spare_state`` timeline event (``state``, ``previous``, ``why``; ``deadpool timeline`` prints
each spare's path), beside the events the phases are computed from: ``spare_ready`` (built ahead, waiting; whether it
can take any node's ranks), ``spare_assigned`` (how: ``as_built``, ``relabel`` or ``start_again``, and why) and the
``recover`` event of role ``spare``.

A spare that cannot build ahead (the key off on a memory-tight host, the in-place swap off or unsupported, no node
to shadow) waits before its script, as before, and says why in one line. A spare that saw no config before its
script (a dict built in code) waits first for the job's engine to attach and say what its section holds
(``rebuild/fastpaths.py``), then builds ahead or not as a config on the command line would have made it.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..cluster.assignment import Assignment
from ..cluster.membership import prepared_rank, shadowed_node
from ..launcher import keys, values
from ..recovery.timeline import write_event
from . import rank_reads, regroup
from .context import context
from .fastpaths import NO_CONFIG, FastPaths, at_attach, from_record, spare_line

if TYPE_CHECKING:
    from ..config import DeadpoolConfig
    from .worker import Membership

log = logging.getLogger("deadpool_ext")


class SpareState(str, enum.Enum):
    """The states of a spare's life (the module docstring)."""

    STARTING = "starting"
    BUILDING_AHEAD = "building_ahead"
    WAITING = "waiting"
    BUILDING = "building"
    JOINING = "joining"
    JOINED = "joined"
    FAILED = "failed"


NEXT: Mapping[SpareState, frozenset[SpareState]] = {
    SpareState.STARTING: frozenset({SpareState.BUILDING_AHEAD, SpareState.WAITING, SpareState.BUILDING}),
    SpareState.BUILDING_AHEAD: frozenset({SpareState.WAITING, SpareState.FAILED}),
    SpareState.WAITING: frozenset({SpareState.JOINING, SpareState.BUILDING, SpareState.FAILED}),
    SpareState.BUILDING: frozenset({SpareState.JOINED, SpareState.FAILED}),
    SpareState.JOINING: frozenset({SpareState.JOINED, SpareState.FAILED}),
    SpareState.JOINED: frozenset(),
    SpareState.FAILED: frozenset(),
}
"""Every transition of a spare's life; the states with none are its ends."""


class SpareStateError(RuntimeError):
    """A transition :data:`NEXT` does not list: a bug in deadpool_ext's spare path, never a user's input."""


def refusal(now: SpareState, to: SpareState) -> str | None:
    """Why ``now -> to`` is not a transition of a spare's life (pure; None: it is)."""
    if to in NEXT[now]:
        return None
    allowed = ", ".join(sorted(x.value for x in NEXT[now])) or "none: it is an end"
    return f"a spare in state {now.value!r} cannot go to {to.value!r} (allowed: {allowed})"


@dataclass
class SpareLife:
    """A spare's life in this process (held by its context, ``rebuild/context.py``): its state, what it built its
    engine for ahead of any failure, and its phases' times for its ``recover`` timeline event (process start, engine
    build start and length, the assignment, ready to join, communicators joined)."""

    state: SpareState = SpareState.STARTING
    built: BuiltAhead | None = None
    """While ``building_ahead`` and ``waiting`` after a build ahead: the ranks it built for."""
    times: dict[str, float] = field(default_factory=dict)
    path: list[str] = field(default_factory=lambda: [SpareState.STARTING.value])
    """The states it went through in this process, in order (``starting`` first)."""

    def to(self, state: SpareState, worker: str, why: str) -> None:
        """Take the transition to ``state`` (``why``: what made it), as a ``spare_state`` timeline event and a
        DEBUG line; :class:`SpareStateError` for one :data:`NEXT` does not list."""
        bad = refusal(self.state, state)
        if bad is not None:
            raise SpareStateError(f"spare {worker}: {bad}; it was going there because {why}")
        previous, self.state = self.state, state
        self.path.append(state.value)
        write_event(event="spare_state", worker=worker, state=state.value, previous=previous.value, why=why)
        log.debug("spare %s: %s -> %s (%s)", worker, previous.value, state.value, why)


def life() -> SpareLife:
    """This process's spare life (``starting`` in any process that is not a spare)."""
    return context().spare


@dataclass(frozen=True, slots=True)
class BuiltAhead:
    """What a spare built its engine for before any failure (held by the context until its assignment)."""

    rank: int
    world_size: int
    generation: int
    """The generation whose assignment it read (it waits for a later one that includes it)."""
    node: str
    """The active node whose ranks it took."""
    timeout_s: float
    """The collective timeout its groups will have once they join."""
    node_ranks: tuple[int, ...] = ()
    """That node's ranks, by local index (a relabel across subgroups exchanges them for the assigned node's)."""
    while_waiting: Callable[[], None] | None = None
    """What the wait does on each turn (``--spare-slots prepare``: the snapshot slots)."""


def build_ahead(m: Membership, worker_id: str, node: str, timeout_s: float, *, fast: FastPaths,
                while_waiting: Callable[[], None] | None = None, published_wait_s: float = 120.0,
                poll_s: float = 0.2) -> bool:
    """Step 1 of the module's call order, the spare's first transition. True: the default group is built solo for
    the shadowed node's rank (``building_ahead``); False: this spare waits for its assignment before its script
    (``waiting``, the real reason logged), or was assigned already (``building``: it started again, or the job
    assigned it before its engine attached). ``fast``: the runner's reading of the configs it saw
    (``rebuild/fastpaths.py``); with none seen, the spare first waits for the job's engine to attach and say what
    its section holds (or for its assignment, whichever comes first)."""
    state, why = _build_ahead(m, worker_id, node, timeout_s, fast=fast, while_waiting=while_waiting,
                              published_wait_s=published_wait_s, poll_s=poll_s)
    life().to(state, worker_id, why)
    return state is SpareState.BUILDING_AHEAD


def _build_ahead(m: Membership, worker_id: str, node: str, timeout_s: float, *, fast: FastPaths,
                 while_waiting: Callable[[], None] | None, published_wait_s: float,
                 poll_s: float) -> tuple[SpareState, str]:
    from . import swap
    from .worker import MembershipError, export_world, init_solo

    why = (None if not fast.known or fast.build_ahead else fast.why_not) or swap.unsupported()
    published = None if why else _published(m, published_wait_s)
    if why is None and published is None:
        why = f"no assignment was published within {published_wait_s:.0f} s (store key {keys.ASSIGNMENT!r})"
    if why is not None or published is None:
        log.info(spare_line(worker_id, why or "no assignment was published"))
        return SpareState.WAITING, f"it waits before its script, not built ahead: {why}"
    if published.stop:
        raise MembershipError(f"launcher stopped the job: {published.stop}")
    if worker_id in published.assignment.ranks:  # started again after an assignment (start_again): the plain path
        return SpareState.BUILDING, "it is assigned already: it builds for its assignment"
    if not fast.known:
        learned = _learn(m, worker_id, while_waiting, poll_s)
        if learned is None:  # assigned before any rank attached: the plain path
            log.info(spare_line(worker_id, f"{NO_CONFIG}, and it was assigned before the job's engine attached"))
            return SpareState.BUILDING, "it was assigned before the job's engine attached: it builds for it"
        if not learned.build_ahead:
            log.info(spare_line(worker_id, f"{NO_CONFIG}; the job's engine attached with {learned.why_not}"))
            return SpareState.WAITING, f"it waits before its script, not built ahead: {learned.why_not}"
        published = m.published() or published
        if worker_id in published.assignment.ranks:
            return SpareState.BUILDING, "it is assigned already: it builds for its assignment"
    a = published.assignment
    local = int(worker_id.rsplit(".", 1)[1])
    rank, shadow = prepared_rank(a, node, local), shadowed_node(a, node)
    if rank is None or shadow is None:
        why = (f"node {node} is not among the assignment's spares (it joined to grow the world)" if shadow is None
               else f"node {shadow}, which it would shadow, has no process {local}")
        log.info(spare_line(worker_id, why))
        return SpareState.WAITING, f"it waits before its script, not built ahead: {why}"
    ctx = context()
    ctx.spare.built = BuiltAhead(rank=rank, world_size=a.world_size, generation=a.generation, node=shadow,
                                 node_ranks=tuple(a.node_ranks(shadow)), timeout_s=timeout_s,
                                 while_waiting=while_waiting)
    ctx.progress.prepared = (rank, a.world_size)
    export_world(a, rank, shadow)  # the world as the shadowed node's process sees it
    init_solo(rank, a.world_size, timeout_s)
    regroup.record()  # the names of the groups the script makes: a relabel across subgroups needs them
    rank_reads.start()  # what of the script keeps this rank: it would block taking another (rank_reads.py)
    log.info("spare %s: building its engine ahead of any failure, as rank %d of %d (node %s's ranks); it waits for "
             "an assignment once the engine exists", worker_id, rank, a.world_size, shadow)
    return SpareState.BUILDING_AHEAD, f"it builds its engine for node {shadow}'s rank {rank} of {a.world_size}"


def _learn(m: Membership, worker_id: str, while_waiting: Callable[[], None] | None,
           poll_s: float) -> FastPaths | None:
    """No config was visible before the script: wait for the job's record of its section (rank 0 writes it at
    attach), or for an assignment that includes this spare (None). No deadline of its own: it is the spare's wait
    for an assignment, which a stop of the job ends too."""
    from .worker import MembershipError

    log.info("spare %s: %s; it waits for the job's engine to attach (the section the script passes decides whether "
             "it builds ahead)", worker_id, NO_CONFIG)
    while True:
        job = m.job_fast_paths()
        if job is not None:
            return from_record(job)
        published = m.published()
        if published is not None:
            if published.stop:
                raise MembershipError(f"launcher stopped the job: {published.stop}")
            if worker_id in published.assignment.ranks:
                return None
        if while_waiting is not None:
            while_waiting()
        time.sleep(poll_s)


def publish_fast_paths(cfg: DeadpoolConfig, *, rank: int, swaps_in_place: bool, framework: str) -> None:
    """Rank 0 of a deadpool-run job, at attach (before its engine is built, so spares learn it early): what its
    section says of the fast paths, for spares that saw no config before their script (``rebuild/fastpaths.py``).
    A no-op elsewhere; a store error is logged, never raised (the spare then waits for its assignment)."""
    m = context().membership
    if m is None or rank != 0:
        return
    fast = at_attach(cfg, swaps_in_place=swaps_in_place, framework=framework)
    try:
        m.publish_fast_paths(fast.in_place, fast.build_ahead, fast.why_not)
    except Exception as exc:  # spares then build after an assignment: slower, never wrong
        log.warning("could not publish the job's fast paths for spares (%s): they build after an assignment", exc)


def _published(m: Membership, wait_s: float) -> values.Published | None:
    deadline = time.monotonic() + wait_s
    while True:
        published = m.published()
        if published is not None or time.monotonic() >= deadline:
            return published
        time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Relabel:
    """What a framework integration offers a spare built ahead for one rank, to take another rank of the same world
    in place (``integrations/deepspeed/takeover.py``)."""

    why_not: str | None
    """What of the framework's objects holds the build-time rank and cannot be set again (None: nothing)."""
    apply: Callable[[int], None]
    """Sets the framework's objects to the new rank (the process's groups already answer it)."""
    covers: tuple[str, ...] = ()
    """Top-level packages whose reads of the rank (``rank_reads.py``) :attr:`apply` covers (Accelerate's)."""
    check_mapping: Callable[[Mapping[int, int]], str | None] | None = None
    """The framework's groups are subgroups of the world (Megatron-Core): another node's ranks are taken by
    exchanging the two nodes' ranks (``regroup.py``), when this says nothing against the exchange (None: it can;
    e.g. the two nodes' coordinates differ in data parallelism only). None here: every group spans the world and
    is renumbered (``swap.relabel``)."""
    apply_mapping: Callable[[Mapping[int, int]], object] | None = None
    """With :attr:`check_mapping`: the framework's own copies of ranks, mapped after the groups were."""


@dataclass(frozen=True, slots=True)
class Takeover:
    """How a spare built ahead takes its assignment (:func:`takeover`)."""

    how: str
    """``as_built`` (the rank it built for), ``relabel`` (another rank of the same world, in place) or
    ``start_again`` (the process again from the script's first line, :func:`start_again`)."""
    rank: int
    why: str = ""
    """``start_again``: why not in place."""


def takeover(a: Assignment, worker_id: str, built: BuiltAhead, blocker: str | None) -> Takeover:
    """How the spare ``worker_id``, its engine built ahead as ``built``, takes assignment ``a`` (pure). ``blocker``:
    what keeps its objects on the build-time rank (:class:`Relabel`'s ``why_not``, or the process groups')."""
    rank = a.ranks[worker_id]
    if matches(a, worker_id, built):
        return Takeover("as_built", rank)
    if a.resized:
        why = "the world was resized (elastic)"
    elif a.world_size != built.world_size:
        why = f"the world has {a.world_size} ranks, its engine was built for {built.world_size}"
    elif blocker is not None:
        why = blocker
    else:
        return Takeover("relabel", rank)
    return Takeover("start_again", rank, why)


def await_assignment(relabel: Relabel | None = None, prepare: Callable[[], object] | None = None) -> None:
    """Step 3 of the module's call order; a no-op in any process but a spare built ahead. ``relabel``: the
    framework's offer to take another rank of the same world in place (None: it cannot). ``prepare``: what the
    runtime made after the wait does that depends on no rank (the node's memory directory and agent), done before
    it; a failure there is logged and left to the runtime, which does it again."""
    ctx = context()
    built, m = ctx.spare.built, ctx.membership
    if built is None or m is None:
        return
    from . import swap

    now = time.time()
    times = ctx.spare.times
    engine_at = times.get("engine_started_at", now)
    times.update(built_ahead=True, prologue_s=round(engine_at - times.get("started_at", engine_at), 3),
                 engine_s=round(now - engine_at, 3), ready_at=now)
    # the framework's own refusal first (what of its objects keeps the build-time rank), then the script's reads
    refusal = relabel.why_not if relabel is not None else "the framework offers no relabel of its objects"
    read = rank_reads.stop(relabel.covers if relabel is not None and refusal is None else ())
    subgroups = relabel is not None and relabel.check_mapping is not None
    blocker = refusal or read or (None if subgroups else swap.relabel_refusal(built.world_size))
    write_event(event="spare_ready", worker=m.worker_id, rank=built.rank, world_size=built.world_size,
                node=built.node, pid=os.getpid(), prologue_s=times["prologue_s"], engine_s=times["engine_s"],
                any_rank=blocker is None, why_not=blocker)
    log.info("spare %s: engine built ahead for rank %d of %d (script up to its engine %.1f s, engine %.1f s); "
             "waiting for an assignment; %s", m.worker_id, built.rank, built.world_size, times["prologue_s"],
             times["engine_s"], "it takes any node's ranks in place" if blocker is None else
             f"another node's ranks start it again from the script's first line: {blocker}")
    life().to(SpareState.WAITING, m.worker_id, f"its engine is built ahead for rank {built.rank} of {built.world_size}"
              + ("" if blocker is None else f"; another node's ranks would start it again: {blocker}"))
    if prepare is not None:
        try:
            prepare()
        except Exception as exc:  # the runtime does it again after the assignment, and raises there
            log.warning("spare %s: preparing its node's memory before the assignment failed (%s); the runtime does "
                        "it after", m.worker_id, exc)
    a = m.join(built.generation + 1, timeout_s=None, while_waiting=built.while_waiting)
    ctx.spare.built = None
    ctx.progress.prepared = None
    times["assigned_at"] = time.time()
    t = takeover(a, m.worker_id, built, blocker)
    if t.how == "relabel" and subgroups:
        assert relabel is not None
        why = _regroup(a, m.worker_id, built, relabel)
        if why is not None:
            t = Takeover("start_again", t.rank, why)
    regroup.stop()
    if t.how == "relabel":
        times["relabelled_from"] = built.rank
        assert relabel is not None
        from .worker import export_world

        if not subgroups:
            swap.relabel(t.rank)
        export_world(a, t.rank, a.nodes[m.worker_id])
        relabel.apply(t.rank)
        times["relabel_s"] = round(time.time() - times["assigned_at"], 4)
        log.info("generation %d: rank %d of %d; this spare built its engine for rank %d and relabelled it: it joins "
                 "the survivors now", a.generation, t.rank, a.world_size, built.rank)
    from . import warm

    write_event(event="spare_assigned", worker=m.worker_id, generation=a.generation, rank=t.rank,
                built_rank=built.rank, how=t.how, why=t.why or None, relabel_s=times.get("relabel_s"),
                **({"warm": warm.is_child()} if t.how == "start_again" else {}))
    if t.how in ("as_built", "relabel"):
        life().to(SpareState.JOINING, m.worker_id, f"assigned rank {t.rank} in generation {a.generation}, taken "
                  + ("as built" if t.how == "as_built" else f"by a relabel from rank {built.rank}"))
        ctx.pending_live = (a, m.worker_id, built.timeout_s)
        if t.how == "as_built":
            log.info("generation %d: rank %d of %d, the rank this spare built its engine for: it joins the survivors "
                     "now", a.generation, built.rank, built.world_size)
        return
    log.warning("spare %s: assigned rank %d of %d in generation %d, but its engine was built for rank %d of %d (%s): "
                "it starts again from the script's first line for its assignment (%s)", m.worker_id, t.rank,
                a.world_size, a.generation, built.rank, built.world_size, t.why,
                "a fresh child of its warm parent" if warm.is_child() else "a fresh interpreter")
    life().to(SpareState.BUILDING, m.worker_id, f"assigned rank {t.rank} in generation {a.generation}; it starts "
              f"again from the script's first line: {t.why}")
    start_again()


def assigned(worker_id: str, a: Assignment) -> None:
    """A spare waiting before its script (it did not build ahead) is assigned: it builds for its assignment
    (``distributed.init_distributed``). A no-op in any other state (a retried formation, a spare started again)."""
    if life().state is SpareState.WAITING:
        life().to(SpareState.BUILDING, worker_id, f"assigned rank {a.ranks[worker_id]} in generation {a.generation}: "
                  "it builds for its assignment")


def joined(worker_id: str, rank: int, version: int | None) -> None:
    """A spare restored its assigned rank's state after joining the survivors (``recover.restore_from_memory``):
    the end of its life as a spare."""
    if life().state in (SpareState.JOINING, SpareState.BUILDING):
        life().to(SpareState.JOINED, worker_id, f"rank {rank}'s state restored (step {version})")


def _regroup(a: Assignment, worker_id: str, built: BuiltAhead, relabel: Relabel) -> str | None:
    """Take the assigned node's ranks by exchanging them for the built node's (``regroup.py``): the groups renamed
    and renumbered, then the framework's copies of ranks. Returns why not (nothing changed then)."""
    node = a.nodes[worker_id]
    mine = sorted((w for w in a.ranks if a.nodes[w] == node), key=lambda w: int(w.rsplit(".", 1)[1]))
    mapping = regroup.node_permutation(list(built.node_ranks), [a.ranks[w] for w in mine])  # by local index
    if isinstance(mapping, str):
        return mapping
    assert relabel.check_mapping is not None
    why = relabel.check_mapping(mapping)
    if why is not None:
        return why
    groups = regroup.plan(mapping)
    if isinstance(groups, str):
        return groups
    regroup.apply(groups, a.ranks[worker_id])
    if relabel.apply_mapping is not None:
        relabel.apply_mapping(mapping)
    return None


@contextlib.contextmanager
def start_up_failure_said() -> Iterator[None]:
    """Around the script (``run.py``): a spare building its engine ahead whose script fails before any assignment
    (its engine build, most often) says why in one WARNING line and a ``spare_failed`` timeline event, rather than
    only a traceback the launcher sees as an exit status. The error is raised again unchanged."""
    try:
        yield
    except Exception as exc:
        built, m = context().spare.built, context().membership
        if built is not None and m is not None:
            what = " ".join(f"{type(exc).__name__}: {exc}".split())[:values.MAX_REPORT]
            log.warning("spare %s: its script failed while it built its engine ahead for rank %d of %d, before any "
                        "assignment (%s): this spare is lost to the job; with hot_swap.spare_build_ahead: false it "
                        "would build only once assigned", m.worker_id, built.rank, built.world_size, what)
            write_event(event="spare_failed", worker=m.worker_id, rank=built.rank, world_size=built.world_size,
                        error=type(exc).__name__, what=what)
            if SpareState.FAILED in NEXT[life().state]:
                life().to(SpareState.FAILED, m.worker_id, what)
        raise


def matches(a: Assignment, worker_id: str, built: BuiltAhead) -> bool:
    """Whether assignment ``a`` gives this spare the rank and world it built its engine for (pure)."""
    return a.ranks.get(worker_id) == built.rank and a.world_size == built.world_size and not a.resized


def start_again() -> None:
    """This process again, from its first line, with the same command line and environment: a fresh child of its
    warm parent, its imports done (``rebuild/warm.py``), or else ``os.execv`` (its pid, its place in the launcher's
    records and its shared memory stay). The membership then finds it assigned and it builds for its assignment."""
    from . import warm

    if warm.is_child():
        warm.again()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
