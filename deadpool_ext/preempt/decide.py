"""The drain's rules, pure (no clock, store, process or torch): unit-tested without processes.

A preemption (Slurm, Kubernetes, a spot instance) sends SIGTERM and, a grace period later, SIGKILL. Within a budget
(``preemption.grace_s`` / ``deadpool-run --preempt-grace-s``) every rank stops at the next step boundary, the newest
version is persisted to tier 3 through the tier-3 writer (manifests, commit record last, read back and verified),
and the job ends with :data:`PREEMPTED_EXIT` and one line saying which step is safe and where. The decisions:

- :func:`resolve_grace`: the budget (flag > the job's config > the default);
- :func:`worker_deadline` / :func:`launcher_deadline`: what each side has of it;
- :func:`budget_verdict` and :func:`plan_persist`: whether to write, and why not;
- :func:`safe_step`: which step a ``--load`` resumes from;
- :func:`exit_status` and :func:`final_line`: how the job ends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import DEFAULT_GRACE_S

PREEMPTED_EXIT = 75
"""The exit status of a drained worker and of its launcher (sysexits.h ``EX_TEMPFAIL``: "try again later"): the job
was preempted and can be resumed with ``--load``; the line before it says from which step. A requeue (Slurm) or a
restart policy (Kubernetes ``podFailurePolicy`` ``onExitCodes``) keys on it; it is none of the statuses a worker
ends with otherwise (0 finished, 1 error, 2 refused, 3 unattached, 4 lost peer outside a protected step, 70 orphaned,
143 or -15 killed by SIGTERM without a drain)."""

EXIT_MARGIN_S = 2.0
"""The part of the budget a worker leaves for its own exit and its launcher's line (at most a tenth of it)."""


@dataclass(frozen=True, slots=True)
class Grace:
    """The drain budget in seconds and where it came from."""

    seconds: float
    source: str


def resolve_grace(flag: float | None, job_config: float | None) -> Grace:
    """The one rule, for the launcher and the workers alike: ``--preempt-grace-s`` wins (the launcher puts it into
    its drain request); else the job's ``deadpool.preemption.grace_s`` (rank 0 writes it at attach); else
    :data:`~deadpool_ext.config.DEFAULT_GRACE_S`."""
    if flag is not None and _positive(flag):
        return Grace(float(flag), "--preempt-grace-s")
    if job_config is not None and _positive(job_config):
        return Grace(float(job_config), "deadpool.preemption.grace_s")
    return Grace(DEFAULT_GRACE_S, "the default")


