"""The ``deadpool`` command: tools around a running or finished job.

    deadpool timeline TIMELINE.jsonl [--json]     per-phase recovery durations of every hot-swap
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deadpool", description="deadpool_ext tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("timeline", help="recovery phases (detect, agree, rebuild, restore, recompute) per hot-swap")
    t.add_argument("path")
    t.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    if args.cmd == "timeline":
        from .recovery.timeline import format_table, phases, read_events

        rows = phases(read_events(args.path))
        print(json.dumps(rows, indent=1) if args.json else (format_table(rows) if rows else "no hot-swaps recorded"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
