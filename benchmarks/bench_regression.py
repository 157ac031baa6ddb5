#!/usr/bin/env python
"""No-regression check of one piece of work: the recovery and overhead benchmarks of two commits, in one run.

Issue "One recovery path" asks that the recovery and overhead benchmarks, measured as the honest-numbers issue
defines them, show no regression in the same run against the commit before the work. This script checks out both
commits as worktrees (each runs its own benchmark code and its own package: ``PYTHONPATH`` names the worktree, and
``deadpool_ext/patches`` is linked to the worktree's ``patches/``), then alternates them on this machine:

* recovery: ``bench_recovery.py --sizes small --repeats 1 --no-rebuild`` per commit and round, the order swapped
  every round (before/after, after/before, ...). Figures: kill -> every rank restored, kill -> next completed
  step, relaunch + load (the same run's baseline), and the phases.
* overhead: ``bench_snapshot_overhead.py --sizes small --nproc 2 --modes none,deadpool`` per commit (10
  interleaved rounds of 8-step windows inside each job, the window ending when the last snapshot is committed;
  the figure is the job's own deadpool/none ratio with its 90% CI), the order swapped between repeats.

Verdict per figure: after / before of the medians, with the spread of each side beside it. A figure regresses
when the after side's median is worse by more than the larger of 10% and the two sides' spread (recovery), or when
the after job's ratio CI lies wholly above the before job's (overhead).

    python benchmarks/bench_regression.py --before d4c3917 --after HEAD
    python benchmarks/bench_regression.py --quick --before HEAD~1 --after HEAD   # tiny model, ~5 min

Writes ``<name>.json`` and ``<name>.md`` (default ``regression``) under ``--out`` and keeps each job's own
results and logs under ``<out>/<name>_runs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, write_json, write_text  # noqa: E402


def _git(*args: str, cwd: str = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _worktree(rev: str, root: str) -> tuple[str, str]:
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = os.path.join(root, sha[:10])
    if not os.path.isdir(path):
        _git("worktree", "add", "--detach", path, sha)
    link = os.path.join(path, "deadpool_ext", "patches")
    if not os.path.exists(link):
        os.symlink(os.path.join("..", "patches"), link)
    return sha, path


def _run(tree: str, argv: list[str], log: str, timeout_s: float) -> int:
    env = dict(os.environ, PYTHONPATH=tree)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    env.setdefault("DS_ACCELERATOR", "cpu")
    print(f"[regression] {os.path.basename(tree)}: {' '.join(argv)}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *argv], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[regression]   rc={rc} in {time.time() - t0:.0f} s (log {log})", flush=True)
    return rc


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _reused(runs: str, stem: str, sha: str, reuse: bool) -> dict[str, Any] | None:
    """A run of this stem already in ``runs`` (``--reuse``), if it was made from the same commit."""
    if not reuse:
        return None
    got = _load(os.path.join(runs, f"{stem}.json"))
    if got is None or sha[:10] not in json.dumps(got.get("machine") or got):
        return None
    print(f"[regression] {stem}: reusing the run already in {runs} (same commit)", flush=True)
    return got


def recovery_figures(doc: dict[str, Any], size: str) -> dict[str, float] | None:
    s = doc.get("sizes", {}).get(size, {})
    a = s.get("analysis") or {}
    hs, ready = a.get("hotswap") or {}, a.get("ready") or {}
    if not hs or "hotswap_s" not in ready:
        return None
    ph = hs.get("phases_median") or {}
    return {"kill_to_restored_s": ready["hotswap_s"], "kill_to_next_step_s": hs["raw_s"]["median"],
            "relaunch_to_restored_s": ready.get("baseline_s", float("nan")),
            "agree_s": ph.get("agree_s", float("nan")), "restore_s": ph.get("restore_s", float("nan")),
            "normal_step_s": hs.get("normal_step_s", float("nan"))}


def overhead_figures(doc: dict[str, Any], size: str) -> dict[str, Any] | None:
    m = (doc.get("sizes", {}).get(size, {}).get("analysis") or {}).get("modes", {}).get("deadpool")
    if not m:
        return None
    return {"window_ratio": m["window_ratio"], "window_ratio_ci90": m["window_ratio_ci90"],
            "cpu_ratio": m["cpu_ratio"], "cpu_ratio_ci90": m["cpu_ratio_ci90"]}


JUDGED = ("kill_to_restored_s", "kill_to_next_step_s")  # the rest is context: phases, the control, a normal step


def verdict_recovery(before: list[float], after: list[float], judged: bool = True) -> dict[str, Any]:
    """Pure: medians, spreads, after/before, and whether the after side is worse beyond the noise."""
    mb, ma = statistics.median(before), statistics.median(after)
    spread = max(max(before) - min(before), max(after) - min(after))
    allowed = max(0.10 * mb, spread)
    return {"before_median": mb, "after_median": ma, "before": before, "after": after,
            "after_over_before": ma / mb if mb else float("nan"), "allowed_s": allowed,
            "judged": judged, "regressed": judged and ma - mb > allowed}


def verdict_overhead(before: list[dict[str, Any]], after: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Pure: a regression is an after CI wholly above every before CI."""
    lo_after = min(x[f"{key}_ci90"][0] for x in after)
    hi_before = max(x[f"{key}_ci90"][1] for x in before)
    mb = statistics.median(x[key] for x in before)
    ma = statistics.median(x[key] for x in after)
    return {"before": [x[key] for x in before], "after": [x[key] for x in after],
            "before_ci90": [x[f"{key}_ci90"] for x in before], "after_ci90": [x[f"{key}_ci90"] for x in after],
            "before_median": mb, "after_median": ma, "regressed": lo_after > hi_before}


