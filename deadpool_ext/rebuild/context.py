"""This process's fault-tolerance state, in one object: :func:`context`.

What a worker knows about the job it is part of used to sit in module globals of half a dozen modules; it is
here, so that one object answers "which generation am I in" (:attr:`WorkerContext.generation`, from the
membership's assignment) and a reader finds the whole state in one place:

- ``membership``: the client of the launcher's coordination store (deadpool-run; None otherwise), and with it
  the assignment, hence the generation;
- ``fence``: the sockets of the generation whose communicators are live (``rebuild/fence.py``: what a cut shuts
  down; None before a generation's group is built);
- ``progress``: the steps and main-thread samples the heartbeat reports (``rebuild/progress.py``);
- ``pending_live``: a spare whose groups were built solo and have not joined the survivors yet;
- ``swap_mode``, ``swappable_groups``: whether new swappable groups are built solo or live, and every one built
  (``rebuild/swap.py``);
- ``teardown_hooks``, ``graveyard``: the framework caches reset at a teardown, the dead generations' groups kept
  referenced (``rebuild/worker.py``);
- ``spare_warmups``, ``served_stores``, ``exit_registered``: start-up (``distributed.py``);
- ``restore_follows``: a rebuild's factory runs with a restore from memory to follow (``rebuild/recover.py``);
- ``first_batch``: the first engine's batch shape, which a resized world keeps (``integrations/deepspeed/batch.py``);
- ``recovery``: the recovery driver (``rebuild/recover.py``).

Left where they are: the signal handler's state (``rebuild/interrupt.py``: a handler runs with no argument to
pass the context in), ``rebuild/swap.py``'s registration of its backend with torch and its reaped graveyard of
inner groups.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .fence import GenerationFence
from .progress import Progress

if TYPE_CHECKING:
    from ..cluster.membership import Assignment
    from .recover import Recovery
    from .swap import SwappableGroup
    from .worker import Membership


@dataclass(eq=False)
class WorkerContext:
    """See the module docstring."""

    membership: Membership | None = None
    fence: GenerationFence = field(default_factory=GenerationFence)
    progress: Progress = field(default_factory=Progress)
    pending_live: tuple[Assignment, str, float] | None = None
    """(assignment, worker id, collective timeout) of a spare built solo, until it joins the survivors."""
    swap_mode: str = "live"
    swappable_groups: list[weakref.ReferenceType[SwappableGroup]] = field(default_factory=list)
    teardown_hooks: list[Callable[[], None]] = field(default_factory=list)
    graveyard: list[Any] = field(default_factory=list)
    spare_warmups: list[Callable[[], None]] = field(default_factory=list)
    served_stores: list[object] = field(default_factory=list)
    exit_registered: bool = False
    restore_follows: bool = False
    first_batch: object | None = None
    """The first engine's batch shape, as an integration recorded it (DeepSpeed: ``integrations/deepspeed/batch.py``):
    a rebuild on a resized world keeps that global batch."""
    _recovery: Recovery | None = None

    @property
    def generation(self) -> int:
        """THE generation this process is in: its membership's assignment (0 outside deadpool-run and before the
        first assignment)."""
        return self.membership.generation if self.membership is not None else 0

    @property
    def recovery(self) -> Recovery:
        """This process's recovery driver."""
        if self._recovery is None:
            from .recover import Recovery

            self._recovery = Recovery()
        return self._recovery


_CONTEXT = WorkerContext()


def context() -> WorkerContext:
    """This process's context (one per process: a worker is one process)."""
    return _CONTEXT
