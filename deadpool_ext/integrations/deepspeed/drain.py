"""A preemption's drain, DeepSpeed's part: the step every rank stopped at persisted to tier 3 (``preempt/``).

Call order (every rank, training thread, inside the wrapped ``engine.step`` right after the step's snapshot and
tier-3 hooks: ``runtime.py``):

1. :func:`at_boundary` asks ``preempt.worker.agree`` (one all-reduce) whether any rank has a drain request; if none,
   it returns at once.
2. Every rank: the step's snapshot drained (so the newest committed in-memory version is this step), the base
   that tier 3 may still be writing waited for (bounded by the deadline), then the plan (``preempt/decide.py``:
   write, tier 3 already holds it, or not: no URL, budget short), the most cautious plan of any rank wins.
3. ``write``: ``Tier3Persister.drain_save``: DeepSpeed's own checkpoint of the step through the tier-3 writer,
   unthrottled, every rank's manifest, the commit record last, read back and verified by rank 0, all before the
   deadline or never published.
4. Rank 0 reports the outcome (``drained`` in the store, a ``drained`` timeline event, the line); every rank ends at
   its framework's next call (``DrainState.exit_if_due``) with status 75, after the script's own bookkeeping of the
   step (its metrics line).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from ...persist.layout import list_versions
from ...preempt import decide, messages
from ...preempt.worker import Agreement, agree
from ...rebuild.context import context
from ...recovery.timeline import write_event

log = logging.getLogger("deadpool_ext")

MiB = 1 << 20
PLAN_CODES = {"none": 0, "have": 1, "write": 2}


def at_boundary(runtime: Any) -> decide.Outcome | None:
    """Every rank, at every optimizer-step boundary while a drain is armed (see the call order); the outcome when
    this boundary drained, else None."""
    st = context().drain
    if not st.armed or st.outcome is not None:
        return None
    agreed = agree(st, runtime.engine.device, runtime.rank)
    if agreed is None:
        return None
    outcome = _drain(runtime, agreed)
    st.outcome = outcome
    return outcome


def _newest_base(persist: Any) -> int | None:
    """The newest complete base on tier 3 (its commit record is written only after every file, and withdrawn when
    the read-back fails), None if none."""
    try:
        found = list_versions(persist.storage, key=persist.key)
    except Exception as exc:  # an unreadable storage: no earlier base to count on
        log.warning("drain: cannot list tier 3 at %s: %s", persist.url, exc)
        return None
    return max((v.version for v in found if v.commit is not None), default=None)


def _all_min(value: int, device: Any) -> int:
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _drain(runtime: Any, agreed: Agreement) -> decide.Outcome:
    engine, rank, st = runtime.engine, runtime.rank, context().drain
    step = runtime.step_counter()
    if rank == 0:
        _tell_launcher(agreed, st.by if agreed.by_rank == rank else "")
        log.warning("drain: every rank stopped at step %d (%.1f s after the request; %.1f s of the budget left)", step,
                    time.time() - agreed.requested_at, agreed.deadline - time.time())
    if runtime.snapshots is not None:
        runtime.snapshots.wait_idle()  # this step's snapshot committed: the newest in-memory version is this step
    persist = runtime.persist
    url = persist.url if persist is not None else runtime.config.persist.url
    newest = need = rate = None
    if persist is not None:
        persist.writer.wait_idle(max(0.0, agreed.deadline - time.time()))  # a base in flight had the budget first
        newest = _newest_base(persist)
        need = persist.captures[-1]["bytes"] if persist.captures else None
        rates = [h.get("rank_mb_s") or 0.0 for h in persist.writer.history if h.get("ok")]
        rate = max(rates) * MiB if rates else None
    budget = decide.budget_verdict(agreed.deadline - time.time(), need, rate)
    plan = decide.plan_persist(step, url=url if persist is not None else None, newest_base=newest, budget=budget)
    if plan.action == "none" and persist is not None and persist.writer.busy:
        plan = decide.PersistPlan("none", "the budget was too short: it went on a base that tier 3 was still "
                                          "writing (persist.interval's), which stays unpublished")
    code = _all_min(PLAN_CODES[plan.action], engine.device)  # the most cautious plan of any rank
    action = {v: k for k, v in PLAN_CODES.items()}[code]
    why = plan.why if action == plan.action else "another rank's plan: " + ("tier 3 already holds it" if code == 1
                                                                           else "not to write")
    persisted: int | None = newest if action == "have" else None
    nbytes = 0
    if action == "write":
        assert persist is not None
        started = persist.drain_save(step, agreed.deadline)
        if started is None:
            why = "an earlier base was still being written when the budget ran out"
        else:
            job, done = started
            done.wait(max(0.0, agreed.deadline - time.time()) + 1.0)
            res = dict(job.result)
            if rank == 0 and res.get("published") and "verify_s" in res:
                persisted, nbytes = step, int(res.get("total_bytes", 0))
            elif rank == 0:
                why = (f"not published within the budget: {res['error']}" if res.get("error") else
                       "the write did not finish within the budget")
    seconds = time.time() - agreed.requested_at
    if persisted is None and persist is not None and rank == 0:
        newest = _newest_base(persist)
    outcome = decide.Outcome(step=step, persisted=persisted, safe=decide.safe_step(persisted, newest), url=url,
                             seconds=seconds, why=why)
    if rank == 0:
        _report(outcome, nbytes, st.by)
    return outcome


def _tell_launcher(agreed: Agreement, by: str) -> None:
    """Rank 0, before any rank can end: the request in the store if no watcher wrote it yet (a SIGTERM to a worker
    is agreed at the next boundary, possibly before its watcher's next turn), so every launcher drains too."""
    m = context().membership
    if m is None:
        return
    from ...launcher import keys

    if not by:  # the request was another rank's: named by its worker (one line per drain, at rank 0)
        a = m.assignment
        who = [w for w, r in a.ranks.items() if r == agreed.by_rank] if a is not None else []
        by = f"SIGTERM to worker {who[0]}" if who else f"SIGTERM to rank {agreed.by_rank}"
    req = messages.DrainRequest(agreed.requested_at, by)
    try:
        m.store.compare_set(keys.DRAIN, None, json.dumps(req.to_json()).encode())
    except Exception as exc:  # the launchers still read the drained workers' exit status
        log.warning("drain: could not record the request in the store: %s", exc)


def _report(outcome: decide.Outcome, nbytes: int, by: str) -> None:
    """Rank 0: the outcome into the store (every launcher's final line), the timeline and the log."""
    rec = messages.DrainOutcome(step=outcome.step, persisted=outcome.persisted, safe=outcome.safe, url=outcome.url,
                                seconds=outcome.seconds, why=outcome.why, nbytes=nbytes)
    m = context().membership
    if m is not None:
        try:
            from ...launcher import keys

            m.store.set(keys.DRAINED, json.dumps(rec.to_json()).encode())
        except Exception as exc:  # the launcher then says it heard no outcome; the base itself is on tier 3
            log.warning("drain: could not record the outcome in the store: %s", exc)
    write_event(event="drained", step=outcome.step, persisted=outcome.persisted, safe=outcome.safe,
                url=outcome.url, seconds=round(outcome.seconds, 3), why=outcome.why, nbytes=nbytes)
    if outcome.persisted is not None:
        log.warning("drain: step %d is safe: persisted and verified at %s %.1f s after the request; this process "
                    "exits with status %d", outcome.persisted, outcome.url, outcome.seconds, decide.PREEMPTED_EXIT)
    else:
        log.warning("drain: step %s not persisted (%s); safe: %s; this process exits with status %d", outcome.step,
                    outcome.why, outcome.safe, decide.PREEMPTED_EXIT)


__all__ = ["at_boundary"]
