"""``deadpool chaos --trials N [--seed S] [--layouts zero1,zero2,zero3,megatron] [--json]``: random faults over many
trials, each compared with a fault-free run (docs/chaos.md).

    deadpool chaos --trials 12 --seed 1                 # a campaign; prints a table, exit 1 if any trial failed
    deadpool chaos --seed 1 --trial 7 --layouts zero3   # replay trial 7 of that campaign exactly
    deadpool chaos --trials 30 --plan-only              # show the scenarios without running anything
    deadpool chaos --trials 200 --journal c.jsonl --stop-after-min 60   # a long campaign, an hour at a time
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "chaos suite: random faults over many trials, state compared with a fault-free run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=None, help="trials 0..N-1 of the campaign (default 4)")
    p.add_argument("--trial", type=int, action="append", default=None,
                   help="run only this trial index (repeatable): reproduces a failing trial")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    p.add_argument("--layouts", default="zero1,zero2,zero3,megatron",
                   help="comma-separated: zero1, zero2, zero3 (DeepSpeed), megatron (TP2)")
    p.add_argument("--faults", default=None, help="comma-separated subset of the catalogue (default: all)")
    p.add_argument("--planner", type=int, default=None, metavar="N",
                   help="layout-rotation rule of a single-host campaign: 2 (default) runs every fault on every "
                        "layout within 11 x layouts trials; 1 replays trials recorded under the old rule")
    p.add_argument("--workdir", default=None, help="where jobs write logs, metrics and timelines (default: a temp dir)")
    p.add_argument("--job-timeout-s", type=float, default=480.0, help="deadline of each job")
    p.add_argument("--plan-only", action="store_true", help="print the planned scenarios and exit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--journal", default=None, metavar="FILE",
                   help="append each finished trial to FILE (JSON lines) and skip the trials it already holds, "
                        "baselines included: a long campaign runs in pieces; the report covers every trial in FILE")
    p.add_argument("--stop-after-min", type=float, default=None, metavar="M",
                   help="start no new trial after M minutes (with --journal, the next run continues)")
    p.add_argument("--replay-failed", action="store_true",
                   help="with --journal: run again the trials whose latest row failed (after a fix); the new row "
                        "supersedes the old in the report, the old stays in the file")
    p.add_argument("--bed", action="store_true",
                   help="host-level faults on the namespace bed (3 hosts, a 3-member etcd; needs root): host_loss, "
                        "coordinator_loss, partition, etcd_member, etcd_quorum, stuck (docs/chaos.md)")


def _indices(args: argparse.Namespace, default: int) -> list[int]:
    if args.trial is not None and args.trials is not None:
        raise ValueError("give --trials N or --trial T, not both")
    indices = args.trial if args.trial is not None else list(range(default if args.trials is None else args.trials))
    if not indices:
        raise ValueError("--trials must be >= 1")
    return list(indices)


def _faults(args: argparse.Namespace, kind: Any) -> list[Any] | None:
    return None if args.faults is None else [kind(s.strip()) for s in args.faults.split(",") if s.strip()]


def _print_plan(args: argparse.Namespace, scenarios: list[Any], width: int) -> int:
    print(json.dumps([s.to_json() for s in scenarios], indent=1) if args.json else
          "\n".join(f"{s.trial:>4} {s.layout:<8} {s.fault.value:<{width}} {s.describe()}" for s in scenarios))
    return 0


def _print_report(args: argparse.Namespace, report: dict[str, Any]) -> int:
    from ..chaos.report import format_table

    print(json.dumps(report, indent=1) if args.json else format_table(report["rows"], report["summary"]))
    return 1 if report["summary"]["failed"] else 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _pieces(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """``journal`` and ``stop_after_s`` of the campaign functions, from --journal / --stop-after-min."""
    from ..chaos.journal import Journal

    if args.stop_after_min is not None and args.stop_after_min <= 0:
        raise ValueError(f"--stop-after-min must be > 0, got {args.stop_after_min}")
    if args.replay_failed and not args.journal:
        raise ValueError("--replay-failed needs --journal (the failed rows it replays are read from it)")
    return {"journal": Journal(args.journal, mode, _log) if args.journal else None,
            "stop_after_s": None if args.stop_after_min is None else 60.0 * args.stop_after_min,
            "replay_failed": args.replay_failed}


def _run_bed(args: argparse.Namespace) -> int:
    import tempfile

    from ..chaos.hostfaults import HostFault, plan_host_trial, run_host_campaign
    from ..testing.hosts import missing_requirements

    try:
        if args.planner is not None:
            raise ValueError("--planner applies to single-host campaigns; the bed's planner has one rule")
        layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
        faults = _faults(args, HostFault)
        scenarios = [plan_host_trial(args.seed, t, layouts, faults) for t in _indices(args, 6)]
        pieces = _pieces(args, "bed")
    except ValueError as exc:
        print(f"deadpool chaos --bed: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        return _print_plan(args, scenarios, 16)
    why = missing_requirements()
    if why is not None:
        print(f"deadpool chaos --bed: {why}", file=sys.stderr)
        return 2
    return _print_report(args, run_host_campaign(
        scenarios, workdir=args.workdir or tempfile.mkdtemp(prefix="deadpool-chaos-bed-"),
        job_timeout_s=args.job_timeout_s, log=_log, **pieces))


def run(args: argparse.Namespace) -> int:
    if args.bed:
        return _run_bed(args)
    from ..chaos.catalogue import Fault
    from ..chaos.plan import DEFAULT_PLANNER, check_layouts, plan_trial

    try:
        layouts = check_layouts([s.strip() for s in args.layouts.split(",") if s.strip()])
        faults = _faults(args, Fault)
        planner = DEFAULT_PLANNER if args.planner is None else args.planner
        scenarios = [plan_trial(args.seed, t, layouts, faults, planner) for t in _indices(args, 4)]
        pieces = _pieces(args, "host")
    except ValueError as exc:
        print(f"deadpool chaos: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        return _print_plan(args, scenarios, 15)
    from ..chaos.campaign import run_campaign

    return _print_report(args, run_campaign(scenarios, workdir=args.workdir, job_timeout_s=args.job_timeout_s,
                                            log=_log, **pieces))
