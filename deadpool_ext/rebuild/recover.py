"""The survivor side of a hot-swap, shared by every integration (DeepSpeed, Megatron-Core).

An integration's ``recover(exc)`` does its own framework-specific teardown (drop the engine / model and
optimizer, destroy framework caches) and hands the rest to these functions, in this order:

1. ``begin(hot_swap_config, exc, step)``: log, arm the last-resort deadline, tell the launcher (timeline);
2. the integration releases its framework state, then ``rejoin(...)``: tear down the process groups, join
   the next generation, build the process group, ``build(assignment)`` the framework state, ``resume()`` it;
   a failure during recovery (a peer dying meanwhile) goes round to the following generation;
3. ``finish(...)``: cancel the deadline, write the ``recover`` timeline event.

Every wait has a deadline: the assignment (``hot_swap.assignment_timeout_s``), the collectives
(``collective_timeout_s``), the teardown (``teardown_timeout_s``), and around all of them
``faulthandler.dump_traceback_later`` with their sum plus 120 s, which prints every thread's stack and exits,
so the launcher replaces this node instead of the job hanging.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .. import hooks
from ..cluster.membership import Assignment
from ..config import HotSwapConfig
from ..distributed import generation, in_hot_swap, is_spare, membership
from ..recovery.agree import NoCommonVersionError, RecoveryError
from ..recovery.timeline import write_event

log = logging.getLogger("deadpool_ext")
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class Begun:
    membership: Any
    generation: int
    failed_step: int
    noticed_at: float
    world_size: int
    """The world of the generation that failed (a generation of another size is a resize: elastic)."""
    assignment: Assignment
    """That generation's assignment (who held which rank: an integration's resize check compares it)."""
    cause: str
    """What stopped the step: ``"launcher_notice"`` (the launcher's notice of a new generation) or
    ``"collective_failed"`` (a collective with a lost peer raised); the ``recover`` event's ``cause``."""


@dataclass(kw_only=True, slots=True)
class Rejoined(Generic[T]):
    result: T
    assignment: Assignment
    version: int | None
    assigned_at: float
    pg_ready_at: float
    engine_ready_at: float
    restored_at: float


_restore_follows = False


def weights_will_be_restored() -> bool:
    """True while a hot-swap rebuild runs a model factory whose weights are then overwritten by a restore
    from memory (this rank had a committed snapshot, so the agreement finds a version or the job stops with
    an error: it never trains on them). A factory may then skip random initialisation, seconds for a large
    model (``deadpool_ext.training.models.build_gpt(..., init=False)``)."""
    return _restore_follows


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

    if not in_hot_swap() or not dist.is_initialized():
        return False
    mine = _restore_follows or is_spare()
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build_for_restore(factory: Callable[[], T], restore_follows: bool) -> T:
    """Call ``factory()`` with :func:`weights_will_be_restored` answering ``restore_follows``."""
    global _restore_follows
    _restore_follows = restore_follows
    try:
        return factory()
    finally:
        _restore_follows = False


def begin(hc: HotSwapConfig, exc: BaseException, step: int, what: str = "rebuilding communicators") -> Begun:
    from . import interrupt

    m = membership()
    assert m is not None and m.assignment is not None, "hot-swap recovery outside deadpool-run"
    gen = m.assignment.generation
    interrupt.forget(gen)
    noticed = isinstance(exc, interrupt.GenerationLost)
    what_failed = "step stopped by the launcher's notice" if noticed else "collective failed"
    log.warning("generation %d: %s at step %d (%s: %s); %s in-process", gen, what_failed, step,
                type(exc).__name__, " ".join(str(exc).split())[:600], what)
    faulthandler.dump_traceback_later(hc.teardown_timeout_s + hc.assignment_timeout_s + hc.collective_timeout_s + 120,
                                      exit=True)
    m.report_failure(gen, repr(exc))
    return Begun(membership=m, generation=gen, failed_step=step, noticed_at=time.time(),
                 world_size=m.assignment.world_size, assignment=m.assignment,
                 cause="launcher_notice" if noticed else "collective_failed")


class Resized(Exception):
    """In-place path: the next generation has another world size (an elastic shrink or grow), so the
    communicators cannot be swapped beneath the framework's objects; the integration rebuilds them instead,
    starting from this already-joined ``assignment``."""

    def __init__(self, assignment: Assignment) -> None:
        super().__init__(f"generation {assignment.generation} has {assignment.world_size} ranks")
        self.assignment = assignment


def rejoin(hc: HotSwapConfig, begun: Begun, *, build: Callable[[Assignment], T], resume: Callable[[T], int | None],
           release: Callable[[], None] = lambda: None, in_place: bool = False,
           joined: Assignment | None = None, live_groups: bool = False,
           resize_check: Callable[[Assignment, Assignment], str | None] | None = None) -> Rejoined[T]:
    """Tear down, then join generations until one forms and ``build`` + ``resume`` succeed on it.

    ``joined``: the first generation is already joined (the in-place path found it resized, :class:`Resized`);
    ``live_groups``: its groups are built swappable and live on every rank (all ranks rebuild together, none
    builds solo), so later failures swap in place again. ``resize_check(old, new)``: for a generation of another
    world size, why this integration cannot continue on it (None: it can); a reason stops the job with that
    message (reported fatal).

    ``release()`` drops framework state built on a generation that failed while forming (called before each
    teardown after the first). A :class:`RecoveryError` from ``resume`` is final (state is gone) and raised.
    ``in_place``: the process groups stay and only their communicators are replaced (``rebuild/swap.py``):
    "tear down" parks the dead generation's communicators, "build the process group" swaps new ones in."""
    from ..distributed import default_backend
    from . import swap
    from .worker import detach_generation, init_process_group, swap_into, teardown

    def leave() -> None:
        if in_place:
            detach_generation("recovery")
        else:
            teardown(hc.teardown_timeout_s)
            gc.collect()

    m = begun.membership
    leave()
    min_gen = begun.generation + 1
    while True:
        a = joined if joined is not None else m.join(min_gen, timeout_s=hc.assignment_timeout_s)
        joined = None
        t_assigned = time.time()
        why = resize_check(begun.assignment, a) if resize_check and a.world_size != begun.world_size else None
        if why is not None:
            msg = f"generation {a.generation} has {a.world_size} ranks (was {begun.world_size}): {why}"
            m.report_fatal(msg)
            raise RecoveryError(msg)
        if in_place and a.world_size != begun.world_size:
            raise Resized(a)
        try:
            if in_place:
                swap_into(a, m.worker_id, hc.collective_timeout_s)
            else:
                init_process_group(a, m.worker_id, default_backend(), hc.collective_timeout_s,
                                   in_place=live_groups, solo=not live_groups)
            t_pg = time.time()
            result = build(a)
            t_engine = time.time()
            version = resume(result)
            return Rejoined(result=result, assignment=a, version=version, assigned_at=t_assigned, pg_ready_at=t_pg,
                            engine_ready_at=t_engine, restored_at=time.time())
        except (RecoveryError, swap.SwapError) as fatal:
            m.report_fatal(str(fatal))
            raise  # not transient: state is gone, or the groups cannot be swapped
        except (RuntimeError, OSError) as again:
            log.warning("generation %d: recovery interrupted (%s); waiting for the next assignment", a.generation,
                        " ".join(str(again).split())[:300])
            m.report_failure(a.generation, repr(again))
            result = None
            release()
            leave()
            min_gen = a.generation + 1


def finish(begun: Begun, r: Rejoined[Any], *, old_rank: int, **extra: Any) -> None:
    faulthandler.cancel_dump_traceback_later()
    write_event(event="recover", role="survivor", generation=r.assignment.generation, old_rank=old_rank,
                rank=r.assignment.ranks[begun.membership.worker_id], pid=os.getpid(), failed_step=begun.failed_step,
                cause=begun.cause,
                restored_version=r.version, noticed_at=begun.noticed_at, assigned_at=r.assigned_at,
                pg_ready_at=r.pg_ready_at, engine_ready_at=r.engine_ready_at, restored_at=r.restored_at, **extra)


def restore_from_memory(snapshots: Any, rank: int, spare_logged: bool, newer_than: int | None = None,
                        **extra: Any) -> tuple[int | None, bool]:
    """``snapshots.restore_latest()`` with what every integration does around it: the ``before_restore`` hook
    point; a RecoveryError is reported to the launcher as fatal, unless a tier-3 base was already loaded
    (``newer_than``), which then stands; a spare that just joined writes its ``recover`` timeline event (once).
    Returns (version, spare_logged)."""
    gen = generation()
    hooks.fire(hooks.BEFORE_RESTORE, generation=gen, rank=rank)
    t0 = time.perf_counter()
    try:
        version = snapshots.restore_latest(newer_than=newer_than)
    except RecoveryError as exc:
        if newer_than is not None and isinstance(exc, NoCommonVersionError):
            log.warning("memory tiers: %s; continuing from the tier-3 base of step %d", exc, newer_than)
            return None, spare_logged
        m = membership()
        if m is not None:
            m.report_fatal(str(exc))
        raise
    if gen > 0 and is_spare() and not spare_logged:
        spare_logged = True
        write_event(event="recover", role="spare", generation=gen, rank=rank, pid=os.getpid(), restored_version=version,
                    restore_s=time.perf_counter() - t0, restored_from=snapshots.stats().get("restored_from"),
                    restored_at=time.time(), **extra)
    return version, spare_logged


def caught_up(catch: tuple[int, float] | None, step: int, rank: int, restored_version: int) -> bool:
    """Write the ``caught_up`` event once ``step`` reaches the step that was in flight at the failure."""
    if catch is None or step < catch[0]:
        return False
    write_event(event="caught_up", generation=generation(), rank=rank, step=step,
                recompute_s=time.time() - catch[1], recomputed_steps=catch[0] - restored_version)
    return True
