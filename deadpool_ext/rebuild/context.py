"""This process's fault-tolerance state, in one object: :func:`context`.

What a worker knows about the job it is part of used to sit in module globals of half a dozen modules; it is
here, so that one object answers "which generation am I in" (:attr:`WorkerContext.generation`, from the
membership's assignment) and a reader finds the whole state in one place:

- ``membership``: the client of the launcher's coordination store (deadpool-run; None otherwise), and with it
  the assignment, hence the generation (:attr:`WorkerContext.generation`, ``in_hot_swap``) and the role
  (``is_spare``): every module reads them here;
- ``fence``: the sockets of the generation whose communicators are live (``rebuild/notice.py``: what the
  notice's cut shuts down; None before a generation's group is built);
- ``progress``: the steps and main-thread samples the heartbeat reports (``rebuild/progress.py``);
- ``pending_live``: a spare whose groups were built solo and have not joined the survivors yet;
- ``spare``: a spare's life (``rebuild/spare.py`` :class:`SpareLife`): its state (starting, building ahead,
  waiting, building, joining, joined, failed), what it built its engine for ahead of any failure, and its phases'
  times for the timeline;
- ``swap_mode``, ``swappable_groups``: whether new swappable groups are built solo or live, and every one built
  (``rebuild/swap.py``);
- ``interrupts``: the launcher's notice to the main thread, by generation: the one requested, the one armed, the
  one stopped (``rebuild/notice.py``);
- ``teardown_hooks``: the framework caches reset at a teardown (``rebuild/worker.py``);
- ``graveyard``: the one place dead generations' process groups and communicators go (:class:`Graveyard`: a
  rebuild's torn-down groups, ``rebuild/worker.py``; an in-place swap's inner communicators, ``rebuild/swap.py``);
- ``spare_warmups``, ``served_stores``, ``exit_registered``: start-up (``distributed.py``);
- ``restore_follows``: a rebuild's factory runs with a restore from memory to follow (``rebuild/recover.py``);
- ``first_batch``: the first engine's batch shape, which a resized world keeps (``integrations/deepspeed/batch.py``);
- ``drain``: a preemption's drain, requested (a SIGTERM, the launcher's ``drain`` key) and done (``preempt/worker.py``);
- ``recovery``: the recovery driver (``rebuild/recover.py``).

No generation state is anywhere else. What stays in module globals is process-wide by nature, each with its reason
on the line (``tests/unit/test_module_state.py`` holds the list and fails on any other): the installed signal
handler (``rebuild/notice.py``: ``signal.signal`` is per process), the backends registered with torch
(``rebuild/swap.py``), caches of the environment and of probes, and the harness's hook registry.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..preempt.state import DrainState
from .notice import GenerationFence, Interrupts
from .progress import Progress

if TYPE_CHECKING:
    from ..cluster.assignment import Assignment
    from .recover import Recovery
    from .spare import SpareLife
    from .swap import SwappableGroup
    from .worker import Membership


class Graveyard:
    """Dead generations' process groups and communicators, kept referenced: gloo's destructor joins the group's
    worker threads, which may still be blocked on a dead peer until the group's timeout, so dropping the last
    reference on the main thread (e.g. in ``gc.collect()`` after an old engine is released) would stall a recovery
    that long. Two kinds of graves, one graveyard:

    - :meth:`keep`: held for the process's life (a rebuild's torn-down groups: tiny, their threads finish alone);
    - :meth:`bury`, then :meth:`reap`: an in-place swap's inner communicators, which hold the tensors of the
      collectives in flight at the failure (about one gradient bucket per swap): freed once the next generation's
      are built, their last reference dropped on a daemon thread (the fence cut their sockets; a destructor that
      still blocks makes only that thread wait);
    - :meth:`take_buried`: at exit, the buried not reaped yet, for the caller to drop on its own thread (before
      interpreter finalization).
    """

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self.buried: list[Any] = []

    def keep(self, objs: Iterable[Any]) -> None:
        self.kept.extend(objs)

    def bury(self, obj: Any) -> None:
        self.buried.append(obj)

    def take_buried(self) -> list[Any]:
        dead, self.buried = self.buried, []
        return dead

    def reap(self) -> None:
        dead = self.take_buried()
        if dead:
            threading.Thread(target=dead.clear, name="deadpool-reap-communicators", daemon=True).start()


@dataclass(eq=False)
class WorkerContext:
    """See the module docstring."""

    membership: Membership | None = None
    fence: GenerationFence = field(default_factory=GenerationFence)
    progress: Progress = field(default_factory=Progress)
    pending_live: tuple[Assignment, str, float] | None = None
    """(assignment, worker id, collective timeout) of a spare built solo, until it joins the survivors."""
    _spare: SpareLife | None = None
    rank_watch: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None
    """While a spare builds ahead: the roots ``rebuild/rank_reads.py`` sorts a rank read's callers by."""
    rank_reads: list[str] = field(default_factory=list)
    """Where code outside DeepSpeed and deadpool_ext read the rank of a spare building ahead (file:line)."""
    swap_mode: str = "live"
    groups_made: dict[tuple[int, ...], list[str]] = field(default_factory=dict)
    """While a spare builds ahead: torch's name of every group made, by its members (``rebuild/regroup.py``)."""
    swappable_groups: list[weakref.ReferenceType[SwappableGroup]] = field(default_factory=list)
    interrupts: Interrupts = field(default_factory=Interrupts)
    teardown_hooks: list[Callable[[], None]] = field(default_factory=list)
    graveyard: Graveyard = field(default_factory=Graveyard)
    spare_warmups: list[Callable[[], None]] = field(default_factory=list)
    served_stores: list[object] = field(default_factory=list)
    exit_registered: bool = False
    restore_follows: bool = False
    first_batch: object | None = None
    """The first engine's batch shape, as an integration recorded it (DeepSpeed: ``integrations/deepspeed/batch.py``):
    a rebuild on a resized world keeps that global batch."""
    drain: DrainState = field(default_factory=DrainState)
    """A preemption's drain (``preempt/worker.py``): requested by a SIGTERM or the launcher, agreed, done."""
    _recovery: Recovery | None = None

    @property
    def generation(self) -> int:
        """THE generation this process is in: its membership's assignment (0 outside deadpool-run and before the
        first assignment)."""
        return self.membership.generation if self.membership is not None else 0

    @property
    def in_hot_swap(self) -> bool:
        """True in a generation after the first under deadpool-run: this process's engine was built for a world
        rebuilt after a failure, and its state must come from the memory tiers (whatever
        ``recovery.restore_on_start`` says, which is about starting a job)."""
        return self.generation > 0

    @property
    def is_spare(self) -> bool:
        """This process was started by deadpool-run as a spare (it keeps that role after taking a node's place)."""
        return self.membership is not None and self.membership.role == "spare"

    @property
    def spare(self) -> SpareLife:
        """A spare's life, one state machine (``rebuild/spare.py``); in any other process it stays ``starting``,
        and its ``times`` are only ever written, never read."""
        if self._spare is None:
            from .spare import SpareLife  # spare.py reads context() from here: imported on first use

            self._spare = SpareLife()
        return self._spare

    @property
    def recovery(self) -> Recovery:
        """This process's recovery driver."""
        if self._recovery is None:
            from .recover import Recovery

            self._recovery = Recovery()
        return self._recovery


_CONTEXT = WorkerContext()  # the one per process: every other piece of a worker's state hangs off it


def context() -> WorkerContext:
    """This process's context (one per process: a worker is one process)."""
    return _CONTEXT
