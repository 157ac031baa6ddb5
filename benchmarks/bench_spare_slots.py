#!/usr/bin/env python
"""A spare's snapshot slots made while it waits against made at its restore (``deadpool-run --spare-slots``).

The hot-swap job of ``bench_recovery.py`` (GPT small, ZeRO-3, 3 nodes of 1 process + 1 spare, ``node1.0`` SIGKILLed
in the middle of step K+1), run in interleaved pairs with ``--spare-slots prepare`` (the default) and
``--spare-slots at-restore``, the order alternating per pair. Per run, from the job's timeline (seconds after the
kill): the spare's restore call (``recover`` event ``restore_s``: scan, agree, fetch the replica, slots, copy in),
the spare restored, every rank restored, and SIGKILL to the next completed step (``raw_s``). Reported: medians,
min-max, and the per-pair differences (prepare minus at-restore) with their median.

    python benchmarks/bench_spare_slots.py --pairs 3            # GPT small, ~10 min on 2 cores

Writes ``benchmarks/results/spare_slots.json`` and ``.md`` (``--name`` to choose) and the jobs' logs under
``benchmarks/results/spare_slots_logs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, machine_info, write_text  # noqa: E402
from recovery_run import DEFAULTS, run_hotswap  # noqa: E402

MODES = ("prepare", "at-restore")
FIELDS = {"spare_restore_call_s": "spare's restore call", "spare_restored": "spare restored (after kill)",
          "survivor_restored_last": "last survivor restored (after kill)", "raw_s": "SIGKILL -> next step"}


def _measure(res: dict[str, Any]) -> dict[str, Any]:
    ev = res.get("events") or {}
    out = {k: ev.get(k) for k in ("spare_restore_call_s", "spare_restored", "survivor_restored_last")}
    out["raw_s"] = res.get("raw_s")
    out["failed"] = res.get("failed")
    out["log"] = res.get("log")
    return out


def _stats(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def render(doc: dict[str, Any]) -> str:
    lines = [f"# Spare slots: made while waiting vs at the restore ({doc['size']}, {len(doc['pairs'])} pairs)", "",
             f"Command: `{doc['command']}`  ",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in doc["machine"].items()), "",
             "Seconds; median [min, max] over runs; diff = prepare - at-restore per pair (negative: prepare faster).",
             "", "| measure | prepare | at-restore | per-pair diff (median [min, max]) |", "|---|---|---|---|"]
    for key, label in FIELDS.items():
        cells = []
        for mode in MODES:
            st = doc["summary"][mode].get(key)
            cells.append(f"{st['median']:.3f} [{st['min']:.3f}, {st['max']:.3f}]" if st else "n/a")
        d = doc["summary"]["diff"].get(key)
        cells.append(f"{d['median']:+.3f} [{d['min']:+.3f}, {d['max']:+.3f}]" if d else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Runs:", ""]
    for i, pair in enumerate(doc["pairs"]):
        for mode in MODES:
            r = pair[mode]
            lines.append(f"- pair {i} {mode}: " + ", ".join(f"{k} {r[k]:.3f}" for k in FIELDS if r.get(k) is not None)
                         + (f" FAILED: {r['failed']}" if r.get("failed") else ""))
    lines += ["", doc["note"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=sorted(DEFAULTS))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--name", default="spare_slots")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--kill-delay-frac", type=float, default=0.5)
    p.add_argument("--recovery-timeout-s", type=float, default=120.0)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--settle-busy", type=float, default=0.35)
    p.add_argument("--min-available-gib", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    logs = os.path.join(args.out, f"{args.name}_logs")
    os.makedirs(logs, exist_ok=True)
    doc: dict[str, Any] = {"benchmark": "spare_slots", "size": args.size, "machine": machine_info(),
                           "command": shlex.join(["python", "benchmarks/bench_spare_slots.py", *sys.argv[1:]]),
                           "pairs": [], "summary": {},
                           "note": "The spare's slots are two of the largest rank's slot size (the spare does not "
                                   "know its rank while it waits); at the restore they are renamed and opened at the "
                                   "exact size (snapshot/spare_slots.py)."}
    scratch = tempfile.mkdtemp(prefix="bench_spare_slots.")
    t0 = time.time()
    for i in range(args.pairs):
        pair: dict[str, Any] = {}
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            d = {**DEFAULTS[args.size], "launcher_flags": ["--spare-slots", mode]}
            res = run_hotswap(args.size, d, scratch, f"{mode}_p{i}", args, logs)
            pair[mode] = _measure(res)
            print(f"[bench] pair {i} {mode}: {json.dumps({k: pair[mode][k] for k in FIELDS})}"
                  + (f" FAILED {pair[mode]['failed']}" if pair[mode]["failed"] else ""), flush=True)
        doc["pairs"].append(pair)
    ok = [pr for pr in doc["pairs"] if not any(pr[m]["failed"] for m in MODES)]
    doc["summary"] = {m: {k: _stats([pr[m][k] for pr in ok]) for k in FIELDS} for m in MODES}
    doc["summary"]["diff"] = {k: _stats([pr["prepare"][k] - pr["at-restore"][k] for pr in ok
                                         if pr["prepare"][k] is not None and pr["at-restore"][k] is not None])
                              for k in FIELDS}
    doc["wall_s"] = time.time() - t0
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    write_text(os.path.join(args.out, f"{args.name}.md"), render(doc))
    print(render(doc), flush=True)
    return 0 if len(ok) == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