def _mark(v: dict[str, Any]) -> str:
    return ("**yes**" if v["regressed"] else "no") if v["judged"] else "context"


def render(doc: dict[str, Any]) -> str:
    b, a = doc["before"], doc["after"]
    out = [f"# No-regression check: `{a['sha'][:10]}` against `{b['sha'][:10]}`", "",
           f"Before: `{b['sha'][:10]}` ({b['subject']}). After: `{a['sha'][:10]}` ({a['subject']}).", "",
           f"Command: `{doc['command']}`. Machine: {doc['machine'].get('cpu_count')} CPUs, "
           f"load at start {doc['machine'].get('loadavg')}; {doc['time_utc']}; total wall {doc['wall_s']:.0f} s.",
           "", "Each commit runs its own benchmark code and package, alternated on this machine in one run "
           "(the order swapped every round), so both sides see the same host. A run's `git.dirty` is the link "
           "`deadpool_ext/patches` -> `patches/` this script adds to each worktree, nothing else.", ""]
    rec = doc.get("recovery", {})
    if rec:
        out += [f"## Recovery (GPT {doc['size']}, 3 ranks + 1 spare, in-place hot-swap, SIGKILL of rank 1)", "",
                "| figure | before (median) | after (median) | after / before | before runs | after runs | "
                "regressed |", "|---|---|---|---|---|---|---|"]
        for k, v in rec.items():
            out.append(f"| {k} | {v['before_median']:.2f} s | {v['after_median']:.2f} s | "
                       f"{v['after_over_before']:.3f} | {', '.join(f'{x:.2f}' for x in v['before'])} | "
                       f"{', '.join(f'{x:.2f}' for x in v['after'])} | {_mark(v)} |")
        out.append("")
    ov = doc.get("overhead", {})
    if ov:
        out += [f"## Overhead (GPT {doc['size']}, 2 ranks, replica on, a snapshot every step, window rule)", "",
                "| figure | before | after | regressed |", "|---|---|---|---|"]
        for k, v in ov.items():
            fb = "; ".join(f"{x:.3f} [{c[0]:.3f}, {c[1]:.3f}]" for x, c in zip(v["before"], v["before_ci90"]))
            fa = "; ".join(f"{x:.3f} [{c[0]:.3f}, {c[1]:.3f}]" for x, c in zip(v["after"], v["after_ci90"]))
            out.append(f"| deadpool {k} | {fb} | {fa} | {'**yes**' if v['regressed'] else 'no'} |")
        out.append("")
    out += ["Rule: a recovery figure (kill to restored, kill to next step; the phases, a normal step and the control "
            "job 'relaunch + load', which runs no deadpool code, are context) regresses when the after median is "
            "worse by more than the larger of 10% of "
            "the before median and the larger side's spread (max - min); an overhead ratio regresses when the after "
            "job's 90% CI lies wholly above the before job's.", "",
            f"**Verdict: {verdict(doc)}.**"]
    if doc.get("failures"):
        out += ["", "Runs that failed: " + "; ".join(doc["failures"])]
    return "\n".join(out) + "\n"


