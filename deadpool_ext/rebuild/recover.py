"""The recovery driver: one object per process (:func:`driver`) that every integration hands its failures to.

A training loop that catches a failure calls its runtime's ``handle_failure(exc)``, which calls
:meth:`Recovery.handle_failure` with the runtime's named hooks (:class:`RecoveryHooks`). The driver decides
whether to recover from the failure's *cause* (``rebuild/cause.py``: did the launcher end the generation the
step ran in?), picks the mode once (:class:`~deadpool_ext.rebuild.cause.Mode`), and runs it:

0. a step that failed before the launcher ended its generation is reported at once (``suspect/<worker>``:
   :func:`report_collective_failure`), then the driver waits for the launcher's verdict;
1. begin: log, arm the last-resort deadline, tell the launcher (``failed/<g>/<worker>``);
2. leave the dead generation (in place: cut it and park its communicators; rebuild: tear its groups down) and
   drop the framework state the mode drops (hooks: ``stop_snapshots``, ``abandon_step`` or ``release``);
3. join the next generation until one forms (THE join loop, ``rebuild/worker.py`` :func:`join_until_formed`):
   build or swap its process groups, then the hooks ``rewire_snapshots`` (in place) or ``rebuild``, then
   ``restore``; an in-place process whose next generation has another world size turns to RESIZED here;
4. finish: cancel the deadline, write the ``recover`` timeline event, the catch-up accounting.

A spare that built its engine solo joins the survivors' communicators in its own step,
:meth:`Recovery.join_survivors` (the runtime's ``join_survivors()``), collective for collective with step 3 of
the survivors' in-place recovery.

Every wait has a deadline: the launcher's verdict and the assignment (``hot_swap.assignment_timeout_s``), the
collectives (``collective_timeout_s``), the teardown (``teardown_timeout_s``), and around all of them
``faulthandler.dump_traceback_later`` with their sum plus 120 s, which prints every thread's stack and exits,
so the launcher replaces this node instead of the job hanging. Well before that, a recovery still under way after
:data:`STALL_REPORT_S` prints every thread's stack once and goes on (a ``recovery_stalled`` timeline event): where
a slow recovery waits, while it waits.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .. import hooks
from ..cluster.assignment import Assignment
from ..config import HotSwapConfig
from ..recovery.timeline import write_event
from ..snapshot.plan import NoCommonVersionError, RecoveryError
from .cause import Cause, FailureView, Mode, decide_failure
from .context import context

log = logging.getLogger("deadpool_ext")
T = TypeVar("T")


def weights_will_be_restored() -> bool:
    """True while a hot-swap rebuild runs a model factory whose weights are then overwritten by a restore
    from memory (this rank had a committed snapshot, so the agreement finds a version or the job stops with
    an error: it never trains on them). A factory may then skip random initialisation, seconds for a large
    model (``deadpool_ext.training.models.build_gpt(..., init=False)``)."""
    return context().restore_follows


def every_rank_restores() -> bool:
    """Whether every rank of this generation overwrites all of its training state from memory right after
    building its engine, agreed by all ranks (one all-reduce; collective, so every rank calls it at the same
    point: :func:`deadpool_ext.deepspeed.initialize` does). False outside a hot-swap (generation 0, or no
    process group) without communicating.

    A rank says yes when it rebuilds with a committed snapshot (:func:`weights_will_be_restored`) or when it
    is a spare that just took a failed node's place (its state can only come from a peer replica). If none
    can be agreed afterwards, the job stops (:class:`NoCommonVersionError`): it never trains on the unrestored
    values, so the engine may be built without making them agree first
    (``patches/deepspeed_unsynced_init.py``)."""
    import torch
    import torch.distributed as dist

    ctx = context()
    if not ctx.in_hot_swap or not dist.is_initialized():
        return False
    mine = ctx.restore_follows or ctx.is_spare
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build_for_restore(factory: Callable[[], T], restore_follows: bool) -> T:
    """Call ``factory()`` with :func:`weights_will_be_restored` answering ``restore_follows``."""
    ctx = context()
    ctx.restore_follows = restore_follows
    try:
        return factory()
    finally:
        ctx.restore_follows = False


class RecoveryHooks(Protocol):
    """What a runtime supplies to the driver: named hooks (``integrations/base.py`` implements them once for every
    framework, from the runtime's own ``_release`` / ``_rebuild`` / ``_abandon_step`` ...). Called on every rank,
    main thread, in the order of the mode:

    - IN_PLACE: ``stop_snapshots`` -> ``abandon_step`` -> (communicators swapped) -> ``rewire_snapshots`` ->
      ``restore(None)`` -> ``recovered``;
    - REBUILD: ``quiesce_snapshots`` -> ``release`` -> (groups torn down, the next generation's built) ->
      ``rebuild`` -> ``restore(handle)`` -> ``recovered``;
    - RESIZED: IN_PLACE up to the join, then ``release`` -> (groups torn down, live swappable groups built) ->
      ``rebuild`` -> ``restore(handle)`` -> ``recovered``;
    - a generation that fails while it forms: ``release_partial`` (REBUILD, RESIZED) before the next is joined.
    """

    rank: int
    what_recovers: str

    def step_counter(self) -> int:
        """The optimizer step the failure hit (the version a snapshot taken now would carry)."""

    def has_factory(self) -> bool:
        """A rebuild factory is set (``set_rebuild``): REBUILD and RESIZED need one."""

    def stop_snapshots(self, timeout_s: float) -> None:
        """In place: stop the snapshot worker (the manager and its memory stay, rewired later)."""

    def quiesce_snapshots(self) -> bool:
        """Rebuild: let the snapshot worker finish and stop it; whether a committed snapshot exists (then the
        factory's weights are overwritten by the restore: :func:`weights_will_be_restored`)."""

    def abandon_step(self) -> None:
        """In place: drop what the interrupted step left half done, without any collective."""

    def release(self) -> None:
        """Rebuild: drop the framework objects that hold the dead world's process groups."""

    def release_partial(self) -> None:
        """Drop what a rebuild built on a generation that failed while it formed."""

    def rebuild(self) -> Any:
        """Build the framework's objects on the new world (its groups are up); returns the loop's handle."""

    def rewire_snapshots(self) -> None:
        """In place: redo the snapshot placement on the new generation (collective)."""

    def restore(self, handle: Any) -> int | None:
        """Restore from memory, into this runtime (``handle`` None) or the rebuilt handle's; the version."""

    def resize_refusal(self, old: Assignment, new: Assignment) -> str | None:
        """Why this integration cannot continue on ``new`` (another world size than ``old``); None: it can."""

    def recovered(self, handle: Any, mode: Mode, failed_step: int, restored_at: float) -> Any:
        """After the ``recover`` event: the catch-up accounting (and, in place, the memory released); returns
        the loop's handle."""


@dataclass(kw_only=True, slots=True)
class Failure:
    """The failure a recovery started from."""

    generation: int
    assignment: Assignment
    """The generation that failed (who held which rank; a resize refusal compares it with the next)."""
    failed_step: int
    old_rank: int
    noticed_at: float
    cause: Cause


@dataclass(kw_only=True, slots=True)
class Rejoined:
    handle: Any
    assignment: Assignment
    version: int | None
    assigned_at: float
    pg_ready_at: float
    engine_ready_at: float
    restored_at: float


@dataclass(frozen=True, slots=True)
class _Resize:
    """The in-place join found a generation of another world size: the recovery turns RESIZED."""

    assignment: Assignment


class Recovery:
    """This process's recovery driver (one per process: :func:`driver`); see the module docstring.

    ``mode``: the mode of the recovery under way, or of the last one (RESTART_RESTORE before any)."""

    def __init__(self) -> None:
        self.mode = Mode.RESTART_RESTORE
        self.recoveries = 0
        self._hooks: RecoveryHooks | None = None
        self._hc: HotSwapConfig | None = None
        self._failure: Failure | None = None
        self._restore_follows = False
        self._stall: threading.Timer | None = None

    # -- the entry point ----------------------------------------------------------------------------------
    def handle_failure(self, exc: BaseException, hooks: RecoveryHooks, hc: HotSwapConfig, mode: Mode) -> Any | None:
        """Recover from ``exc`` if its cause says so (``rebuild/cause.py``); returns the loop's handle on the next
        generation, or None: the caller raises ``exc`` unchanged. ``mode``: :func:`recovery_mode` of the runtime."""
        if mode is Mode.RESTART_RESTORE:
            return None
        from . import notice

        noticed_at = time.time()
        m = context().membership
        if m is None or m.assignment is None:
            return None
        gen = m.assignment.generation
        published, stop = m.verdict(gen, 0.0)
        if stop is None and (published is None or published <= gen):
            report_collective_failure(m, gen, exc)
            log.warning("generation %d: step %d failed (%s: %s); waiting up to %.0f s for the launcher's verdict "
                        "(hot_swap.assignment_timeout_s): recovered if it ends this generation", gen,
                        hooks.step_counter(), type(exc).__name__, _short(exc), hc.assignment_timeout_s)
            published, stop = m.verdict(gen, hc.assignment_timeout_s)
        decision = decide_failure(FailureView(mode=mode, generation=gen, published=published, stopped=stop,
                                              stopped_by_notice=notice.stopped(gen)))
        if not decision.recover:
            log.warning("generation %d: the failure at step %d is not recovered in-process: %s", gen,
                        hooks.step_counter(), decision.why)
            return None
        assert decision.cause is not None
        self.mode, self._hooks, self._hc = decision.mode, hooks, hc
        try:
            f = self._begin(exc, decision.cause, m.assignment, hooks.rank, noticed_at)
            if self.mode is Mode.IN_PLACE:
                return self._in_place(exc, f)
            return self._rebuild(f, hooks.quiesce_snapshots(), first=None)
        finally:
            self._hooks = self._hc = self._failure = None

    # -- the steps ----------------------------------------------------------------------------------------
    def _begin(self, exc: BaseException, cause: Cause, a: Assignment, rank: int, noticed_at: float) -> Failure:
        """Log, arm the last-resort deadline, tell the launcher."""
        from . import notice

        hooks, hc, m = self._hooks, self._hc, context().membership
        assert hooks is not None and hc is not None and m is not None
        notice.forget(a.generation)
        step = hooks.step_counter()
        what_failed = "step stopped by the launcher's notice" if cause is Cause.LAUNCHER_NOTICE else "collective failed"
        what = ("swapping the communicators beneath the engine" if self.mode is Mode.IN_PLACE
                else hooks.what_recovers)
        log.warning("generation %d: %s at step %d (%s: %s); %s in-process", a.generation, what_failed, step,
                    type(exc).__name__, " ".join(str(exc).split())[:600], what)
        faulthandler.dump_traceback_later(hc.teardown_timeout_s + hc.assignment_timeout_s + hc.collective_timeout_s
                                          + 120, exit=True)
        self._stall = stall_report(a.generation, STALL_REPORT_S)
        m.report_failure(a.generation, repr(exc))
        self.recoveries += 1
        self._failure = Failure(generation=a.generation, assignment=a, failed_step=step, old_rank=rank,
                                noticed_at=noticed_at, cause=cause)
        return self._failure

    def _in_place(self, exc: BaseException, f: Failure) -> Any:
        """Keep the framework's objects: park the dead communicators, swap the next generation's in beneath them,
        rewire the snapshots, restore in place."""
        from . import swap
        from .worker import detach_generation, join_until_formed

        hooks, hc, m = self._hooks, self._hc, context().membership
        assert hooks is not None and hc is not None and m is not None
        _drop_frames(exc)
        detach_generation("recovery")
        hooks.stop_snapshots(hc.teardown_timeout_s)
        hooks.abandon_step()
        r = join_until_formed(m, f.generation + 1, self._swap_in, leave=self._leave_in_place,
                              what="recovery interrupted", wait_s=hc.assignment_timeout_s,
                              retry_wait_s=hc.assignment_timeout_s, fatal=(RecoveryError, swap.SwapError))
        if isinstance(r, _Resize):
            return self._resized(f, r.assignment)
        self._finish(f, r, in_place=True)
        return hooks.recovered(None, self.mode, f.failed_step, r.restored_at)

    def _resized(self, f: Failure, a: Assignment) -> Any:
        hooks, hc = self._hooks, self._hc
        assert hooks is not None and hc is not None
        self.mode = Mode.RESIZED
        if not hooks.has_factory():
            raise RuntimeError(f"generation {a.generation} has {a.world_size} ranks (was "
                               f"{f.assignment.world_size}): resizing needs set_rebuild(factory)")
        log.warning("generation %d: %d ranks (was %d): rebuilding the framework's objects on the new world, the "
                    "state resharded from memory", a.generation, a.world_size, f.assignment.world_size)
        return self._rebuild(f, True, first=a)

    def _rebuild(self, f: Failure, restore_follows: bool, first: Assignment | None) -> Any:
        """Drop the framework's objects, tear the groups down, build them again on the next generation (RESIZED:
        live swappable groups on every rank, starting from the already joined ``first``)."""
        from . import swap
        from .worker import join_until_formed

        hooks, hc, m = self._hooks, self._hc, context().membership
        assert hooks is not None and hc is not None and m is not None
        hooks.release()
        self._tear_down()
        self._restore_follows = restore_follows
        r = join_until_formed(m, f.generation + 1, self._build_on, leave=self._leave_rebuilt,
                              what="recovery interrupted", wait_s=hc.assignment_timeout_s,
                              retry_wait_s=hc.assignment_timeout_s, first=first,
                              fatal=(RecoveryError, swap.SwapError))
        assert isinstance(r, Rejoined)
        if self.mode is Mode.RESIZED:
            self._finish(f, r, resized_from=f.assignment.world_size)
        else:
            self._finish(f, r)
        return hooks.recovered(r.handle, self.mode, f.failed_step, r.restored_at)

    # -- forming one generation (called by the join loop) ------------------------------------------------------
    def _swap_in(self, a: Assignment) -> Rejoined | _Resize:
        from .worker import swap_into

        hooks, hc, m, f = self._hooks, self._hc, context().membership, self._failure
        assert hooks is not None and hc is not None and m is not None and f is not None
        t_assigned = time.time()
        if a.world_size != f.assignment.world_size:
            return _Resize(a)
        swap_into(a, m.worker_id, hc.collective_timeout_s)
        t_pg = time.time()
        hooks.rewire_snapshots()
        t_engine = time.time()
        version = hooks.restore(None)
        return Rejoined(handle=None, assignment=a, version=version, assigned_at=t_assigned, pg_ready_at=t_pg,
                        engine_ready_at=t_engine, restored_at=time.time())

    def _build_on(self, a: Assignment) -> Rejoined:
        from ..distributed import default_backend
        from .worker import init_process_group

        hooks, hc, m, f = self._hooks, self._hc, context().membership, self._failure
        assert hooks is not None and hc is not None and m is not None and f is not None
        t_assigned = time.time()
        if a.world_size != f.assignment.world_size:
            why = hooks.resize_refusal(f.assignment, a)
            if why is not None:  # fatal: the join loop reports it to the launcher, which stops the job
                raise RecoveryError(f"generation {a.generation} has {a.world_size} ranks (was "
                                    f"{f.assignment.world_size}): {why}")
        live = self.mode is Mode.RESIZED
        init_process_group(a, m.worker_id, default_backend(), hc.collective_timeout_s, in_place=live, solo=not live)
        t_pg = time.time()
        handle = build_for_restore(hooks.rebuild, self._restore_follows)
        t_engine = time.time()
        version = hooks.restore(handle)
        return Rejoined(handle=handle, assignment=a, version=version, assigned_at=t_assigned, pg_ready_at=t_pg,
                        engine_ready_at=t_engine, restored_at=time.time())

    def _leave_in_place(self) -> None:
        from .worker import detach_generation

        detach_generation("recovery")

    def _leave_rebuilt(self) -> None:
        assert self._hooks is not None
        self._hooks.release_partial()
        self._tear_down()

    def _tear_down(self) -> None:
        from .worker import teardown

        assert self._hc is not None
        teardown(self._hc.teardown_timeout_s)
        gc.collect()

    def _finish(self, f: Failure, r: Rejoined, **extra: Any) -> None:
        m = context().membership
        assert m is not None
        faulthandler.cancel_dump_traceback_later()
        if self._stall is not None:
            self._stall.cancel()
        write_event(event="recover", role="survivor", generation=r.assignment.generation, old_rank=f.old_rank,
                    rank=r.assignment.ranks[m.worker_id], pid=os.getpid(), failed_step=f.failed_step,
                    cause=f.cause.value, restored_version=r.version, noticed_at=f.noticed_at,
                    assigned_at=r.assigned_at, pg_ready_at=r.pg_ready_at, engine_ready_at=r.engine_ready_at,
                    restored_at=r.restored_at, **extra)

    # -- a spare -------------------------------------------------------------------------------------------
    def join_survivors(self, rewire_snapshots: Callable[[], None], hc: HotSwapConfig) -> Assignment:
        """A spare whose engine was built solo (``rebuild/worker.py`` :func:`init_process_group`) joins the
        survivors: its groups get the generation's communicators, then ``rewire_snapshots()`` (collective: the
        snapshot placement), collective for collective with the survivors' in-place recovery. A peer lost
        meanwhile: the next generation is joined (the join loop)."""
        from . import swap
        from .worker import detach_generation, join_until_formed, pending_live, went_live

        pending = pending_live()
        m = context().membership
        assert pending is not None and m is not None, "join_survivors() outside a spare built solo"
        a, _, collective_s = pending

        times = context().spare.times

        def form(a: Assignment) -> Assignment:
            from .worker import swap_into

            times.setdefault("join_at", time.time())
            swap_into(a, m.worker_id, collective_s)
            times["pg_ready_at"] = time.time()
            rewire_snapshots()
            return a

        def leave() -> None:
            detach_generation("joining failed")

        joined = join_until_formed(m, a.generation, form, leave=leave, what="could not join the survivors",
                                   wait_s=hc.assignment_timeout_s, retry_wait_s=hc.assignment_timeout_s, first=a,
                                   fatal=(swap.SwapError,))
        went_live()
        return joined


STALL_REPORT_S = 10.0
"""A recovery still under way after this long prints every thread's stack once and goes on (normal ones take
under a second for GPT small and about 3 s for GPT medium on a 2-core host)."""


def stall_report(generation: int, after_s: float, stacks: Any = None) -> threading.Timer:
    """Started when a recovery begins, cancelled when it ends: after ``after_s``, one line, a ``recovery_stalled``
    event and every thread's stack on ``stacks`` (a file; default stderr, the worker's log), so that a slow
    recovery says where it waits."""
    def report() -> None:
        log.warning("generation %d: recovery still under way after %.0f s; every thread's stack follows (where it "
                    "waits)", generation, after_s)
        write_event(event="recovery_stalled", generation=generation, after_s=after_s, pid=os.getpid())
        faulthandler.dump_traceback(all_threads=True, **({} if stacks is None else {"file": stacks}))

    timer = threading.Timer(after_s, report)
    timer.daemon = True
    timer.start()
    return timer


def report_collective_failure(m: Any, generation: int, exc: BaseException) -> None:
    """Tell the coordinator at once that a step of ``generation`` failed here (``suspect/<worker>``, through the
    membership's authenticated store client), before this rank waits for its verdict: a peer whose host was lost
    closed its sockets, so this collective failed long before that peer's heartbeat times out, and the coordinator
    fails a peer gone quiet after ``--suspect-age-s`` instead (``launcher/decide.py``). A report fails nobody whose
    heartbeat is fresh. Best effort: a store that refuses it leaves the plain heartbeat timeout."""
    from ..launcher import keys

    try:
        m.store.set_json(keys.suspect(m.worker_id),
                         keys.suspect_value(generation, f"{type(exc).__name__}: {_short(exc)}"))
    except Exception as err:  # the store unreachable: the verdict's wait below says what happens next
        log.debug("report of the failed collective: %s", err)


def driver() -> Recovery:
    """This process's recovery driver (held by its context, ``rebuild/context.py``)."""
    return context().recovery


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _drop_frames(exc: BaseException) -> None:
    """Free what the failed step's frames hold (activations, autograd graphs, gathered parameters): the exception's
    traceback keeps every frame of the interrupted forward/backward alive for as long as the caller holds the
    exception, which is the whole recovery. Its chain too (``__context__``, ``__cause__``), at most 16 deep."""
    import traceback

    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 16:
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
        seen += 1


def restore_from_memory(snapshots: Any, rank: int, spare_logged: bool, newer_than: int | None = None,
                        **extra: Any) -> tuple[int | None, bool]:
    """``snapshots.restore_latest()`` with what every integration does around it: the ``before_restore`` hook
    point; a RecoveryError is reported to the launcher as fatal, unless a tier-3 base was already loaded
    (``newer_than``), which then stands; a spare that just joined writes its ``recover`` timeline event (once).
    Returns (version, spare_logged)."""
    ctx = context()
    gen = ctx.generation
    hooks.fire(hooks.BEFORE_RESTORE, generation=gen, rank=rank)
    t0 = time.perf_counter()
    try:
        version = snapshots.restore_latest(newer_than=newer_than)
    except RecoveryError as exc:
        if newer_than is not None and isinstance(exc, NoCommonVersionError):
            log.warning("memory tiers: %s; continuing from the tier-3 base of step %d", exc, newer_than)
            return None, spare_logged
        m = ctx.membership
        if m is not None:
            m.report_fatal(str(exc))
        raise
    if gen > 0 and ctx.is_spare and not spare_logged:
        spare_logged = True
        times = {k: v for k, v in ctx.spare.times.items() if k not in extra}
        if not times.setdefault("built_ahead", False) and {"assigned_at", "engine_started_at", "join_at"} <= set(times):
            # built after its assignment: the script up to its engine, then the engine, both after the failure
            times.update(prologue_s=round(times["engine_started_at"] - times["assigned_at"], 3),
                         engine_s=round(times["join_at"] - times["engine_started_at"], 3))
        write_event(event="recover", role="spare", generation=gen, rank=rank, pid=os.getpid(), restored_version=version,
                    restore_s=time.perf_counter() - t0, restored_from=snapshots.stats().get("restored_from"),
                    restore_parts=snapshots.stats().get("restore_parts"),
                    restored_at=time.time(), **times, **extra)
        if ctx.membership is not None:
            from .spare import joined

            joined(ctx.membership.worker_id, rank, version)
    return version, spare_logged


def caught_up(catch: tuple[int, float] | None, step: int, rank: int, restored_version: int) -> bool:
    """Write the ``caught_up`` event once ``step`` reaches the step that was in flight at the failure."""
    if catch is None or step < catch[0]:
        return False
    write_event(event="caught_up", generation=context().generation, rank=rank, step=step,
                recompute_s=time.time() - catch[1], recomputed_steps=catch[0] - restored_version)
    return True
