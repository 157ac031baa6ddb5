"""A node lost after the job's work is done (pure, no clock, store or process): every rank's training loop ended at
its last step (``trained/``, written by ``resilient_steps`` / ``ResilientLoop`` once the last snapshot drained), so
a node lost in what follows (the script's closing barrier, a final save) fails nothing: the job finishes with status
0 and one line naming the lost node. ``decide.py`` applies it to a turn's failures before the failure rules."""
from __future__ import annotations

from collections.abc import Mapping, Set

from ..cluster.assignment import Assignment
from . import values
from .actions import Action, Event, Fence, Finish, Say


def work_done(ranks: Mapping[str, int], generation: int, trained: Mapping[str, values.Trained],
              failed: Set[str]) -> int | None:
    """The last step of a job whose work is done although the ranks in ``failed`` were just lost, else None.

    Done: every rank of ``generation`` that was not lost ended its training loop (``trained/``, written in this
    generation) after the same step S, and each lost rank either did too or is known to have finished S: some rank
    saw S committed (a version is committed by an all-reduce over every rank, each after its own copy of that
    step). A live rank whose loop has not ended, records of different steps, or one of another generation: work is
    left, and the loss is a failure like any other."""
    recs = {w: t for w, t in trained.items() if w in ranks and t.generation == generation}
    if not failed or not recs or any(w not in recs for w in ranks if w not in failed):
        return None
    steps = {t.step for t in recs.values()}
    if len(steps) != 1:
        return None
    last = steps.pop()
    committed = max((t.committed for t in recs.values() if t.committed is not None), default=None)
    if any(w not in recs for w in failed) and (committed is None or committed < last):
        return None
    return last


def finish_after_loss(a: Assignment, trained: Mapping[str, values.Trained], failed: Mapping[str, str],
                      drop_memory: bool) -> list[Action] | None:
    """What the coordinator does when ``failed`` (worker -> why) are lost after the job's work is done
    (:func:`work_done`): the lost nodes fenced, one line, the job finished (the launchers exit 0, stopping what is
    left of the survivors' closing barrier or save). None: work is left (the failure rules apply)."""
    last = work_done(a.ranks, a.generation, trained, set(failed))
    if last is None:
        return None
    nodes = sorted({a.nodes[w] for w in failed})
    why = "; ".join(f"{w}: {what}" for w, what in sorted(failed.items()))
    return [Event({"event": "lost_after_done", "generation": a.generation, "lost": nodes, "step": last,
                   "failed": dict(failed)}),
            *(Fence(n, drop_memory=drop_memory) for n in nodes),
            Say(f"node(s) {', '.join(nodes)} lost after the job's last step {last} ({why}): every rank had ended "
                f"its training loop and step {last} was committed, so the job's work is done; finishing (status 0)"),
            Finish(a.generation), Event({"event": "finished", "generation": a.generation})]
