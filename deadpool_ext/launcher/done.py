"""A node lost after the job's work is done (pure, no clock, store or process).

Two rules, both ending the job with status 0 and one line naming the lost node:

- :func:`finish_after_loss` (a turn's failures, before the failure rules): every rank's training loop ended at its
  last step (``trained/``, written by ``resilient_steps`` / ``ResilientLoop`` once the last snapshot drained, and by
  every worker whose script returned: ``rebuild/worker.py`` ``mark_done``), so a node lost in what follows (the
  script's closing barrier, a final save) fails nothing;
- :func:`finish_after_recovery` (a generation made by a recovery, before detection): a plain loop has no end marker,
  so the loss of its last step is only seen as a failure, and a spare took the lost node's ranks. A rank whose
  script then returned (exit 0 or ``done/``) ended the job's loop: if it ended before this generation, it never
  joins it; if it ended in it, a rank whose collective then failed waited for a peer that left (a spare restored
  to the last step, whose script trains one step more on resume than the uninterrupted run did). Either way the
  job's work is done at that rank's last step; the rest are stopped.
"""
from __future__ import annotations

from collections.abc import Mapping, Set

from ..cluster.assignment import Assignment
from . import values
from .actions import Action, Event, Fence, Finish, Say


def work_done(ranks: Mapping[str, int], generation: int, trained: Mapping[str, values.Trained],
              failed: Set[str], ended: Set[str] = frozenset()) -> int | None:
    """The last step of a job whose work is done although the ranks in ``failed`` were just lost, else None.

    Done: every rank of ``generation`` that was not lost ended its training loop (``trained/``, written in this
    generation) after the same step S, and each lost rank either did too or is known to have finished S: some rank
    saw S committed (a version is committed by an all-reduce over every rank, each after its own copy of that
    step), or some rank's script returned after S (``ended``: it exited 0 or wrote ``done/``; every rank runs the
    same loop, and S's gradients were reduced over the lost rank too). A live rank whose loop has not ended, records
    of different steps, or one of another generation: work is left, and the loss is a failure like any other."""
    recs = {w: t for w, t in trained.items() if w in ranks and t.generation == generation}
    if not failed or not recs or any(w not in recs for w in ranks if w not in failed):
        return None
    steps = {t.step for t in recs.values()}
    if len(steps) != 1:
        return None
    last = steps.pop()
    committed = max((t.committed for t in recs.values() if t.committed is not None), default=None)
    script_ended = any(w in ended for w in recs)
    if any(w not in recs for w in failed) and not script_ended and (committed is None or committed < last):
        return None
    return last


def ended_before_the_rest(a: Assignment, trained: Mapping[str, values.Trained], ended: Set[str],
                          reports: Mapping[str, values.Report]) -> tuple[int, list[str], list[str]] | None:
    """``(last step, the ranks whose script ended, the ranks stopped)`` when, in a generation a recovery made
    (``a.replaced``), the job's work is done although not every rank has exited; else None.

    Done: the ranks whose script returned (``ended``, each with a ``trained/`` record) all ended after the same step
    S, and the others cannot go on: one of the ended ranks ended in an earlier generation (it never joins this one),
    or every other live rank reported a failed collective of this generation (the peer that left closed its
    connections). Being inside a collective is not enough: a rank writing its own files after its peers left can
    stand in torch.distributed's code as long (``torch.distributed.checkpoint``'s last writes). A rank that has left
    its collectives behind is left to end on its own."""
    if not a.replaced:
        return None
    done = {w: trained[w] for w in a.ranks if w in ended and w in trained}
    if not done or len({t.step for t in done.values()}) != 1:
        return None
    rest = sorted(w for w in a.ranks if w not in ended)
    if not rest:
        return None
    early = any(t.generation < a.generation for t in done.values())
    failed_here = all((r := reports.get(w)) is not None and r.generation == a.generation for w in rest)
    if not early and not failed_here:
        return None
    return next(iter(done.values())).step, sorted(done), rest


def finish_after_recovery(a: Assignment, trained: Mapping[str, values.Trained], ended: Set[str],
                          reports: Mapping[str, values.Report]) -> list[Action] | None:
    """What the coordinator does when the job's work is done in a generation a recovery made
    (:func:`ended_before_the_rest`): one line naming the node lost and the ranks that ended, the job finished (the
    launchers exit 0, stopping the rest). None: the other rules apply."""
    found = ended_before_the_rest(a, trained, ended, reports)
    if found is None:
        return None
    last, over, rest = found
    lost = sorted(a.replaced)
    early = [w for w in over if trained[w].generation < a.generation]
    why = (f"{', '.join(early)} ended its script after step {last} before generation {a.generation} formed, so "
           f"{', '.join(rest)} cannot go on" if early else
           f"{', '.join(over)} ended its script after step {last} and the collective {', '.join(rest)} waited in "
           "failed (a script that, resumed at its last step, trains one step more)")
    return [Event({"event": "lost_after_done", "generation": a.generation, "lost": lost, "step": last,
                   "ended": over, "stopped": rest}),
            Say(f"node(s) {', '.join(lost)} lost at the job's last step {last} (replaced by "
                f"{', '.join(a.replaced[n] for n in lost)}): {why}; the job's work is done, finishing (status 0)"),
            Finish(a.generation), Event({"event": "finished", "generation": a.generation})]


def finish_after_loss(a: Assignment, trained: Mapping[str, values.Trained], failed: Mapping[str, str],
                      drop_memory: bool, ended: Set[str] = frozenset()) -> list[Action] | None:
    """What the coordinator does when ``failed`` (worker -> why) are lost after the job's work is done
    (:func:`work_done`): the lost nodes fenced, one line, the job finished (the launchers exit 0, stopping what is
    left of the survivors' closing barrier or save). None: work is left (the failure rules apply)."""
    last = work_done(a.ranks, a.generation, trained, set(failed), ended)
    if last is None:
        return None
    recs = {w: trained[w] for w in a.ranks if w in trained and w not in failed}
    if all(w in trained and trained[w].generation == a.generation for w in failed):
        proof = f"every rank had ended its training loop after step {last}"
    elif any(t.committed is not None and t.committed >= last for t in recs.values()):
        proof = f"every rank had ended its training loop and step {last} was committed"
    else:
        proof = f"{', '.join(sorted(w for w in recs if w in ended))} ended its script after step {last}"
    nodes = sorted({a.nodes[w] for w in failed})
    why = "; ".join(f"{w}: {what}" for w, what in sorted(failed.items()))
    return [Event({"event": "lost_after_done", "generation": a.generation, "lost": nodes, "step": last,
                   "failed": dict(failed)}),
            *(Fence(n, drop_memory=drop_memory) for n in nodes),
            Say(f"node(s) {', '.join(nodes)} lost after the job's last step {last} ({why}): {proof}, so the job's "
                "work is done; finishing (status 0)"),
            Finish(a.generation), Event({"event": "finished", "generation": a.generation})]
