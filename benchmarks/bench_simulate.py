#!/usr/bin/env python
"""Large-cluster simulation: goodput of every policy from 512 to 16,384 GPUs, plots and tables.

Runs ``deadpool_ext.sim`` (the model behind ``deadpool simulate``, docs/simulator.md) for each cluster size in two
scenarios - costs calibrated from this project's measured results (benchmarks/results/*.json), and the same with
zero in-memory snapshot overhead (what DeadPool reports on GPUs) - plus the self-checks at 16,384 GPUs.

    python benchmarks/bench_simulate.py --quick            # 3 sizes, 4 trials x 10 days (~20 s)
    python benchmarks/bench_simulate.py                    # 6 sizes, 20 trials x 30 days (~3 min on 2 cores)

Writes ``simulate.json``, ``simulate.md``, ``simulate_goodput.png``, ``simulate_breakdown.png`` and
``simulate_young_daly.png`` into ``--out`` (default benchmarks/results; ``simulate_quick*`` with --quick).
Pure Python; matplotlib only for the plots (skipped with a note when it is missing).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, RESULTS_DIR, machine_info, write_json, write_text  # noqa: E402

sys.path.insert(0, REPO)
from deadpool_ext.sim.calibration import calibrate  # noqa: E402
from deadpool_ext.sim.params import Params  # noqa: E402
from deadpool_ext.sim.policies import POLICY_NAMES  # noqa: E402
from deadpool_ext.sim.recommend import recommend  # noqa: E402
from deadpool_ext.sim.report import header_lines, markdown_checks, markdown_table, recommendation_line  # noqa: E402

SIZES = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SIZES = (512, 4096, 16384)
SCENARIOS = {
    "calibrated": ({}, "fixed costs and snapshot interference measured by this project (2-core CPU host)"),
    "zero_snapshot_overhead": ({"costs.snapshot_overhead_ratio": 1.0},
                               "as calibrated, but in-memory snapshots cost no step time (DeadPool's GPU result)"),
}
COLORS = {"ckpt_sync": "tab:red", "ckpt_async": "tab:orange", "gemini": "tab:blue", "deadpool": "tab:green",
          "tiercheck": "tab:purple"}
LOST = ("overhead", "rework", "detect", "restart", "load", "replay", "wait")


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cal = calibrate(RESULTS_DIR)
    base = cal.apply(Params()).with_overrides({"sim.trials": args.trials, "sim.horizon_days": args.horizon_days,
                                               "sim.seed": args.seed})
    out: dict[str, Any] = {"benchmark": "simulate", "command": args.command, "machine": machine_info(()),
                           "calibration": cal.to_dict(), "base_params": base.to_dict(), "scenarios": {}}
    t0 = time.monotonic()
    for scen, (overrides, what) in SCENARIOS.items():
        rows: dict[str, Any] = {}
        for gpus in args.sizes:
            print(f"[{time.monotonic() - t0:6.1f} s] {scen}: {gpus} GPUs", file=sys.stderr, flush=True)
            p = base.with_overrides({**overrides, "cluster.gpus": gpus})
            checks = scen == "calibrated" and gpus == max(args.sizes)
            rep = recommend(p, checks=checks, calibration=cal, progress=_progress if args.verbose else None)
            rep.pop("tried")  # every grid point of every policy: large, and the best ones are kept
            rows[str(gpus)] = rep
        out["scenarios"][scen] = {"description": what, "overrides": overrides, "sizes": rows}
    out["wall_s"] = time.monotonic() - t0
    return out


# -- plots ----------------------------------------------------------------------------------------------
def _footer(fig, res: dict[str, Any], extra: str = "") -> None:
    p = res["base_params"]
    fig.text(0.01, 0.01, f"simulated (deadpool_ext.sim, seed {p['sim']['seed']}, {p['sim']['trials']} trials x "
             f"{p['sim']['horizon_days']:g} days); model {p['workload']['params_b']:g}B, iteration "
             f"{p['workload']['iteration_s']:g} s, {p['cluster']['gpus_per_node']} GPUs/node{extra}\n"
             f"machine: {res['machine'].get('cpu_model')} ({res['machine'].get('cpu_count')} cores); "
             f"command: {res['command']}", fontsize=6.5, va="bottom")


def plot(res: dict[str, Any], out_dir: str, stem: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    scen = list(res["scenarios"])
    fig, axes = plt.subplots(1, len(scen), figsize=(6.2 * len(scen), 4.6), sharey=True)
    axes = axes if len(scen) > 1 else [axes]
    for ax, name in zip(axes, scen):
        sizes = res["scenarios"][name]["sizes"]
        xs = [int(g) for g in sizes]
        for pol in POLICY_NAMES:
            ys = [sizes[str(g)]["policies"][pol]["goodput_mean"] for g in xs]
            es = [sizes[str(g)]["policies"][pol]["goodput_std"] for g in xs]
            ax.errorbar(xs, ys, yerr=es, marker="o", ms=4, capsize=3, label=pol, color=COLORS[pol])
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("GPUs")
        ax.set_title(name.replace("_", " "), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (useful time / wall time), best intervals")
    axes[0].legend(fontsize=8)
    fig.suptitle("Goodput vs cluster size per policy (error bars: sd over trials)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    _footer(fig, res)
    path = os.path.join(out_dir, f"{stem}_goodput.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    files.append(path)

    # Lost time breakdown at the largest size, calibrated scenario.
    sizes = res["scenarios"][scen[0]]["sizes"]
    big = str(max(int(g) for g in sizes))
    pols = sizes[big]["policies"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    left = [0.0] * len(POLICY_NAMES)
    cmap = plt.get_cmap("tab10")
    for i, cat in enumerate(LOST):
        vals = [100 * pols[p]["breakdown"][cat] for p in POLICY_NAMES]
        ax.barh(POLICY_NAMES, vals, left=left, label=cat, color=cmap(i))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("% of wall time lost")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=4)
    ax.set_title(f"Where the time goes at {int(big):,} GPUs ({scen[0]}, best intervals)", fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    _footer(fig, res)
    path = os.path.join(out_dir, f"{stem}_breakdown.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    files.append(path)

    sweep = sizes[big].get("young_daly_sweep")
    if sweep:
        a = sizes[big]["analytic"]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = [r["persist_interval"] for r in sweep]
        ax.errorbar(xs, [r["goodput_mean"] for r in sweep], yerr=[r["goodput_std"] for r in sweep], marker="o",
                    ms=4, capsize=3, color=COLORS["ckpt_sync"], label="simulated (ckpt_sync)")
        ax.axvline(a["young_interval_iterations"], ls="--", color="gray", label="Young")
        ax.axvline(a["daly_interval_iterations"], ls=":", color="black", label="Daly")
        ax.set_xlabel("persistent checkpoint interval (iterations)")
        ax.set_ylabel("goodput")
        ax.set_title(f"Young/Daly vs simulated optimum, {int(big):,} GPUs", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout(rect=(0, 0.09, 1, 1))
        _footer(fig, res)
        path = os.path.join(out_dir, f"{stem}_young_daly.png")
        fig.savefig(path, dpi=130)
        plt.close(fig)
        files.append(path)
    return files


# -- markdown -------------------------------------------------------------------------------------------
FLOORS_MODEL = "a 24M-parameter GPT (GPT small) on 2 CPU cores"
"""Where the measured fixed costs (hot-swap, restore, start-up) come from: floors for a real job, whose state and
process start-up are larger."""


def floors_text(res: dict[str, Any]) -> str:
    """One paragraph: which inputs are floors measured on a small CPU model, and which are typed in, with the
    values this run used (the largest size of the first scenario: the one the headline quotes)."""
    scen = next(iter(res["scenarios"].values()))
    rep = scen["sizes"][max(scen["sizes"], key=int)]
    k, d = rep["params"]["costs"], rep["derived"]
    measured = [key for key in ("hotswap_fixed_s", "hotswap_unready_s", "restore_fixed_s", "startup_s")
                if f"costs.{key}" in res["calibration"]["overrides"]]
    return (f"Floors and typed-in inputs: the measured fixed costs ({', '.join(f'`costs.{m}`' for m in measured)}) "
            f"come from {FLOORS_MODEL}, so they are floors, not a large job's costs. Typed in, not measured: "
            f"`costs.scheduler_s` = {k['scheduler_s']:g} s (a relaunched job's allocation and start; of the "
            f"{d['restart_s']:.0f} s a relaunch is charged, {k['scheduler_s']:g} s are this input, and most of "
            f"what a hot-swap gains over a relaunch rests on it) and `costs.detect_s` = {k['detect_s']:g} s; "
            "change them with `deadpool simulate --set costs.scheduler_s=...`.")


def markdown(res: dict[str, Any], pngs: list[str]) -> str:
    lines = ["# Large-cluster simulation", "",
             f"Command: `{res['command']}` ({res['wall_s']:.0f} s). Simulated, not measured: the model, its "
             "parameters and their sources are in `docs/simulator.md`. Costs calibrated from:", ""]
    lines += [f"- `{k}` = {res['calibration']['overrides'][k]:.4g} ({v})" for k, v in
              res["calibration"]["sources"].items()] or ["- nothing (no results found; built-in defaults)"]
    lines += ["", floors_text(res)]
    for name, scen in res["scenarios"].items():
        lines += ["", f"## Scenario `{name}`: {scen['description']}", ""]
        lines += ["| GPUs | recommended | intervals | goodput | " + " | ".join(POLICY_NAMES) + " |",
                  "|---|---|---|---|" + "---|" * len(POLICY_NAMES)]
        for gpus, rep in scen["sizes"].items():
            r = rep["recommended"]
            cells = [f"{rep['policies'][p]['goodput_mean']:.4f}" for p in POLICY_NAMES]
            lines.append(f"| {int(gpus):,} | {r['policy']} | "
                         f"{', '.join(f'{k}={v}' for k, v in r['intervals'].items())} | {r['goodput_mean']:.4f} | "
                         + " | ".join(cells) + " |")
        big = max(scen["sizes"], key=int)
        rep = scen["sizes"][big]
        lines += ["", f"### {int(big):,} GPUs in detail", "", "```", *header_lines(rep), "```", "",
                  markdown_table(rep), "", recommendation_line(rep)]
        if rep.get("checks"):
            lines += ["", "### Checks: the model against analytic results and published figures", "",
                      markdown_checks(rep["checks"])]
    if pngs:
        lines += ["", "## Figures", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    lines += ["", "Reading it: goodput = useful training time / wall time over the horizon, mean over trials at "
              "each policy's best intervals (found by sweep); `sd` is across trials (same failure traces for every "
              "policy). Costs that are not measured are assumptions stated in `docs/simulator.md`; change them with "
              "`deadpool simulate --set section.key=value`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 sizes, 4 trials x 10 days")
    p.add_argument("--out", default=RESULTS_DIR, help="results directory")
    p.add_argument("--sizes", default=None, help="comma-separated GPU counts")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--horizon-days", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="file stem (default simulate[_quick])")
    p.add_argument("--verbose", action="store_true", help="print every grid point")
    p.add_argument("--render-only", metavar="JSON", help="rewrite the markdown beside a results file, run nothing")
    args = p.parse_args(argv)
    if args.render_only:
        with open(args.render_only) as fh:
            saved = json.load(fh)
        stem = os.path.splitext(args.render_only)[0]
        pngs = [f"{stem}_{s_}.png" for s_ in ("goodput", "breakdown", "young_daly")
                if os.path.exists(f"{stem}_{s_}.png")]
        write_text(f"{stem}.md", markdown(saved, pngs))
        print(f"rewrote {stem}.md")
        return 0
    args.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    args.trials = args.trials or (4 if args.quick else 20)
    args.horizon_days = args.horizon_days or (10.0 if args.quick else 30.0)
    args.command = ("python benchmarks/bench_simulate.py "
                    + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))).strip()
    stem = args.name or ("simulate_quick" if args.quick else "simulate")
    os.makedirs(args.out, exist_ok=True)
    res = run(args)
    pngs = plot(res, args.out, stem)
    write_json(os.path.join(args.out, f"{stem}.json"), res)
    write_text(os.path.join(args.out, f"{stem}.md"), markdown(res, pngs))
    print(f"wrote {stem}.json, {stem}.md" + "".join(f", {os.path.basename(f)}" for f in pngs) + f" in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
