"""Whether a failure is recovered in-process, and how (pure: no torch, no store, no processes).

A failure is recovered because of its *cause*, never because of its exception type: the launcher, which sees
every process and heartbeat, decides that a generation is dead by publishing the next one. So a worker whose
step failed asks the membership what became of the generation the step ran in (``rebuild/worker.py``
``Membership.verdict``) and hands what it saw to :func:`decide_failure`:

- the launcher published a newer generation: a peer was lost (or the world changes size), and this process
  recovers in the mode its runtime supports (:func:`recovery_mode`);
- the launcher stopped the job: nothing to recover into, the failure propagates;
- the generation is still the newest once the wait is over: the failure is this process's own (a bug, a full
  disk, a snapshot worker error raised before the step), and it propagates unchanged.

The same rule decides whether a generation that failed while it formed is left for the next one
(:func:`failure_cause` in ``rebuild/worker.py``'s join loop).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
             "remote process exited", "NCCL communicator was aborted", "Socket closed")
"""How gloo and NCCL word a collective that failed because a peer process died."""


def lost_peer_text(text: str) -> bool:
    """Whether an error's text is gloo's or NCCL's wording of a peer process that died mid-collective (pure). A
    hint about a collective's failure, never a verdict on a step: the verdict is the launcher's (the cause)."""
    flat = " ".join(text.split())
    return any(s in flat for s in LOST_PEER)


class Mode(enum.Enum):
    """How this process continues after a failure (``rebuild/recover.py``, ``Recovery``)."""

    RESTART_RESTORE = "restart_restore"
    """No in-process recovery: the failure ends the process; a restart (torchrun, a relaunch) restores from
    memory at ``resume()``. Outside deadpool-run, or with ``hot_swap.enabled: false``."""
    IN_PLACE = "in_place"
    """The framework's objects stay; the communicators beneath their process groups are swapped for the next
    generation's and the state is restored into them (``rebuild/swap.py``)."""
    REBUILD = "rebuild"
    """The framework's objects are dropped, the process groups torn down, and the script's factory builds them
    again on the next generation (``hot_swap.in_place: false``, Megatron-Core)."""
    RESIZED = "resized"
    """An in-place process whose next generation has another world size (an elastic shrink or grow): it
    rebuilds through the factory on live swappable groups, and the restore reshards from memory."""


class Cause(enum.Enum):
    """Why the generation a step ran in ended (the ``recover`` timeline event's ``cause``)."""

    LAUNCHER_NOTICE = "launcher_notice"
    """The launcher's notice of the next generation stopped the step (``rebuild/notice.py``)."""
    COLLECTIVE_FAILED = "collective_failed"
    """The step failed on its own (a collective with a lost peer raised) and the launcher then published the
    next generation."""


def failure_cause(generation: int, published: int | None, stopped_by_notice: bool) -> Cause | None:
    """What ended ``generation``, from the newest generation the launcher published (``published``; None:
    nothing read), or None when it is still the newest: the failure is not a lost peer."""
    if published is None or published <= generation:
        return None
    return Cause.LAUNCHER_NOTICE if stopped_by_notice else Cause.COLLECTIVE_FAILED


def recovery_mode(*, hot_swap: bool, in_place: bool, has_factory: bool, same_objects: bool) -> Mode:
    """The mode a failure would be recovered in, before anything is joined. ``hot_swap``: under deadpool-run
    with ``hot_swap.enabled``; ``in_place``: the runtime's objects survive a swap of communicators (and the
    groups are swappable); ``has_factory``: a rebuild factory is set (``set_rebuild``); ``same_objects``: the
    caller continues with the objects it holds (Lightning, the HF Trainer, ``resilient_steps``), so a rebuild
    that hands back new ones is no way to continue. RESTART_RESTORE: no in-process recovery."""
    if not hot_swap:
        return Mode.RESTART_RESTORE
    if in_place:
        return Mode.IN_PLACE
    if has_factory and not same_objects:
        return Mode.REBUILD
    return Mode.RESTART_RESTORE


@dataclass(frozen=True, slots=True)
class FailureView:
    """What a process saw when its step failed (every field observed, none derived from the exception)."""

    mode: Mode
    """:func:`recovery_mode` of the runtime at the failure."""
    generation: int
    """The generation the failed step ran in."""
    published: int | None
    """The newest generation the launcher had published when the wait for its verdict ended (None: not read)."""
    stopped: str | None = None
    """The launcher stopped the job (its message), else None."""
    stopped_by_notice: bool = False
    """The launcher's notice of the end of ``generation`` stopped the step (``rebuild/notice.py``)."""


@dataclass(frozen=True, slots=True)
class FailureDecision:
    recover: bool
    mode: Mode
    cause: Cause | None
    why: str
    """One line: why the failure is recovered, or why it propagates."""


def decide_failure(view: FailureView) -> FailureDecision:
    """Recover when this process can (its mode) and the launcher ended the generation the step ran in (the
    cause); else the failure propagates unchanged. See the module docstring."""
    if view.mode is Mode.RESTART_RESTORE:
        return FailureDecision(recover=False, mode=view.mode, cause=None,
                               why="no in-process recovery here (not under deadpool-run with hot_swap on, or no "
                                   "way to continue: no in-place swap and no rebuild factory)")
    if view.stopped is not None:
        return FailureDecision(recover=False, mode=view.mode, cause=None,
                               why=f"the launcher stopped the job: {view.stopped}")
    cause = failure_cause(view.generation, view.published, view.stopped_by_notice)
    if cause is None:
        return FailureDecision(recover=False, mode=view.mode, cause=None,
                               why=f"generation {view.generation} is still the newest: the failure is this "
                                   "process's own, not a lost peer")
    return FailureDecision(recover=True, mode=view.mode, cause=cause,
                           why=f"the launcher published generation {view.published} after generation "
                               f"{view.generation} ({cause.value})")