def _positive(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def exit_margin(grace_s: float) -> float:
    return min(EXIT_MARGIN_S, 0.1 * grace_s)


def worker_deadline(requested_at: float, grace_s: float) -> float:
    """When a worker's persist must be verified at the latest: the request's time plus the budget, less the margin
    for the processes' exit and the launcher's line."""
    return requested_at + grace_s - exit_margin(grace_s)


def launcher_deadline(requested_at: float, grace_s: float) -> float:
    """When the launcher stops waiting for its workers (SIGKILL to those left) and says what was saved."""
    return requested_at + grace_s


@dataclass(frozen=True, slots=True)
class Budget:
    """``fits``: the estimate is within what is left; ``unknown``: nothing measured yet (tried); ``short``: the
    estimate is beyond it (not tried: nothing half-written, the nodes given back sooner)."""

    verdict: str
    estimate_s: float | None
    left_s: float


def budget_verdict(left_s: float, need_bytes: int | None, best_rate_bps: float | None) -> Budget:
    """Whether writing ``need_bytes`` (this rank's share of the version) fits in ``left_s`` at the best rate this
    rank's tier-3 writer has reached before (its bases are throttled for training's sake; the drain's write is not,
    so the best rate seen is the closest to it). No measurement: ``unknown``, and the write is tried: the deadline
    keeps a late one from being published."""
    if left_s <= 0:
        return Budget("short", None, left_s)
    if not need_bytes or not best_rate_bps or best_rate_bps <= 0:
        return Budget("unknown", None, left_s)
    estimate = need_bytes / best_rate_bps
    return Budget("fits" if estimate <= left_s else "short", estimate, left_s)


@dataclass(frozen=True, slots=True)
class PersistPlan:
    """What a drain does at step ``step``: ``write`` it; ``have`` (tier 3 already holds it, verified); ``none``
    (nothing to write to, or the budget is short); ``why`` says it for the line."""

    action: str
    why: str


def plan_persist(step: int, *, url: str | None, newest_base: int | None, budget: Budget) -> PersistPlan:
    """What to persist at the step every rank stopped at (the newest version: it is the one the snapshot of this
    step commits in memory, and the live state of every rank)."""
    if not url:
        return PersistPlan("none", "no tier 3 to persist to (deadpool.persist.url or the script's --save is unset)")
    if newest_base is not None and newest_base >= step:
        return PersistPlan("have", f"tier 3 already holds step {newest_base}, verified")
    if budget.verdict == "short":
        est = f"~{budget.estimate_s:.1f} s to write" if budget.estimate_s is not None else "no time"
        return PersistPlan("none", f"the budget was too short: {est}, {max(budget.left_s, 0.0):.1f} s left")
    return PersistPlan("write", "")


def safe_step(persisted: int | None, newest_base: int | None) -> int | None:
    """The step a ``--load`` of the tier-3 URL resumes from: the version the drain persisted and verified, else the
    newest earlier base (None: none; a restart begins at step 0)."""
    found = [s for s in (persisted, newest_base) if s is not None]
    return max(found) if found else None


def exit_status(*, finished: bool, stopped: bool) -> int:
    """The launcher's status once a drain ends: 0 if the job finished all the same (every active worker exited 0:
    its last step came first), 1 if it was stopped for a failure it could not recover, else :data:`PREEMPTED_EXIT`,
    whatever was saved (the line says what; a restart with ``--load`` resumes either way)."""
    if finished:
        return 0
    if stopped:
        return 1
    return PREEMPTED_EXIT


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the drain did (rank 0 reports it: ``messages.DrainOutcome``), as the final line needs it."""

    step: int | None
    """The step boundary every rank stopped at (None: none reached one within the budget)."""
    persisted: int | None
    """The step persisted and verified on tier 3 during the drain (None: none)."""
    safe: int | None
    url: str | None
    seconds: float
    """SIGTERM (the first request) -> the verified commit record (or -> the decision not to write)."""
    why: str


def final_line(outcome: Outcome | None, grace: Grace, by: str) -> str:
    """The one line a drained job ends with (the launcher prints it; rank 0 logs it too)."""
    head = f"preempted ({by}; budget {grace.seconds:g} s, {grace.source})"
    if outcome is None:
        return (f"{head}: no rank reported a drain within the budget (none reached a step boundary: still starting, "
                "or recovering without a spare); nothing new was persisted. A restart with --load resumes from the "
                f"newest verified tier-3 base, if any (deadpool inspect URL). Exit status {PREEMPTED_EXIT}.")
    where = outcome.url.rstrip("/") if outcome.url else None
    resume = f"; resume with --load {where}" if where else ""
    if outcome.persisted is not None:
        return (f"{head}: step {outcome.persisted} is safe: persisted and verified at {where}/global_step"
                f"{outcome.persisted} {outcome.seconds:.1f} s after the SIGTERM{resume}. Exit status "
                f"{PREEMPTED_EXIT}.")
    stopped = f"stopped at step {outcome.step}" if outcome.step is not None else "no step boundary reached"
    if outcome.safe is not None:
        lost = f" (steps {outcome.safe + 1}-{outcome.step} are lost)" if outcome.step and outcome.step > outcome.safe \
            else ""
        return (f"{head}: {stopped}, not persisted: {outcome.why}. Step {outcome.safe} is safe (an earlier verified "
                f"base at {where}/global_step{outcome.safe}){lost}{resume}. Exit status {PREEMPTED_EXIT}.")
    return (f"{head}: {stopped}, not persisted: {outcome.why}. No verified version is on tier 3: a restart begins at "
            f"step 0. Exit status {PREEMPTED_EXIT}.")


__all__ = ["EXIT_MARGIN_S", "PREEMPTED_EXIT", "Budget", "Grace", "Outcome", "PersistPlan", "budget_verdict",
           "exit_margin", "exit_status", "final_line", "launcher_deadline", "plan_persist", "resolve_grace",
           "safe_step", "worker_deadline"]
