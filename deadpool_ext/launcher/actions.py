"""What the coordinator does: the actions a turn's :class:`Decision` lists, in the order
``launcher/coordinator.py`` carries them out. Plain frozen dataclasses; the rules that produce them are
``decide.py``'s."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cluster.assignment import Assignment

if TYPE_CHECKING:
    from .decide import CoordinatorState

# -- what the coordinator does ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Event:  # a timeline record (--timeline)
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Log:
    level: int
    text: str


@dataclass(frozen=True, slots=True)
class Say:  # a line on the launcher's stderr, prefixed "deadpool-run: "
    text: str


@dataclass(frozen=True, slots=True)
class BadKey:  # a store value no schema takes: logged (once a minute per key) and, if delete, removed
    key: str
    what: str
    delete: bool = False


@dataclass(frozen=True, slots=True)
class Fence:  # kill every process of the node (through its host's launcher if it runs elsewhere), drop its memory
    node: str
    drop_memory: bool


@dataclass(frozen=True, slots=True)
class WriteDeadSpares:
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AnswerJoin:
    name: str
    ok: bool
    why: str = ""
    role: str = ""


@dataclass(frozen=True, slots=True)
class MarkRepaired:  # a joined machine offered to a shrunk world: grown to like a repaired node
    node: str


@dataclass(frozen=True, slots=True)
class ClearRepaired:
    node: str


@dataclass(frozen=True, slots=True)
class NoteDropped:  # nodes a shrink left out (dropped/): their launchers may start them again (--repair-after-s)
    nodes: tuple[str, ...]
    generation: int


@dataclass(frozen=True, slots=True)
class SetSpares:  # the same generation with another spare pool (a machine joined): written, nobody is notified
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Publish:
    """The next generation: written, then ``gen/<g>`` tells the survivors of ``g-1`` to leave it; ``event`` is
    recorded once it is out (with ``published_at``)."""

    assignment: Assignment
    event: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Finish:
    generation: int


@dataclass(frozen=True, slots=True)
class Stop:
    """The job stops (exit 1): ``reason`` recorded, ``said`` printed; ``assignment`` (if any) written with the
    message, so that every process shows it; ``exits``: the failed nodes' workers' exit statuses, when no spare was
    left for them (the ``stopped`` event's ``cause``, :func:`final.stop_cause`)."""

    reason: str
    said: str
    assignment: Assignment | None = None
    exits: Mapping[str, int | None] | None = None
    safe: Mapping[str, int | None] | None = None
    """Out of spares: the newest step trained and the newest tier-3 base (``final.safe_steps``), in the event."""


Action = (Event | Log | Say | BadKey | Fence | WriteDeadSpares | AnswerJoin | MarkRepaired | ClearRepaired | NoteDropped
          | SetSpares | Publish | Finish | Stop)


@dataclass(frozen=True, slots=True)
class Decision:
    state: CoordinatorState
    actions: tuple[Action, ...]

    @property
    def exit_code(self) -> int | None:
        """The launcher's exit code when this turn ends the job, else None."""
        for act in self.actions:
            if isinstance(act, Finish):
                return 0
            if isinstance(act, Stop):
                return 1
        return None
