"""The committed fuzzing campaign: every property-based target under tests/security (``test_fuzz_*``) with at
least 10,000 generated cases each, recorded in benchmarks/results/fuzz.{json,md}.

    python benchmarks/bench_fuzz.py                    # 10,000 cases per target (minutes)
    python benchmarks/bench_fuzz.py --examples 500     # a quick look

CI runs the same targets with a few hundred derandomized cases (tests/security/conftest.py); this campaign draws
fresh random cases from ``--seed`` and reports, per target, the cases hypothesis ran (passing + failing +
invalid) from its own statistics, and the outcome. A failure is a finding: the script exits non-zero and the
markdown names the target.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

_TEST = re.compile(r"^(tests/security/\S+::test_fuzz_\w+(?:\[[^\]]*\])?):?$")
_COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")
_TIME = re.compile(r"Typical runtimes: ([^\n]+)")


def parse_statistics(output: str) -> dict[str, dict[str, Any]]:
    """Per-target counts from pytest's ``--hypothesis-show-statistics`` block."""
    stats: dict[str, dict[str, Any]] = {}
    current: str | None = None
    for line in output.splitlines():
        line = line.strip()
        m = _TEST.match(line)
        if m:
            current = m.group(1)
            stats.setdefault(current, {})
            continue
        if current is None:
            continue
        c = _COUNTS.search(line)
        if c:
            passing, failing, invalid = (int(x) for x in c.groups())
            st = stats[current]
            st["passing"] = st.get("passing", 0) + passing
            st["failing"] = st.get("failing", 0) + failing
            st["invalid"] = st.get("invalid", 0) + invalid
        t = _TIME.search(line)
        if t:
            stats[current]["typical_runtime"] = t.group(1)
    return stats


def render(doc: dict[str, Any]) -> str:
    lines = ["# Fuzzing campaign (tests/security, property-based)", "",
             f"Run {doc['when']} on {doc['machine']}, code {doc['commit']}, command `{doc['command']}`.", "",
             f"{doc['examples']} cases requested per target, seed {doc['seed']}; pytest exit code {doc['returncode']} "
             f"in {doc['elapsed_s']:.0f} s. CI runs the same targets with a few hundred derandomized cases.", "",
             "| target | cases run | passing | failing | invalid (filtered) | outcome |", "|---|---|---|---|---|---|"]
    for name, st in sorted(doc["targets"].items()):
        total = st.get("passing", 0) + st.get("failing", 0) + st.get("invalid", 0)
        lines.append(f"| `{name.split('::')[0].split('/')[-1]}::{name.split('::')[1]}` | {total} | "
                     f"{st.get('passing', 0)} | {st.get('failing', 0)} | {st.get('invalid', 0)} | "
                     f"{st.get('outcome', '?')} |")
    lines += ["", "A target passes when every generated input either parses or raises one of the documented error "
              "types (the test names them); anything else escaping is a failure, with the input hypothesis shrank "
              "to in the pytest output."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=10_000, help="cases per target (default 10,000)")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--name", default="fuzz", help="result name under benchmarks/results/")
    args = p.parse_args(argv)
    if args.examples < 1:
        raise SystemExit("--examples must be >= 1")
    env = {**os.environ, "DEADPOOL_FUZZ_EXAMPLES": str(args.examples), "DEADPOOL_FUZZ_SEED": str(args.seed),
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/security", "-k", "fuzz",
           "--hypothesis-show-statistics", f"--hypothesis-seed={args.seed}", "-rA"]
    print(f"[fuzz] {args.examples} cases per target: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.time() - t0
    targets = parse_statistics(res.stdout)
    for line in res.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR) (tests/security/\S+::test_fuzz_\w+(?:\[[^\]]*\])?)", line)
        if m and m.group(2) in targets:
            targets[m.group(2)]["outcome"] = m.group(1).lower()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "machine":
           f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}", "commit": commit,
           "command": f"python benchmarks/bench_fuzz.py --examples {args.examples} --seed {args.seed}",
           "examples": args.examples, "seed": args.seed, "returncode": res.returncode, "elapsed_s": elapsed,
           "targets": targets}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(RESULTS, f"{args.name}.md"), "w") as fh:
        fh.write(render(doc))
    print(render(doc))
    if res.returncode != 0:
        print(res.stdout[-6000:], res.stderr[-3000:], sep="\n")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