def verdict(doc: dict[str, Any]) -> str:
    """Pure: a regression wherever one was measured; otherwise none only when every part ran to figures."""
    if doc["regressed"]:
        return "REGRESSION"
    if not doc.get("complete", True):
        return "none: runs failed or produced no figures, so no-regression is not shown"
    return "no regression"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="HEAD~1",
                   help="the commit before the work (any git revision; default HEAD~1, the last commit's parent)")
    p.add_argument("--after", default="HEAD", help="the commit with the work (default HEAD)")
    p.add_argument("--rounds", type=int, default=2, help="recovery rounds per commit (the order swaps each round)")
    p.add_argument("--overhead-repeats", type=int, default=1, help="overhead jobs per commit")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round, short overhead job")
    p.add_argument("--skip", default="", help="comma list of parts to skip: recovery, overhead")
    p.add_argument("--reuse", action="store_true",
                   help="reuse runs of the same commit already under --out (after an interrupted or partial run)")
    p.add_argument("--worktrees", default="/tmp/deadpool_regression", help="where the two worktrees go")
    p.add_argument("--name", default=None, help="results stem (default regression[_quick])")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    args = p.parse_args()
    args.out = os.path.abspath(args.out)  # each benchmark runs in its worktree: a relative --out would land there
    size = "tiny" if args.quick else "small"
    name = args.name or ("regression_quick" if args.quick else "regression")
    skip = {s for s in args.skip.split(",") if s}
    bad = skip - {"recovery", "overhead"}
    if bad:
        print(f"bench_regression: --skip: unknown part(s) {sorted(bad)}; allowed: recovery, overhead", file=sys.stderr)
        return 2
    runs = os.path.join(args.out, f"{name}_runs")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(args.worktrees, exist_ok=True)
    t0 = time.time()
    sides = {}
    for label, rev in (("before", args.before), ("after", args.after)):
        sha, tree = _worktree(rev, args.worktrees)
        sides[label] = {"rev": rev, "sha": sha, "tree": tree, "subject": _git("log", "-1", "--format=%s", sha)[:100]}
    doc: dict[str, Any] = {"benchmark": "regression", "command": " ".join(["python", *sys.argv]),
                           "machine": machine_info(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "size": size, "failures": []}
    for k in ("before", "after"):
        doc[k] = {x: sides[k][x] for x in ("rev", "sha", "subject")}
    rec_runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    if "recovery" not in skip:
        for r in range(1 if args.quick else args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                stem = f"recovery_{label}_{r}"
                argv = ["benchmarks/bench_recovery.py", "--sizes", size, "--repeats", "1", "--no-rebuild",
                        "--reference-sizes", "", "--name", stem, "--out", runs]
                got = _reused(runs, stem, sides[label]["sha"], args.reuse)
                if got is None:
                    rc = _run(sides[label]["tree"], argv, os.path.join(runs, f"{stem}.log"), 1800)
                    got = _load(os.path.join(runs, f"{stem}.json"))
                else:
                    rc = 0
                figs = recovery_figures(got, size) if got else None
                if rc != 0 or figs is None:
                    doc["failures"].append(f"{stem} (rc {rc})")
                    continue
                rec_runs[label].append(figs)
        if rec_runs["before"] and rec_runs["after"]:
            b, a = rec_runs["before"], rec_runs["after"]
            doc["recovery"] = {k: verdict_recovery([x[k] for x in b], [x[k] for x in a], k in JUDGED)
                               for k in b[0]}
    ov_runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    if "overhead" not in skip:
        for r in range(args.overhead_repeats):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                stem = f"snapshot_overhead_regress_{label}_{r}"  # the benchmark requires its prefix
                argv = ["benchmarks/bench_snapshot_overhead.py", "--sizes", size, "--nproc", "2",
                        "--modes", "none,deadpool", "--name", stem, "--out", runs]
                if args.quick:
                    argv += ["--rounds", "3"]
                got = _reused(runs, stem, sides[label]["sha"], args.reuse)
                if got is None:
                    rc = _run(sides[label]["tree"], argv, os.path.join(runs, f"{stem}.log"), 3600)
                    got = _load(os.path.join(runs, f"{stem}.json"))
                else:
                    rc = 0
                figs = overhead_figures(got, size) if got else None
                if rc != 0 or figs is None:
                    doc["failures"].append(f"{stem} (rc {rc})")
                    continue
                ov_runs[label].append(figs)
        if ov_runs["before"] and ov_runs["after"]:
            doc["overhead"] = {k: verdict_overhead(ov_runs["before"], ov_runs["after"], k)
                               for k in ("window_ratio", "cpu_ratio")}
    doc["recovery_runs"], doc["overhead_runs"] = rec_runs, ov_runs
    doc["wall_s"] = time.time() - t0
    doc["regressed"] = any(v["regressed"] for part in ("recovery", "overhead") for v in doc.get(part, {}).values())
    doc["complete"] = not doc["failures"] and all(part in doc for part in ("recovery", "overhead") if part not in skip)
    write_json(os.path.join(args.out, f"{name}.json"), doc)
    write_text(os.path.join(args.out, f"{name}.md"), render(doc))
    print(render(doc))
    return 1 if doc["regressed"] or not doc["complete"] else 0


if __name__ == "__main__":
    sys.exit(main())
