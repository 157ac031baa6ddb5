#!/usr/bin/env python
"""The straggler rule's cost in the coordinator (issue 46, part 1): one ``judge()`` turn, 256 to 16,384 ranks.

A synthetic job of 8 ranks a node, a window's pace samples per rank (``SAMPLES_PER_WINDOW`` + 1), one node three
times slower than the rest, driven through ``deadpool_ext.launcher.straggler.judge`` in this process: the turn
where the rule runs over the whole window (the one that names and evicts the slow node), ``--repeats`` times per
size. Each turn's result is checked (the slow node, and only it, evicted). The coordinator takes its turns at
most every ``decide.TURN_GAP_S`` for a stalled store, and the rule runs at most every ``window_s / 16`` s; the
figure to compare with both is the worst turn at the largest size.

    flock /tmp/deadpool-bench.lock python benchmarks/bench_straggler_rule.py     # ~1 min on 2 cores

Writes ``benchmarks/results/straggler_rule.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, add_output_args, machine_info, md_table, median, render_only, save_result  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

SIZES = (256, 2048, 16384)
NPROC = 8
SLOW_NODE = 7


def job(ranks: int, window_s: float) -> tuple[Any, Any, float]:
    """(assignment, state with a window of samples per rank, the turn's time)."""
    from deadpool_ext.cluster.assignment import Assignment
    from deadpool_ext.launcher import straggler as sg

    nodes_n = ranks // NPROC
    ids = {f"node{i}.{j}": i * NPROC + j for i in range(nodes_n) for j in range(NPROC)}
    a = Assignment(generation=0, world_size=ranks, ranks=ids, nodes={w: w.split(".")[0] for w in ids},
                   spares=("spare0",))
    gap = window_s / sg.SAMPLES_PER_WINDOW
    n = sg.SAMPLES_PER_WINDOW + 2
    history = {}
    for w in ids:
        busy = 3.0 if w.split(".")[0] == f"node{SLOW_NODE}" else 1.0
        history[w] = tuple(sg.Sample(k * gap, k, 3.0 * k, (3.0 - busy) * k, True) for k in range(n))
    return a, sg.StragglerState(generation=0, history=history), (n - 1) * gap


def measure(ranks: int, repeats: int, window_s: float) -> dict[str, Any]:
    from deadpool_ext.launcher import straggler as sg

    a, state, now = job(ranks, window_s)
    s = sg.StragglerSettings(window_s=window_s, action="swap")
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        v = sg.judge(state, {}, a, ("spare0",), now, s)
        took.append(time.perf_counter() - t0)
        named = sorted({w.split(".")[0] for w in v.evict})
        if named != [f"node{SLOW_NODE}"]:
            raise SystemExit(f"bench_straggler_rule: {ranks} ranks: the rule evicted {named}, "
                             f"expected node{SLOW_NODE} alone")
    return {"ranks": ranks, "nodes": ranks // NPROC, "turn_s": took, "median_s": median(took),
            "min_s": min(took), "max_s": max(took)}


def render(doc: dict[str, Any]) -> str:
    rows = [(r["ranks"], r["nodes"], f"{r['median_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
             f"{r['max_s'] * 1e3:.1f}", len(r["turn_s"])) for r in doc["sizes"]]
    worst = doc["sizes"][-1]
    m = doc["machine"]
    return "\n".join([
        "# The straggler rule's cost in the coordinator", "",
        f"`{doc['command']}` at {doc['when']}, {m.get('cpu_model')} ({m.get('cpu_count')} CPUs, load "
        f"{' / '.join(f'{x:.1f}' for x in m.get('loadavg') or ())}).", "",
        f"One turn of `judge()` in which the rule runs over a full window ({doc['args']['window']} s, "
        f"{doc['samples']} samples a rank), {NPROC} ranks a node, node{SLOW_NODE} three times slower than the "
        "rest; every turn evicted node7 alone.", "",
        md_table(("ranks", "nodes", "turn median (ms)", "min (ms)", "max (ms)", "turns"), rows), "",
        f"At {worst['ranks']:,} ranks the worst turn took {worst['max_s'] * 1e3:.0f} ms, against the coordinator's "
        f"{doc['turn_gap_s']:.1f} s turn gap for a stalled store and a rule run at most every "
        f"{doc['args']['window'] / doc['samples_per_window']:.2f} s; a shared host's load shows in the spread.",
        ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--window", type=float, default=30.0, help="straggler.window_s (default: the config's)")
    add_output_args(p, "straggler_rule")
    args = p.parse_args(argv)
    if args.render_only:
        return render_only(args.render_only, render)
    from deadpool_ext.launcher import straggler as sg
    from deadpool_ext.launcher.decide import TURN_GAP_S

    sizes = []
    for ranks in SIZES:
        sizes.append(measure(ranks, args.repeats, args.window))
        print(f"{ranks} ranks: median {sizes[-1]['median_s'] * 1e3:.1f} ms, max {sizes[-1]['max_s'] * 1e3:.1f} ms",
              flush=True)
    doc = {"command": " ".join(["python", "benchmarks/bench_straggler_rule.py", *(argv or sys.argv[1:])]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
           "machine": machine_info(), "samples": sg.SAMPLES_PER_WINDOW + 2,
           "samples_per_window": sg.SAMPLES_PER_WINDOW, "turn_gap_s": TURN_GAP_S, "sizes": sizes}
    print(save_result(args.out, args.name, doc, render))
    return 0


if __name__ == "__main__":
    sys.exit(main())
