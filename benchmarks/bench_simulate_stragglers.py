#!/usr/bin/env python
"""Simulated goodput at 16,384 GPUs with stragglers (kept vs evicted into spares) and preemptions (killed vs
drained), issue 46, part 5.

Runs ``deadpool_ext/sim/stragglers.py`` (docs/simulator.md, "Stragglers and preemptions") at 16,384 GPUs (2,048
nodes x 8, the default 1% = 21 spares), costs calibrated from this project's measured results as ``deadpool
simulate`` does (the swap: ``recovery.json``'s hot-swap and restore; the drain: ``preempt.json``), over a sweep of
the typed-in assumptions (straggler rate per node-day x slowdown, the rule's factor 2 and 30 s window; preemptions
per day x the tier-3 base interval). Every source is in the output.

    python benchmarks/bench_simulate_stragglers.py --quick    # 4 trials x 10 days (seconds)
    python benchmarks/bench_simulate_stragglers.py            # 20 trials x 30 days (about 10 s)

Writes ``simulate_stragglers.json`` and ``.md`` into ``--out`` (default benchmarks/results;
``simulate_stragglers_quick.*`` with --quick). Pure Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, RESULTS_DIR, machine_info, md_table, write_json, write_text  # noqa: E402

sys.path.insert(0, REPO)
from deadpool_ext.sim.calibration import calibrate  # noqa: E402
from deadpool_ext.sim.costs import derive  # noqa: E402
from deadpool_ext.sim.params import Params  # noqa: E402
from deadpool_ext.sim.stragglers import (  # noqa: E402
    SOURCES,
    PreemptionModel,
    StragglerModel,
    calibrated,
    simulate,
    swap_s,
)

GPUS = 16_384
RATES = (0.0005, 0.002, 0.01)
"""Straggler episodes per node per day (2,048 nodes: about 1, 4 and 20 a day)."""
SLOWDOWNS = (1.5, 2.0, 4.0)
SPARES = (21, 4)
PREEMPT_RATES = (0.25, 1.0, 4.0)
INTERVALS_MIN = (30.0, 120.0)


def run(quick: bool) -> dict[str, Any]:
    cal = calibrate(RESULTS_DIR)
    base = cal.apply(Params()).with_overrides({"cluster.gpus": GPUS, "sim.trials": 4 if quick else 20,
                                               "sim.horizon_days": 10.0 if quick else 30.0})
    d = derive(base)
    model, detect_source = calibrated(StragglerModel(), RESULTS_DIR)
    rows = []
    for spares in SPARES:
        p = base.with_overrides({"cluster.spare_nodes": spares})
        for rate in RATES:
            for slow in SLOWDOWNS:
                r = simulate(p, dataclasses.replace(model, rate_per_node_day=rate, slowdown=slow), PreemptionModel(),
                             detect_source=detect_source)
                s = r["stragglers"]
                rows.append({"spares": spares, "rate_per_node_day": rate, "slowdown": slow,
                             **{k: s[k] for k in ("goodput_keep", "goodput_evict", "gained", "episodes",
                                                  "evictions", "kept_no_spare")}})
    pre = []
    for rate in PREEMPT_RATES:
        for interval in INTERVALS_MIN:
            r = simulate(base, StragglerModel(rate_per_node_day=0.0),
                         PreemptionModel(rate_per_day=rate, persist_interval_min=interval))["preemption"]
            pre.append({"rate_per_day": rate, "persist_interval_min": interval,
                        **{k: r[k] for k in ("cost_kill_s", "cost_drain_s", "goodput_kill", "goodput_drain",
                                             "gained")}})
    return {"gpus": GPUS, "nodes": d.nodes, "trials": base.sim.trials, "horizon_days": base.sim.horizon_days,
            "swap_s": swap_s(d), "swap_parts": {"hotswap_s": d.hotswap_s, "restore_fixed_s": d.restore_fixed_s,
                                                "peer_fetch_s": d.peer_fetch_s, "iteration_s": d.iteration_s},
            "storage_write_s": d.storage_write_s, "restart_s": d.restart_s, "storage_read_s": d.storage_read_s,
            "model": {"factor": model.factor, "detect_s": model.detect_s, "duration_h": model.duration_h},
            "calibration": cal.to_dict(), "sources": {**SOURCES, "stragglers.detect_s": detect_source},
            "stragglers": rows, "preemptions": pre}


def render(doc: dict[str, Any]) -> str:
    r = doc["result"]
    m, sp = r["model"], r["swap_parts"]
    lines = [
        "# Simulated: stragglers evicted into spares, preemptions drained (issue 46, part 5)", "",
        f"`{doc['command']}` at {doc['when']}. **Simulated, not measured**: `deadpool_ext/sim/stragglers.py` at "
        f"{r['gpus']:,} GPUs ({r['nodes']:,} nodes), {r['trials']} trials x {r['horizon_days']:g} days per row.", "",
        f"An eviction stops the job for **{r['swap_s']:.1f} s**: hot-swap {sp['hotswap_s']:.2f} s + restore "
        f"{sp['restore_fixed_s']:.2f} s (measured: calibrated from `benchmarks/results/recovery.json`) + the lost "
        f"node's share from its peer {sp['peer_fetch_s']:.2f} s (bandwidth) + one iteration {sp['iteration_s']:g} s. "
        f"The rule names a straggler {m['detect_s']:.1f} s after its onset (the default 30 s window x the fraction "
        "of it `benchmarks/results/straggler.json` measured from the onset to the naming) when its slowdown is at "
        f"least {m['factor']:g}x; episodes last {m['duration_h']:g} h on average if kept (assumption). Evicted nodes "
        "are away for `cluster.node_repair_h` (24 h); with no spare in the pool the straggler is kept.", "",
        "## Stragglers: goodput kept vs evicted", "",
        md_table(["spares", "episodes / node-day (assumed)", "slowdown (assumed)", "episodes", "evictions",
                  "kept: no spare", "goodput kept", "goodput evicted", "gained"],
                 [[x["spares"], x["rate_per_node_day"], x["slowdown"], f"{x['episodes']:.0f}",
                   f"{x['evictions']:.0f}", f"{x['kept_no_spare']:.0f}", f"{x['goodput_keep']:.4f}",
                   f"{x['goodput_evict']:.4f}", f"{x['gained']:+.4f}"] for x in r["stragglers"]]), "",
        "A slowdown of 1.5x is below the factor 2: never named, nothing gained (lower `straggler.factor` to catch "
        "it). With 4 spares and 20 episodes a day the pool runs dry (each evicted node is away 24 h) and most "
        "stragglers are kept.", "",
        "## Preemptions: goodput killed vs drained", "",
        f"Each preemption pays the requeue and start-up ({r['restart_s']:.0f} s) and the state read back "
        f"({r['storage_read_s']:.1f} s); killed, it recomputes half a tier-3 base interval; drained, it writes the "
        f"newest version ({r['storage_write_s']:.1f} s + the drain's measured 0.11 s, `preempt.json`).", "",
        md_table(["preemptions / day (assumed)", "base interval min (assumed)", "cost killed s", "cost drained s",
                  "goodput killed", "goodput drained", "gained"],
                 [[x["rate_per_day"], x["persist_interval_min"], f"{x['cost_kill_s']:.0f}",
                   f"{x['cost_drain_s']:.0f}", f"{x['goodput_kill']:.4f}", f"{x['goodput_drain']:.4f}",
                   f"{x['gained']:+.4f}"] for x in r["preemptions"]]), "",
        "## Sources", "", *[f"- `{k}`: {v}" for k, v in r["sources"].items()], "",
        "Calibrated costs: " + "; ".join(f"`{k}` from {v}" for k, v in r["calibration"].get("sources", {}).items()),
        ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=RESULTS_DIR)
    args = p.parse_args(argv)
    name = "simulate_stragglers_quick" if args.quick else "simulate_stragglers"
    t0 = time.time()
    doc = {"command": shlex.join(["python", "benchmarks/bench_simulate_stragglers.py", *(argv or sys.argv[1:])]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
           "result": run(args.quick)}
    doc["wall_s"] = time.time() - t0
    write_json(os.path.join(args.out, f"{name}.json"), doc)
    md = render(doc)
    write_text(os.path.join(args.out, f"{name}.md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
