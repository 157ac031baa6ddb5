"""What a trial must satisfy, read from what the jobs left behind (metrics, timeline, log). Pure: no processes.

1. no hang: every job ended before its deadline;
2. recovered: the job (or, after losing every node, its relaunch from tier 3) finished with exit code 0 and
   the expected hot swaps happened;
3. same state: the per-step losses (exact, from --metrics-out) equal the fault-free baseline's, step for step
   (a relaunch's steps too; a step recomputed after a restore appears twice and the last value counts);
4. no corrupt copy used: every corrupted tier-1 slot / tier-2 replica is reported unusable by the restore that
   scanned it, and no restore took the version it held from it; a corrupted tier-3 base is never the base a
   relaunch resumed from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .runner import JobRun, TrialRun

RESTORE = re.compile(r"restoring step (\d+): (\d+) rank\(s\) from own memory, (\d+) from peer replicas (\{[^}]*\})")
RESUMED_T3 = re.compile(r"tier 3: resumed from base (global_step\d+)")
REFUSED_T3 = re.compile(r"tier 3: refusing base (global_step\d+)")
WITHDRAWN_T3 = re.compile(r"(global_step\d+) failed read-back verification and was withdrawn")
UNUSABLE_T1 = re.compile(r"tier 1: slot (\d+) of rank (\d+) unusable")
UNUSABLE_T2 = re.compile(r"tier 2: replica buffer (\d+) of rank (\d+) held here is unusable")
ABANDONED_T3 = re.compile(r"tier 3: base (global_step\d+) abandoned")


@dataclass(kw_only=True)
class Verdict:
    ok: bool
    status: str
    """passed | failed | not_injected | skipped"""
    problems: list[str] = field(default_factory=list)
    hot_swaps: int = 0
    restores: dict[str, int] = field(default_factory=dict)
    """ranks restored per tier (tier1 = own memory, tier2 = a peer's replica, tier3 = a base on --load)"""
    refused: dict[str, int] = field(default_factory=dict)
    """copies reported unusable per tier (tier3: bases refused, withdrawn or abandoned)"""
    mismatch: bool = False
    faults_injected: int = 0
    hits: list[bool] = field(default_factory=list)
    """per action timed inside a copy/transfer window: did the signal land while it was still open"""
    notes: list[str] = field(default_factory=list)
    """what the injector adapted (e.g. which copy it corrupted instead), for the reader"""

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def _counts(output: str) -> tuple[dict[str, int], dict[str, int]]:
    restores = {"tier1": 0, "tier2": 0, "tier3": 0}
    for m in RESTORE.finditer(output):
        restores["tier1"] += int(m.group(2))
        restores["tier2"] += int(m.group(3))
    restores["tier3"] = len(RESUMED_T3.findall(output))
    refused = {"tier1": len(UNUSABLE_T1.findall(output)), "tier2": len(UNUSABLE_T2.findall(output)),
               "tier3": len(REFUSED_T3.findall(output)) + len(WITHDRAWN_T3.findall(output))
               + len(ABANDONED_T3.findall(output))}
    return restores, refused


def _losses(run: JobRun, base: dict[int, float], steps: range) -> list[str]:
    problems = []
    for s in steps:
        if s not in run.metrics:
            problems.append(f"step {s} missing")
        elif run.metrics[s] != base.get(s):
            problems.append(f"step {s}: loss {run.metrics[s]!r} != baseline {base.get(s)!r}")
    return problems


def check_trial(tr: TrialRun, baseline: dict[int, float]) -> Verdict:
    sc = tr.scenario
    if tr.skipped:
        return Verdict(ok=True, status="skipped", problems=[tr.skipped])
    injected = [r for r in tr.injected if r.get("fired")]
    notes = [r["note"] for r in tr.injected if r.get("note", "").startswith("not injected")
             and r.get("as_planned") is not False]
    off = [r["note"] for r in tr.injected if r.get("as_planned") is False]
    output = tr.first.output + (tr.relaunch.output if tr.relaunch else "")
    restores, refused = _counts(output)
    hot_swaps = sum(1 for e in tr.first.events if e.get("event") == "assignment" and e.get("generation", 0) >= 1)
    v = Verdict(ok=False, status="failed", hot_swaps=hot_swaps, restores=restores, refused=refused,
                faults_injected=len(injected), hits=[r["hit"] for r in tr.injected if r.get("hit") is not None])
    waits_for_base = [a for a in sc.actions if a.trigger.kind.startswith("base_")]
    if waits_for_base and not any(r.get("fired") for r in tr.injected[:1]) and not tr.first.timed_out \
            and tr.first.returncode == 0:
        # Bases are due every save_interval steps: a whole run without one is a tier-3 failure, not bad luck.
        what = "published" if waits_for_base[0].trigger.kind == "base_published" else "written"
        v.problems.append(f"no tier-3 base was {what} "
                          f"at step >= {waits_for_base[0].trigger.value} in a {sc.iters}-step run with --save-interval "
                          f"{sc.save_interval} (see 'tier3' in the job's summary line)")
        return v
    if not injected and not tr.first.timed_out and tr.first.returncode == 0:
        # The job finished before the fault could land: nothing was tested, nothing went wrong.
        v.status, v.ok = "not_injected", True
        v.notes = notes or ["fault not injected"]
        return v
    v.problems.extend(notes)
    v.notes = [r["note"] for r in tr.injected if r.get("note") and not r["note"].startswith("not injected")] + off
    for name, run in (("job", tr.first), ("relaunch", tr.relaunch)):
        if run is not None and run.timed_out:
            v.problems.append(f"{name} hung: killed at the deadline after {run.elapsed_s:.0f} s")
    final = tr.relaunch if sc.relaunch else tr.first
    if final is not None and not final.timed_out and final.returncode != 0:
        stopped = [e.get("reason", "") for e in final.events if e.get("event") == "stopped"]
        v.problems.append(f"{'relaunch' if sc.relaunch else 'job'} exited {final.returncode}"
                          + (f": {stopped[-1]}" if stopped else ""))
    if hot_swaps < sc.expect_swaps:
        v.problems.append(f"{hot_swaps} hot swap(s), expected {sc.expect_swaps}")
    # Same state: every step the jobs report equals the baseline's.
    if sc.relaunch and tr.relaunch is not None:
        # Steps of the first job (up to the loss of every node), then the relaunch's from its base on.
        start = min(tr.relaunch.metrics, default=sc.iters + 1)
        diff = _losses(tr.first, baseline, range(1, min(start, max(tr.first.metrics, default=0) + 1)))
        diff += _losses(tr.relaunch, baseline, range(start, sc.iters + 1))
        if start > max(tr.first.metrics, default=0) + 1:
            diff.append(f"steps {max(tr.first.metrics, default=0) + 1}..{start - 1} missing")
    else:
        diff = _losses(tr.first, baseline, range(1, sc.iters + 1))
    mismatch = [p for p in diff if "missing" not in p]
    v.mismatch = bool(mismatch)
    v.problems += mismatch
    if not v.problems:
        v.problems += [p for p in diff if "missing" in p]
    v.problems += _corruption_problems(tr, output)
    v.ok = not v.problems
    # A fault that landed elsewhere than planned (off), in a run that recovered: the plan's moment was not tested.
    # A run that failed stays failed, whatever moment its fault hit.
    v.status = ("not_injected" if off else "passed") if v.ok else "failed"
    return v


def _corruption_problems(tr: TrialRun, output: str) -> list[str]:
    problems = []
    t1 = {(int(s), int(r)) for s, r in UNUSABLE_T1.findall(output)}
    t2 = {(int(b), int(r)) for b, r in UNUSABLE_T2.findall(output)}
    restores = [(int(m.group(1)), m.group(4)) for m in RESTORE.finditer(tr.first.output)]
    for rec in tr.injected:
        for c in rec.get("corrupted", []):
            if c["tier"] == 1:
                # The same rule as for replicas: the restore checks the copies it uses. A corrupt slot whose version
                # no restore chose (the agreed version was older: the lost rank's copies of the newest were torn by
                # the kill) is never read and need not be reported; one that a restore of its version took from
                # this rank's own memory must have been refused before use (and then fetched from a peer).
                used_it = any(version == c["version"] for version, _ in restores)
                if (c["index"], c["rank"]) not in t1 and used_it:
                    problems.append(f"corrupt tier-1 slot {c['index']} of rank {c['rank']} (step {c['version']}) "
                                    f"was never reported unusable")
                    # ...and used, if a restore of that version did not fetch this rank from a peer
                    for version, fetched in restores:
                        if version == c["version"] and f"{c['rank']}:" not in fetched:
                            problems.append(f"restore of step {version} took rank {c['rank']} from its own "
                                            f"(corrupt) memory")
            elif c["tier"] == 2:
                # The restore checks the checksums of the copies it uses (docs/architecture.md): a corrupt replica
                # that no restore fetched (a survivor's, when the lost rank's other buffer was torn by the kill)
                # need not be reported, nor one whose version no restore chose (the agreed version was older: another
                # lost rank's copy of the newest was torn by the kill); one that a restore of its version fetched, or
                # needed, must have been refused.
                fetched_it = any(version == c["version"] and f"{c['rank']}:" in fetched
                                 for version, fetched in restores)
                chosen = any(version == c["version"] for version, _ in restores)
                if (c["index"], c["rank"]) not in t2 and (fetched_it or (chosen and not c.get("unneeded"))):
                    problems.append(f"corrupt replica buffer {c['index']} of rank {c['rank']} (step {c['version']}) "
                                    f"was never reported unusable")
            else:
                used = RESUMED_T3.findall(tr.relaunch.output if tr.relaunch else "")
                if c["tag"] in used:
                    problems.append(f"relaunch resumed from the corrupt base {c['tag']}")
                elif used and int(used[-1][len("global_step"):]) < c["version"] and \
                        c["tag"] not in REFUSED_T3.findall(output) + WITHDRAWN_T3.findall(output):
                    problems.append(f"corrupt base {c['tag']} was skipped without being reported")
    # A tier-3 base that was not complete must never be the one resumed from.
    if tr.relaunch is not None:
        for rec in tr.injected:
            m = re.search(r"in flight \[([\d, ]*)\]", rec.get("note", ""))
            inflight = {int(x) for x in m.group(1).split(",") if x.strip()} if m else set()
            for tag in RESUMED_T3.findall(tr.relaunch.output):
                if int(tag[len("global_step"):]) in inflight:
                    problems.append(f"relaunch resumed from {tag}, which was still being written when every node "
                                    f"was lost")
    return problems
