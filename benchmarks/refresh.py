"""Re-measure every headline from the current code, one job at a time, then re-render what shows them.

    python -m benchmarks.refresh --list                 # the plan: each job's command and time estimate, runs nothing
    python -m benchmarks.refresh                        # every headline (hours on 2 cores), then re-render
    python -m benchmarks.refresh --only recovery,simulate

The plan is read from the current results (``headlines.sources``): each headline is re-run with the command it
recorded (its ``--out`` replaced), in the order overhead jobs, recovery, simulation (the simulation calibrates from
the others, so it runs last). Each job runs under ``flock /tmp/deadpool-bench.lock`` (no two benchmarks at once on a
shared host) into a staging folder; when it succeeds, the files it replaces move to ``results/archive/`` with the
date of the run they held, and the new ones take their names. A job that fails leaves the current result in place
and says so. The time estimate of a job is the wall time its current result recorded. At the end the README's
block, REPORT.md (``run_all.py --report-only``), every doc's quote and results/INDEX.md are rendered again.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, RESULTS_DIR  # noqa: E402
from headlines import MEASURED_CODE, OVERHEAD, RECOVERY, SIMULATE  # noqa: E402

LOCK = "/tmp/deadpool-bench.lock"
EXTRA = ("snapshot_overhead_recommended",)
"""Headline results not in :data:`headlines.OVERHEAD` that a refresh re-measures too, where present."""
ORDER = (*OVERHEAD, *EXTRA, RECOVERY, SIMULATE)
DEFAULT_ESTIMATE_S = {RECOVERY: 900.0, SIMULATE: 60.0}
"""Where a result recorded no wall time: a guess, said as such in the plan."""
FALLBACK_ESTIMATE_S = 3600.0
START_S = 30.0
"""Added per job to its recorded time: interpreter, imports, setup before the recorded clock starts."""


@dataclass(frozen=True, slots=True)
class Job:
    stem: str
    argv: tuple[str, ...]
    """The benchmark's command, ``--out`` left off (the runner adds its staging folder)."""
    estimate_s: float
    estimate_from: str
    """Where the estimate comes from: the current result's recorded wall time, or a guess."""


def recorded_wall_s(doc: dict[str, Any]) -> float | None:
    """The wall time a result recorded: its jobs' (overhead: per size) or the whole benchmark's."""
    sizes = doc.get("sizes") or {}
    walls = [e.get("job_wall_s") for e in sizes.values() if isinstance(e, dict)]
    if walls and all(isinstance(w, (int, float)) for w in walls):
        return float(sum(walls))
    wall = doc.get("wall_s")
    return float(wall) if isinstance(wall, (int, float)) else None


def argv_of(command: str) -> tuple[str, ...]:
    """A recorded command as this checkout runs it: the interpreter this one, ``--out`` left off."""
    parts = shlex.split(command)
    if parts and os.path.basename(parts[0]).startswith("python"):
        parts = parts[1:]
    out: list[str] = []
    skip = False
    for p in parts:
        if skip:
            skip = False
            continue
        if p == "--out":
            skip = True
            continue
        if p.startswith("--out="):
            continue
        out.append(p)
    return (sys.executable, *out)


def plan(docs: dict[str, dict[str, Any]], only: set[str] | None = None) -> list[Job]:
    """One job per headline result present (``stem -> document``), in :data:`ORDER`; ``only``: those stems."""
    jobs = []
    for stem in ORDER:
        doc = docs.get(stem)
        if doc is None or (only and stem not in only) or not doc.get("command"):
            continue
        wall = recorded_wall_s(doc)
        if wall is not None:
            est, source = wall + START_S, "the current result's recorded wall time"
        else:
            est, source = DEFAULT_ESTIMATE_S.get(stem, FALLBACK_ESTIMATE_S), "a guess (no wall time recorded)"
        jobs.append(Job(stem, argv_of(doc["command"]), est, source))
    return jobs


def fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def progress_line(i: int, jobs: list[Job], elapsed_s: float, done_s: list[float]) -> str:
    """The line printed as job ``i`` starts: which, its estimate, the time so far and what remains by estimate
    (the jobs done count at what they took)."""
    remaining = sum(j.estimate_s for j in jobs[i:])
    return (f"[refresh] {i + 1}/{len(jobs)} {jobs[i].stem}: starting, estimate {fmt_duration(jobs[i].estimate_s)}; "
            f"{fmt_duration(elapsed_s)} so far, about {fmt_duration(remaining)} left "
            f"(total about {fmt_duration(sum(done_s) + remaining)})")


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def current_docs(results_dir: str = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """stem -> document of every headline result present (rule met or not: a refresh re-measures it anyway)."""
    return {stem: d for stem in ORDER if (d := _read(os.path.join(results_dir, f"{stem}.json"))) is not None}


def install(staging: str, results_dir: str, stem: str) -> list[str]:
    """Move a job's output into ``results_dir``: a file it replaces goes to ``archive/`` first, named with the
    date of the run it held (``<stem>.json``'s). Returns the names installed."""
    archive = os.path.join(results_dir, "archive")
    os.makedirs(archive, exist_ok=True)
    held = _read(os.path.join(results_dir, f"{stem}.json")) or {}
    when = str((held.get("machine") or {}).get("time_utc") or time.strftime("%Y-%m-%d"))[:10].replace("-", "")
    installed = []
    for name in sorted(os.listdir(staging)):
        src, dst = os.path.join(staging, name), os.path.join(results_dir, name)
        if os.path.lexists(dst):
            base, ext = os.path.splitext(name)
            target, n = os.path.join(archive, f"{base}_{when}{ext}"), 1
            while os.path.lexists(target):
                n += 1
                target = os.path.join(archive, f"{base}_{when}_{n}{ext}")
            shutil.move(dst, target)
        shutil.move(src, dst)
        installed.append(name)
    return installed


def run_job(job: Job, staging: str, log_path: str, deadline_s: float) -> int:
    """The job's benchmark under the bench lock, its output to ``log_path``; the whole tree killed at the
    deadline (rc 124)."""
    cmd = ["flock", LOCK, *job.argv, "--out", staging]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def rerender(results_dir: str) -> list[str]:
    """Everything that shows a headline, rendered again from the results now present; returns what failed."""
    steps = [[sys.executable, os.path.join(HERE, "run_all.py"), "--report-only"],
             [sys.executable, os.path.join(HERE, "headlines.py"), "--write"],
             [sys.executable, os.path.join(HERE, "results_index.py")]]
    failed = []
    for cmd in steps:
        rc = subprocess.run(cmd, cwd=REPO).returncode
        if rc != 0:
            failed.append(f"{shlex.join(cmd[1:])} (rc {rc})")
    return failed


def refresh(jobs: list[Job], results_dir: str, log_dir: str, say: Callable[[str], None] = print, *,
            run: Callable[[Job, str, str, float], int] = run_job,
            render: Callable[[str], list[str]] = rerender) -> int:
    """Run the jobs in order, install each one's result as it succeeds, render everything again at the end;
    returns 1 when a job or the rendering failed."""
    t0 = time.time()
    took: list[float] = []
    failed = []
    for i, job in enumerate(jobs):
        say(progress_line(i, jobs, time.time() - t0, took))
        staging = tempfile.mkdtemp(prefix=f"refresh_{job.stem}.", dir=log_dir)
        log = os.path.join(log_dir, f"{job.stem}.log")
        t = time.time()
        rc = run(job, staging, log, max(1800.0, 3 * job.estimate_s))
        took.append(time.time() - t)
        if rc == 0 and os.path.exists(os.path.join(staging, f"{job.stem}.json")):
            names = install(staging, results_dir, job.stem)
            say(f"[refresh] {i + 1}/{len(jobs)} {job.stem}: done in {fmt_duration(took[-1])}, installed "
                f"{', '.join(names)}")
        else:
            failed.append(job.stem)
            say(f"[refresh] {i + 1}/{len(jobs)} {job.stem}: FAILED (rc {rc}) after {fmt_duration(took[-1])}; the "
                f"current result stays; log {log}")
        shutil.rmtree(staging, ignore_errors=True)
    problems = render(results_dir)
    say(f"[refresh] {len(jobs) - len(failed)} of {len(jobs)} headline(s) re-measured in "
        f"{fmt_duration(time.time() - t0)}"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; re-rendering failed: {'; '.join(problems)}" if problems else "; README, REPORT.md, quotes and "
           "INDEX.md rendered again (commit them with the results)"))
    return 1 if failed or problems else 0


def uncommitted(path: str) -> list[str]:
    """Files under ``path`` (repository-relative) that differ from HEAD or are untracked; empty outside git."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=REPO, capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.refresh", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", "--dry-run", dest="list", action="store_true",
                   help="print the plan and its time estimate, run nothing")
    p.add_argument("--only", default="", help=f"comma-separated stems (of: {', '.join(ORDER)})")
    p.add_argument("--log-dir", default=None, help="job logs and staging (default: a new folder under /tmp)")
    args = p.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    unknown = only - set(ORDER)
    if unknown:
        p.error(f"--only: unknown stem(s) {', '.join(sorted(unknown))}; allowed: {', '.join(ORDER)}")
    jobs = plan(current_docs(RESULTS_DIR), only or None)
    if not jobs:
        print("[refresh] nothing to re-measure: no headline result found in benchmarks/results")
        return 1
    total = sum(j.estimate_s for j in jobs)
    for i, j in enumerate(jobs):
        print(f"[refresh] plan {i + 1}/{len(jobs)} {j.stem}: about {fmt_duration(j.estimate_s)} ({j.estimate_from})"
              f": flock {LOCK} {shlex.join(('python', *j.argv[1:]))} --out STAGING")
    print(f"[refresh] plan: {len(jobs)} job(s), about {fmt_duration(total)} in all, one at a time")
    dirty = uncommitted(MEASURED_CODE)
    if dirty:
        print(f"[refresh] warning: {len(dirty)} uncommitted file(s) under {MEASURED_CODE}/ (first: {dirty[0]}): the "
              "results will record this tree's digest, and read stale against any commit without exactly these "
              "changes; refresh on a clean checkout of the commit the figures are for")
    if args.list:
        return 0
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="deadpool_refresh.")
    os.makedirs(log_dir, exist_ok=True)
    print(f"[refresh] job logs in {log_dir}", flush=True)
    return refresh(jobs, RESULTS_DIR, log_dir, say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
