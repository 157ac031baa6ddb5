#!/usr/bin/env python
"""Simulated goodput when the spare pool runs dry: ``fail`` vs ``wait`` vs ``shrink`` at 16,384 GPUs (issue #17).

Runs ``deadpool_ext.sim`` (docs/simulator.md, "No spare left") for the DeadPool hot-swap policy at 16,384 GPUs
(2,048 nodes x 8) with few spares, under each ``cluster.no_spare_policy``; every other parameter is the
simulator's default, costs calibrated from this project's measured results as ``deadpool simulate`` does. The
checkpoint intervals are found once by sweep (seed 0, the default 1% = 21 spares, ``wait``) and then held
fixed, so rows differ only in spares and in what the job does without one. Also: ``shrink`` when a
data-parallel replica spans 16 nodes (tensor 8 x pipeline 16, Llama 3 405B's layout), and, at 4 spares, the
whole-job restart policies ``gemini`` and ``ckpt_async`` under the same three behaviours.

    python benchmarks/bench_simulate_shrink.py --quick     # 1 seed x 4 trials x 10 days (~5 s)
    python benchmarks/bench_simulate_shrink.py             # seeds 0,1,2 x 20 trials x 30 days (~1 min on 2 cores)

Writes ``simulate_shrink.json`` and ``simulate_shrink.md`` into ``--out`` (default benchmarks/results;
``simulate_shrink_quick.*`` with --quick). Pure Python.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, RESULTS_DIR, machine_info, md_table, percentile, write_json, write_text  # noqa: E402

sys.path.insert(0, REPO)
from deadpool_ext.sim import elastic  # noqa: E402
from deadpool_ext.sim.calibration import calibrate  # noqa: E402
from deadpool_ext.sim.engine import run_trial  # noqa: E402
from deadpool_ext.sim.params import NO_SPARE_POLICIES, Params  # noqa: E402
from deadpool_ext.sim.policies import make_policy  # noqa: E402
from deadpool_ext.sim.sweep import Evaluator, search  # noqa: E402

GPUS = 16_384
SPARES = (0, 4, 16, 64)
UNIT_CONTEXT = 16
"""Nodes per data-parallel replica in the layout variant: tensor 8 (one node) x pipeline 16."""
CONTEXT_POLICIES = ("gemini", "ckpt_async")
CONTEXT_SPARES = 4
SHORT = {"memory_interval": "mem", "persist_interval": "persist", "base_interval": "base"}
LOST = ("wait", "shrunk", "stopped", "rework", "overhead", "detect", "restart", "load", "replay")


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def best_intervals(base: Params, name: str) -> dict[str, int]:
    """The policy's best intervals at seed 0 with the default spares and ``wait`` (the sweep of
    ``deadpool simulate``), held fixed for every row."""
    ev = Evaluator(base.with_overrides({"sim.seed": 0}))
    return search(ev, [name])[name].best.intervals


def evaluate(base: Params, policy: str, intervals: dict[str, int], seeds: list[int], **flat: Any) -> dict[str, Any]:
    """One configuration over every seed's traces: goodput per trial pooled, per-seed means, mean breakdown."""
    pol = make_policy(policy, **intervals)
    results, per_seed = [], {}
    for seed in seeds:
        ev = Evaluator(base.with_overrides({**flat, "sim.seed": seed}))
        rs = [run_trial(pol, ev.d, tr, ev.horizon_s) for tr in ev.traces]
        per_seed[str(seed)] = statistics.fmean(r.goodput for r in rs)
        results += rs
        horizon = ev.horizon_s
    g = [r.goodput for r in results]
    stops = [r.stopped_s / 86_400.0 for r in results if r.stopped_s is not None]
    n = len(results)
    return {
        "policy": policy, "intervals": intervals, **{k.split(".")[1]: v for k, v in flat.items()},
        "trials": n, "goodput_mean": statistics.fmean(g), "goodput_sd": statistics.pstdev(g),
        "goodput_p5": percentile(g, 5), "goodput_p95": percentile(g, 95), "goodput_min": min(g),
        "goodput_max": max(g), "goodput_per_seed": per_seed,
        "breakdown": {c: sum(r.breakdown[c] for r in results) / n / horizon for c in results[0].breakdown},
        "shrinks_mean": sum(r.shrinks for r in results) / n, "grows_mean": sum(r.grows for r in results) / n,
        "capacity_mean": statistics.fmean(r.capacity for r in results),
        "failures_mean": sum(r.failures for r in results) / n,
        "waits_mean": sum(r.waits for r in results) / n,
        "stopped_share": len(stops) / n, "stopped_day_mean": statistics.fmean(stops) if stops else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cal = calibrate(RESULTS_DIR)
    base = cal.apply(Params()).with_overrides({"cluster.gpus": GPUS, "sim.trials": args.trials,
                                               "sim.horizon_days": args.horizon_days})
    ev = Evaluator(base)
    d = ev.d
    full = elastic.replicas(d)
    out: dict[str, Any] = {
        "benchmark": "simulate_shrink", "command": args.command, "machine": machine_info(()),
        "calibration": cal.to_dict(), "base_params": base.to_dict(), "seeds": args.seeds,
        "trials_per_seed": args.trials, "horizon_days": args.horizon_days,
        "event_costs_s": {
            "shrink": {"detect": d.detect_s, "restart": d.startup_s, "load": elastic.reshard_s(d, full - 1),
                       "note": f"hot-swap instead: detect + rebuild {d.hotswap_fixed_s:.3f} + restore "
                               f"{d.restore_fixed_s + d.peer_fetch_s:.3f}"},
            "grow": {"detect": 0.0, "restart": d.startup_s, "load": d.d2h_s + elastic.reshard_s(d, full)},
        },
        "rows": [], "layout_rows": [], "context_rows": [],
    }
    t0 = time.monotonic()

    def note(line: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

    note("deadpool: interval sweep (seed 0, default spares, wait)")
    iv = {"deadpool": best_intervals(base, "deadpool")}
    for spares in args.spares:
        for ns in NO_SPARE_POLICIES:
            note(f"deadpool, {spares} spares, {ns}")
            out["rows"].append(evaluate(base, "deadpool", iv["deadpool"], args.seeds, **{
                "cluster.spare_nodes": spares, "cluster.no_spare_policy": ns}))
        note(f"deadpool, {spares} spares, shrink, {UNIT_CONTEXT} nodes per replica")
        out["layout_rows"].append(evaluate(base, "deadpool", iv["deadpool"], args.seeds, **{
            "cluster.spare_nodes": spares, "cluster.no_spare_policy": "shrink",
            "cluster.shrink_unit_nodes": UNIT_CONTEXT}))
    for name in CONTEXT_POLICIES:
        note(f"{name}: interval sweep")
        iv[name] = best_intervals(base, name)
        for ns in NO_SPARE_POLICIES:
            note(f"{name}, {CONTEXT_SPARES} spares, {ns}")
            out["context_rows"].append(evaluate(base, name, iv[name], args.seeds, **{
                "cluster.spare_nodes": CONTEXT_SPARES, "cluster.no_spare_policy": ns}))
    out["intervals"] = iv
    out["wall_s"] = time.monotonic() - t0
    return out


# -- markdown -------------------------------------------------------------------------------------------
def _g(r: dict[str, Any]) -> str:
    return f"{r['goodput_mean']:.4f} ± {r['goodput_sd']:.4f}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _detail(rows: list[dict[str, Any]]) -> str:
    heads = ["policy", "spares", "no spare", "nodes/replica", "goodput mean", "sd", "[p5, p95]", "[min, max]",
             "per-seed means", "live fraction", "shrinks/trial", "stopped (trials, mean day)", *LOST]
    body = []
    for r in rows:
        b = r["breakdown"]
        stop = (f"{100 * r['stopped_share']:.0f}%, day {r['stopped_day_mean']:.2f}" if r["stopped_day_mean"]
                is not None else "0%")
        body.append([r["policy"], r["spare_nodes"], r["no_spare_policy"], r.get("shrink_unit_nodes", 1),
                     f"{r['goodput_mean']:.4f}", f"{r['goodput_sd']:.4f}",
                     f"[{r['goodput_p5']:.4f}, {r['goodput_p95']:.4f}]",
                     f"[{r['goodput_min']:.4f}, {r['goodput_max']:.4f}]",
                     " / ".join(f"{v:.4f}" for v in r["goodput_per_seed"].values()), f"{r['capacity_mean']:.4f}",
                     f"{r['shrinks_mean']:.1f}", stop, *(_pct(b[c]) for c in LOST)])
    return md_table(heads, body)


def markdown(res: dict[str, Any]) -> str:
    p = res["base_params"]
    c, w = p["cluster"], p["workload"]
    rows = {(r["spare_nodes"], r["no_spare_policy"]): r for r in res["rows"]}
    spares = sorted({r["spare_nodes"] for r in res["rows"]})
    layout = {r["spare_nodes"]: r for r in res["layout_rows"]}
    iv = res["intervals"]["deadpool"]
    n = len(res["seeds"]) * res["trials_per_seed"]
    cost = res["event_costs_s"]
    L = ["# Simulated goodput without spares: fail vs wait vs shrink, 16,384 GPUs", "",
         f"Command: `{res['command']}` ({res['wall_s']:.0f} s). Simulated, not measured (`deadpool_ext.sim`, "
         "`docs/simulator.md`, section \"No spare left\"). Seeds "
         f"{', '.join(str(s) for s in res['seeds'])} x {res['trials_per_seed']} trials x {res['horizon_days']:g} "
         f"days = {n} traces per row (the same traces in every row of a seed: common random numbers). "
         "Goodput = useful training time / wall time; `±` is the standard deviation over the traces, "
         "[p5, p95] their 5th and 95th percentiles.", "",
         f"Cluster: {GPUS:,} GPUs = {GPUS // c['gpus_per_node']:,} nodes x {c['gpus_per_node']}, a lost node "
         f"back after {c['node_repair_h']:g} h, a transient fault's fenced node after {c['node_reboot_s']:g} s; "
         f"model {w['params_b']:g}B, iteration {w['iteration_s']:g} s; failures at Llama 3's rate (one every ~3.1 h, "
         f"{100 * p['failure']['node_lost_fraction']:.0f}% lose the node), an outage every "
         f"{1 / p['failure']['cluster_outage_per_day']:.0f} days. Policy `deadpool` (hot-swap) at fixed intervals "
         f"mem {iv['memory_interval']}, persist {iv['persist_interval']} (its sweep optimum at the default 21 "
         "spares).", "",
         "| spares | fail | wait | shrink | shrink, 16-node replicas |", "|---|---|---|---|---|"]
    for s in spares:
        L.append(f"| {s} | {_g(rows[s, 'fail'])} | {_g(rows[s, 'wait'])} | {_g(rows[s, 'shrink'])} | "
                 + (f"{_g(layout[s])} |" if s in layout else "— |"))
    if (4, "shrink") in rows:
        f4, w4, s4 = rows[4, "fail"], rows[4, "wait"], rows[4, "shrink"]
        day = f4["stopped_day_mean"]
        L += ["", f"At 4 spares: `fail` stops the job in {100 * f4['stopped_share']:.0f}% of the traces"
              + (f", on day {day:.2f} on average" if day is not None else "")
              + f"; `wait` spends {_pct(w4['breakdown']['wait'])} of the wall time waiting for repaired nodes; "
              f"`shrink` gives up {_pct(s4['breakdown']['shrunk'])} to running on fewer replicas "
              f"(live fraction {s4['capacity_mean']:.4f}, {s4['shrinks_mean']:.0f} shrinks per {res['horizon_days']:g} "
              "days) and "
              f"{_pct(s4['breakdown']['restart'] + s4['breakdown']['load'] + s4['breakdown']['detect'])} to "
              "recoveries."]
    L += ["", "Cost of one event (seconds, from the calibrated parameters): shrink = detect "
          f"{cost['shrink']['detect']:.1f} + survivors' restart {cost['shrink']['restart']:.2f} + reshard from peer "
          f"memory {cost['shrink']['load']:.3f} (+ the iteration in flight); grow = restart "
          f"{cost['grow']['restart']:.2f} + live state to host and reshard {cost['grow']['load']:.3f} (+ the "
          f"iteration in flight). A {cost['shrink']['note']}.", "",
          "## All rows", "", _detail(res["rows"]), "",
          f"## Shrink with {UNIT_CONTEXT} nodes per data-parallel replica", "",
          "A loss idles its whole replica (tensor 8 x pipeline 16); the replica's 15 healthy nodes join the pool "
          "and hot-swap the next losses, so the job shrinks by 16 nodes at a time but less often.", "",
          _detail(res["layout_rows"]), "",
          f"## Whole-job restart policies, {CONTEXT_SPARES} spares", "",
          "Their recovery already restarts every process, so a shrink costs what their restore costs; the grow "
          "back is one more restart. Intervals: "
          + "; ".join(f"{k} " + ", ".join(f"{SHORT[i]} {v}" for i, v in ivs.items())
                      for k, ivs in res["intervals"].items() if k != "deadpool") + ".", "",
          _detail(res["context_rows"]), "",
          "Columns after the stopped share: mean share of wall time per category (docs/simulator.md); `shrunk` is "
          "the step time added by running on fewer replicas, `stopped` the time after `fail` ended the job."]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed x 4 trials x 10 days")
    p.add_argument("--out", default=RESULTS_DIR, help="results directory")
    p.add_argument("--spares", default=None, help=f"comma-separated spare counts (default {SPARES})")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick 0)")
    p.add_argument("--trials", type=int, default=None, help="trials per seed (default 20; --quick 4)")
    p.add_argument("--horizon-days", type=float, default=None, help="days per trial (default 30; --quick 10)")
    p.add_argument("--name", default=None, help="file stem (default simulate_shrink[_quick])")
    args = p.parse_args(argv)
    args.spares = [int(s) for s in args.spares.split(",")] if args.spares else list(SPARES)
    args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    args.trials = args.trials or (4 if args.quick else 20)
    args.horizon_days = args.horizon_days or (10.0 if args.quick else 30.0)
    args.command = ("python benchmarks/bench_simulate_shrink.py "
                    + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))).strip()
    stem = args.name or ("simulate_shrink_quick" if args.quick else "simulate_shrink")
    res = run(args)
    write_json(os.path.join(args.out, f"{stem}.json"), res)
    write_text(os.path.join(args.out, f"{stem}.md"), markdown(res))
    print(f"wrote {stem}.json, {stem}.md in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
