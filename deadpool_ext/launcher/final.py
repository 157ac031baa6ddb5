"""The line a deadpool-run job ends with when it stops, naming the real cause (pure, unit-tested without
processes): a lost node with no spare left is not the same as a worker that exited on its own, and the advice
differs (more spares or the persistent tier for the one; fixing the script or its config for the other)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REFUSED_EXIT = 2
"""``python -m deadpool_ext.run``: a bad argument, section or config (the worker printed the reason)."""
UNATTACHED_EXIT = 3
"""``python -m deadpool_ext.run``: a section that no engine attached (the job would have run unprotected)."""
LOST_PEER_EXIT = 4
"""``python -m deadpool_ext.run`` under deadpool-run: a collective failed because a peer was lost (the launcher
ended the generation), and the script's loop could not continue (no protected step around the failed call)."""
UNPROTECTED_FIX = ("a hot-swap continues a loop only from a failure inside a step the extension can redo: loop "
                   "with `for step in resilient_steps(engine, loader, max_steps=N)` (from deadpool_ext.steps import "
                   "resilient_steps) or ResilientLoop, and keep the script's own collectives (a barrier, a metric's "
                   "all_reduce) inside the step (docs/hot-swap.md)")
"""What a loop needs to survive a lost peer (said by the worker and by the launcher's final line)."""


def stop_cause(exits: Mapping[str, int | None]) -> str:
    """Why a job with no spare left stops, from its failed nodes' workers' exit statuses (``stop_line``'s
    ``exits``): ``out_of_spares`` (none exited by itself: a lost node), ``refused`` (each printed why it refused
    its configuration or arguments), ``unattached`` (a section no engine attached to), ``unprotected_loop`` (each
    stopped because a peer was lost mid-collective outside a step the extension can redo) or
    ``exited_on_its_own``."""
    codes = {rc for rc in exits.values() if rc is not None and rc > 0}
    if not codes:
        return "out_of_spares"
    return {frozenset({REFUSED_EXIT}): "refused", frozenset({UNATTACHED_EXIT}): "unattached",
            frozenset({LOST_PEER_EXIT}): "unprotected_loop"}.get(frozenset(codes), "exited_on_its_own")


def safe_steps(beats: Mapping[str, Mapping[str, Any]]) -> dict[str, int | None]:
    """From the workers' last heartbeats (pure): ``trained_step``, the newest step any rank finished, and
    ``tier3_step``, the newest step published and verified as a tier-3 base (None: none seen)."""
    steps = [int(b["step"]) for b in beats.values() if isinstance(b.get("step"), (int, float)) and b["step"] >= 0]
    tier3 = [int(b["tier3"]) for b in beats.values() if isinstance(b.get("tier3"), int)]
    return {"trained_step": max(steps, default=None), "tier3_step": max(tier3, default=None)}


def safe_line(safe: Mapping[str, int | None]) -> str:
    """Which step is safe on which tier when a job stops with no spare left: its memory tiers end with it (the
    launcher drops every node's memory), so what a restart resumes from is tier 3's newest verified base."""
    trained, tier3 = safe.get("trained_step"), safe.get("tier3_step")
    upto = f" up to step {trained}" if trained is not None else ""
    if tier3 is None:
        return (f"No tier-3 base was published (persist.url unset, or none written yet): the steps trained{upto} end "
                "with this job's memory, and a restart trains from its start; persist.url keeps a base to resume from "
                "(--load).")
    lost = (f"; steps {tier3 + 1}-{trained} trained since were in memory only" if trained is not None
            and trained > tier3 else "")
    return (f"Safe on tier 3: step {tier3}, its newest verified base when the job stopped (a base still being "
            f"written may add a newer one): a restart with --load resumes from the newest{lost}.")


def stop_line(no_spare: str, policy: str, exits: Mapping[str, int | None],
              safe: Mapping[str, int | None] | None = None) -> str:
    """``no_spare``: why no replacement was found; ``exits``: exit status of each worker of the failed nodes (None:
    still running or unknown; < 0: a signal, the launcher's own fence included); ``safe``: :func:`safe_steps` of
    the workers' last heartbeats (which step is safe on which tier: :func:`safe_line`)."""
    own = {wid: rc for wid, rc in sorted(exits.items()) if rc is not None and rc > 0}
    cause = stop_cause(exits)
    if cause == "out_of_spares":
        return (f"{no_spare}. Policy --no-spare-policy={policy}: stopping the job (out of spares: more "
                "--spare-nodes, or --no-spare-policy shrink, keeps a job going). "
                + safe_line(safe or safe_steps({})))
    who = ", ".join(f"{wid} (exit status {rc})" for wid, rc in own.items())
    if cause == "unprotected_loop":
        return (f"worker(s) {who} stopped because a peer was lost mid-collective (where: the line it printed above), "
                f"not by an error of the script: the loop is not protected against a lost peer, so it could not go "
                f"on with a spare in the lost node's place; {UNPROTECTED_FIX}. Stopping the job.")
    said = {"refused": "refused its configuration or arguments (the reason is the line it printed above)",
            "unattached": "ran with a \"deadpool\" section that no engine attached to (the reason is the line it "
                          "printed above)"}.get(
        cause, "exited on its own: the script's own error (see its last lines above), not a lost node")
    return (f"worker(s) {who} {said}; stopping the job. A spare or --load would not help: fix the cause and launch "
            "again.")
