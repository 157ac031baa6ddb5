"""``deadpool simulate``: goodput of fault-tolerance policies on a large cluster, and which to choose.

A discrete-event Monte Carlo model (deadpool_ext/sim, docs/simulator.md): failures at the Llama 3 report's
rate, per-phase costs from this project's current measured benchmarks (the files benchmarks/results/INDEX.md
names; the output says which file and JSON path each cost came from) scaled by the stated bandwidths. \
Compares restart from persistent checkpoints (sync / async), Gemini-style in-memory checkpoints,
DeadPool hot-swap and TierCheck tiers, each at its best intervals found by sweep.

    deadpool simulate --gpus 16384                       # table + recommendation
    deadpool simulate --gpus 4096 --params-b 70 --iteration-s 4 --json
    deadpool simulate --params my_cluster.json --set costs.detect_s=60 --checks
    deadpool simulate --spare-nodes 4 --no-spare-policy shrink --policies deadpool

Precedence: defaults < measured results (unless --no-calibrate) < --params FILE < flags < --set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HELP = "simulate goodput of checkpoint / hot-swap policies on a large cluster and recommend one"

# flag -> parameter; every flag is optional and only overrides when given.
FLAGS = {
    "gpus": ("cluster.gpus", int, "GPUs in the job (default 16384)"),
    "gpus_per_node": ("cluster.gpus_per_node", int, "GPUs per node (default 8)"),
    "spare_nodes": ("cluster.spare_nodes", int, "spare nodes (default: 1%% of the nodes, at least 1)"),
    "no_spare_policy": ("cluster.no_spare_policy", str,
                        "what the job does when it needs a node and no spare is left, as deadpool-run's flag: wait "
                        "(default) for a repaired node; fail: the job stops, only the persistent tier counts; "
                        "shrink: the survivors go on with fewer data-parallel replicas (reshard from memory, "
                        "throughput in proportion) and grow back when a node returns; nodes per replica: "
                        "--set cluster.shrink_unit_nodes=N"),
    "params_b": ("workload.params_b", float, "model parameters in billions (default 405)"),
    "iteration_s": ("workload.iteration_s", float, "seconds per iteration (default 6)"),
    "storage_write_gbs": ("bandwidth.storage_write_gbs", float, "aggregate storage write GB/s (default 2000)"),
    "storage_read_gbs": ("bandwidth.storage_read_gbs", float, "aggregate storage read GB/s (default 2000)"),
    "network_gbs": ("bandwidth.peer_network_gbs", float, "per-node network GB/s for replicas (default 25)"),
    "d2h_gbs": ("bandwidth.d2h_gbs", float, "per-GPU device-to-host GB/s (default 25)"),
    "trials": ("sim.trials", int, "Monte Carlo trials per configuration (default 20)"),
    "horizon_days": ("sim.horizon_days", float, "simulated days per trial (default 30)"),
    "seed": ("sim.seed", int, "seed of the failure traces (default 0)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..sim.params import NO_SPARE_POLICIES

    # The flag takes any string: an unknown value is rejected by the parameter check, with the one message
    # --set and --params give.
    metavars = {"no_spare_policy": "{" + ",".join(NO_SPARE_POLICIES) + "}"}
    for name, (_, typ, help_) in FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_,
                       metavar=metavars.get(name))
    p.add_argument("--params", metavar="JSON", help="parameters file: {section: {key: value}} (see docs/simulator.md)")
    p.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override any parameter, e.g. --set failure.cluster_outage_per_day=0 (repeatable)")
    p.add_argument("--policies", default=None, help="comma-separated subset of: ckpt_sync, ckpt_async, gemini, "
                                                    "deadpool, tiercheck (default: all)")
    p.add_argument("--results-dir", default=None,
                   help="measured results to calibrate from (default: benchmarks/results of this checkout)")
    p.add_argument("--no-calibrate", action="store_true", help="use the built-in defaults, not measured results")
    p.add_argument("--checks", action="store_true", help="also check the model against Young/Daly and the papers")
    p.add_argument("--json", action="store_true", help="print the full result as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--print-params", action="store_true", help="print the effective parameters as JSON and exit")
    p.add_argument("--stragglers", action="store_true",
                   help="instead of the policies: stragglers (kept vs evicted into spares) and preemptions (killed "
                        "vs drained) on this cluster (deadpool_ext/sim/stragglers.py); their own knobs through --set "
                        "stragglers.KEY=V / preemption.KEY=V (rate_per_node_day, slowdown, duration_h, factor, "
                        "detect_s; rate_per_day, persist_interval_min, drain_fixed_s)")


def _default_results_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(os.path.dirname(here)), "benchmarks", "results")


def build_params(args: argparse.Namespace):
    """Effective parameters and the calibration used, in the documented precedence order."""
    from ..sim.calibration import Calibration, calibrate
    from ..sim.params import Params, SimParamError, parse_value

    params = Params()
    cal = Calibration()
    if not args.no_calibrate:
        cal = calibrate(args.results_dir or _default_results_dir())
        params = cal.apply(params)
    if args.params:
        try:
            with open(args.params) as fh:
                params = params.with_nested(json.load(fh))
        except (OSError, ValueError) as exc:
            if isinstance(exc, SimParamError):
                raise
            raise SimParamError(f"--params {args.params}: {exc}") from None
    flat = {key: getattr(args, name) for name, (key, _, _) in FLAGS.items() if getattr(args, name) is not None}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SimParamError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        if key.strip().startswith(EVENT_SECTIONS):
            continue  # the straggler and preemption models' own (event_models)
        flat[key.strip()] = parse_value(value)
    return params.with_overrides(flat), cal


EVENT_SECTIONS = ("stragglers.", "preemption.")


def event_models(args: argparse.Namespace):
    """The straggler and preemption models with the ``--set stragglers.K=V`` / ``preemption.K=V`` overrides."""
    from ..sim.params import SimParamError, parse_value
    from ..sim.stragglers import PreemptionModel, StragglerModel

    over: dict[str, dict] = {"stragglers": {}, "preemption": {}}
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.strip().partition(".")
        if section in over:
            over[section][name] = parse_value(value)
    try:
        return StragglerModel(**over["stragglers"]), PreemptionModel(**over["preemption"])
    except TypeError as exc:
        raise SimParamError(f"--set: {exc}") from None


def run_events(args: argparse.Namespace, params) -> int:
    from ..sim.stragglers import calibrated, simulate

    m, pre = event_models(args)
    source = None
    if not args.no_calibrate and not any(x.strip().startswith("stragglers.detect_s") for x in args.set):
        m, source = calibrated(m, args.results_dir or _default_results_dir())
    r = simulate(params, m, pre, detect_source=source)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    st, pr = r["stragglers"], r["preemption"]
    print(f"{r['gpus']} GPUs, {r['nodes']} nodes, {r['spares']} spares, {params.sim.trials} trials x "
          f"{params.sim.horizon_days:g} days")
    print(f"stragglers: {m.rate_per_node_day:g} per node-day, {m.slowdown:g}x for {m.duration_h:g} h on average; "
          f"evicted after {m.detect_s:.1f} s when >= {m.factor:g}x, each swap {st['swap_s']:.1f} s")
    print(f"  goodput kept {st['goodput_keep']:.4f}, evicted {st['goodput_evict']:.4f}: {st['gained']:+.4f} "
          f"({st['evictions']:.1f} evictions, {st['kept_no_spare']:.1f} kept for want of a spare, per trial)")
    print(f"preemptions: {pre.rate_per_day:g} per day; killed {pr['cost_kill_s']:.0f} s each (half of a "
          f"{pre.persist_interval_min:g} min base interval recomputed), drained {pr['cost_drain_s']:.0f} s each")
    print(f"  goodput killed {pr['goodput_kill']:.4f}, drained {pr['goodput_drain']:.4f}: {pr['gained']:+.4f}")
    print("sources (docs/simulator.md; ASSUMPTION: typed in, not measured):")
    for key, src in r["sources"].items():
        print(f"  {key}: {src}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..sim.params import SimParamError
    from ..sim.policies import POLICY_NAMES
    from ..sim.recommend import recommend
    from ..sim.report import text_report

    try:
        params, cal = build_params(args)
        names = [n.strip() for n in args.policies.split(",")] if args.policies else list(POLICY_NAMES)
        unknown = [n for n in names if n not in POLICY_NAMES]
        if unknown:
            raise SimParamError(f"--policies: unknown {', '.join(unknown)}; allowed: {', '.join(POLICY_NAMES)}")
    except SimParamError as exc:
        print(f"deadpool simulate: {exc}", file=sys.stderr)
        return 2
    if args.print_params:
        print(json.dumps(params.to_dict(), indent=1))
        return 0
    if getattr(args, "stragglers", False):
        try:
            return run_events(args, params)
        except SimParamError as exc:
            print(f"deadpool simulate: {exc}", file=sys.stderr)
            return 2
    t0 = time.monotonic()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

    rep = recommend(params, policies=names, checks=args.checks, calibration=cal, progress=progress)
    rep["wall_s"] = time.monotonic() - t0
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(text_report(rep))
        # Say where every measured cost came from (file and JSON path), so a reader can tell a current result
        # from a stale one; and what could not be read, since the built-in default was used instead.
        if cal.overrides:
            print("\ncalibrated from measured results (defaults < these < --params < flags < --set):")
            print("\n".join(f"  {line}" for line in cal.lines(params)))
        if cal.missing:
            print("\nnot calibrated (built-in default kept):")
            print("\n".join(f"  {line}" for line in cal.missing))
    return 0
