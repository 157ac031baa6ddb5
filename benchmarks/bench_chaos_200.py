#!/usr/bin/env python
"""The 200-trial chaos campaign over every fault kind: 150 single-host trials (the catalogue's eleven faults over
DeepSpeed ZeRO-1/2/3 and Megatron TP2, ``deadpool chaos``) and 50 host-level trials on the namespace bed (host
loss, coordinator loss, partition, etcd member and quorum loss, stuck rank, ``deadpool chaos --bed``), seed 200;
then 44 single-host trials of seed 201 under planner 2, which run every fault on every layout that takes it.

The 150 were planned under planner 1 (``--planner 1``), whose layout rotation put each of the eleven faults on one
layout only; the cover trials are what closes that gap (the fault x layout table of the report shows it).

About 3 h of machine time on the 2-core host, so it runs in pieces: every finished trial is appended to the
journal ``benchmarks/results/chaos_200.jsonl`` and a later run continues where the last one stopped (baselines
reused from the journal). Each run re-renders ``chaos_200.md`` / ``.json`` from the whole journal, with how many of
the 200 trials are done.

    python benchmarks/bench_chaos_200.py --budget-min 60     # run trials for up to an hour, then render
    python benchmarks/bench_chaos_200.py --render-only       # render the journal as it is

Needs root for the bed trials (network namespaces); without it only the single-host trials run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from common import machine_info, md_table, write_json, write_text  # noqa: E402

from deadpool_ext.chaos.journal import Journal  # noqa: E402

SEED = 200
HOST_TRIALS = 150
BED_TRIALS = 50
COVER_SEED = 201
COVER_TRIALS = 44
"""11 faults x 4 layouts: under planner 2, every (fault, layout) pair the catalogue allows."""
PLANNED = HOST_TRIALS + BED_TRIALS + COVER_TRIALS
RESULTS = os.path.join(HERE, "results")
JOURNAL = os.path.join(RESULTS, "chaos_200.jsonl")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(budget_s: float, workdir: str, replay_failed: bool = False) -> None:
    from deadpool_ext.chaos.campaign import run_campaign
    from deadpool_ext.chaos.hostfaults import plan_host_trial, run_host_campaign
    from deadpool_ext.chaos.plan import DEFAULT_LAYOUTS, plan_trial
    from deadpool_ext.testing.hosts import missing_requirements

    t0 = time.time()
    why = missing_requirements()
    if why is None:
        bed = [plan_host_trial(SEED, t) for t in range(BED_TRIALS)]
        run_host_campaign(bed, workdir=os.path.join(workdir, "bed"), log=_log, journal=Journal(JOURNAL, "bed", _log),
                          stop_after_s=budget_s, replay_failed=replay_failed)
    else:
        _log(f"[chaos_200] bed trials skipped in this run: {why}")
    host = [plan_trial(SEED, t, DEFAULT_LAYOUTS, planner=1) for t in range(HOST_TRIALS)]
    host += [plan_trial(COVER_SEED, t, DEFAULT_LAYOUTS, planner=2) for t in range(COVER_TRIALS)]
    left = budget_s - (time.time() - t0)
    if left > 0:
        run_campaign(host, workdir=os.path.join(workdir, "host"), log=_log, journal=Journal(JOURNAL, "host", _log),
                     stop_after_s=left, replay_failed=replay_failed)


TIERS = ("tier1", "tier2", "tier3")
LAYOUT_NAMES = ("zero1", "zero2", "zero3", "megatron")


def _tiers(counts: dict[str, int]) -> str:
    return "/".join(str(counts.get(t, 0)) for t in TIERS)


def _hung(row: dict[str, Any]) -> bool:
    return any("hung" in p or "silent hang" in p for p in row["verdict"].get("problems", []))


def _by_fault(rows: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for fault in sorted({r["scenario"]["fault"] for r in rows}):
        rs = [r for r in rows if r["scenario"]["fault"] == fault]
        st = [r["verdict"]["status"] for r in rs]
        out.append([fault, len(rs), st.count("passed"), st.count("not_injected"), st.count("failed"),
                    sum(bool(r["verdict"].get("mismatch")) for r in rs), sum(_hung(r) for r in rs),
                    _tiers({t: sum(r["verdict"]["refused"].get(t, 0) for r in rs) for t in TIERS}),
                    ", ".join(sorted({r["scenario"]["layout"] for r in rs}))])
    return out


def _pairs(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Trials per fault and layout, single host (``-``: the layout cannot take the fault)."""
    from deadpool_ext.chaos.catalogue import FAULTS, LAYOUTS

    count: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["scenario"]["fault"], r["scenario"]["layout"])
        count[key] = count.get(key, 0) + 1
    return [[f.value] + [count.get((f.value, name), 0) if f in lay.faults else "-" for name, lay in LAYOUTS.items()]
            for f in FAULTS]


def render() -> dict[str, Any]:
    from deadpool_ext.chaos.report import format_table, summarize

    parts = {m: Journal(JOURNAL, m, _log) for m in ("host", "bed")}
    rows = {m: j.rows() for m, j in parts.items()}
    every = rows["host"] + rows["bed"]
    total = summarize(every) if every else {}
    hangs = sum(_hung(r) for r in every)
    wall_s = sum(r["elapsed_s"] for r in every) + sum(
        rec["elapsed_s"] for j in parts.values() for rec in j.records if rec["kind"] == "baseline")
    done = len(every)
    status = "complete" if done >= PLANNED else f"IN PROGRESS: {done} of {PLANNED}"
    lines = [
        f"# Chaos campaign, {PLANNED} trials over every fault kind ({status})", "",
        f"Seed {SEED}: trials 0-{HOST_TRIALS - 1} of `deadpool chaos --seed {SEED} --planner 1` (single host, the "
        f"catalogue's eleven faults, ZeRO-1/2/3 + Megatron TP2) and trials 0-{BED_TRIALS - 1} of `deadpool chaos "
        f"--bed --seed {SEED}` (namespace bed: 3 hosts, a 3-member etcd; the six host-level faults); then trials "
        f"0-{COVER_TRIALS - 1} of `deadpool chaos --seed {COVER_SEED}` (planner 2: every fault on every layout that "
        "takes it; planner 1 had put each fault on one layout, see the table by fault and layout). Tiny GPT, gloo, "
        "on the shared 2-core CPU host. Written by `benchmarks/bench_chaos_200.py` from the journal "
        "`chaos_200.jsonl` (one JSON line per finished trial; the campaign runs in pieces across sessions). "
        "Columns: `docs/chaos.md`.", "",
        f"**Trials done {done}** (single host {len(rows['host'])}, bed {len(rows['bed'])}); "
        f"faults injected {total.get('faults_injected', 0)}; recovered {total.get('recovered', 0)}; "
        f"fault landed late/never {total.get('not_injected', 0)}; **failed {total.get('failed', 0)}**; "
        f"**state mismatches {total.get('state_mismatches', 0)}** (must be 0); **silent hangs {hangs}** (must be 0); "
        f"hot swaps {total.get('hot_swaps', 0)}; restores by tier (ranks) "
        f"{_tiers(total.get('restores', {}))}; copies refused (fallbacks to the next tier) "
        f"{_tiers(total.get('refused', {}))}; "
        f"machine time {wall_s / 60:.1f} min (trials and baselines).", "",
        "## By fault", "",
        md_table(["fault", "trials", "recovered", "late/never", "failed", "mismatches", "silent hangs",
                  "refused t1/t2/t3", "layouts"], _by_fault(every)), "",
        "## Single host, by fault and layout", "",
        md_table(["fault", *LAYOUT_NAMES], _pairs(rows["host"])), "",
    ]
    for mode, title in (("host", "Single host"), ("bed", "Namespace bed")):
        if rows[mode]:
            lines += [f"## {title}", "", "```", format_table(rows[mode], summarize(rows[mode])), "```", ""]
    replaced = [r for j in parts.values() for r in j.replaced()]
    if replaced:
        lines += ["## Replayed trials", "", "Rows superseded by a replay of the same trial after a fix (the replay's "
                  "row is the one counted above; both are in the journal):", ""]
        lines += [f"- {r['scenario']['reproduce']}: was {r['verdict']['status']} - {r['verdict'].get('problems')}"
                  for r in replaced]
        lines += [""]
    if total.get("failing"):
        lines += ["## Failing trials (reproduce with the command shown)", ""]
        lines += [f"- trial {f['trial']} (seed {f['seed']}): `{f['reproduce']}`: {f['problems']}"
                  for f in total["failing"]]
    write_text(os.path.join(RESULTS, "chaos_200.md"), "\n".join(lines) + "\n")
    out = {"command": "python benchmarks/bench_chaos_200.py --budget-min M (in pieces, continued from the journal)",
           "status": status, "done": done, "planned": PLANNED, "seed": SEED,
           "cover_seed": COVER_SEED, "summary": total,
           "silent_hangs": hangs, "machine_s": wall_s, "machine": machine_info(), "rows": every,
           "replaced": replaced}
    write_json(os.path.join(RESULTS, "chaos_200.json"), out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-min", type=float, default=60.0, help="stop starting trials after this long (default 60)")
    p.add_argument("--render-only", action="store_true", help="render the journal, run nothing")
    p.add_argument("--replay-failed", action="store_true",
                   help="run again the trials whose latest row failed (after a fix); both rows stay in the journal")
    p.add_argument("--workdir", default=None, help="where the jobs write (default: a temp dir)")
    args = p.parse_args(argv)
    if args.budget_min <= 0:
        p.error("--budget-min must be > 0")
    if not args.render_only:
        run(args.budget_min * 60, args.workdir or tempfile.mkdtemp(prefix="deadpool-chaos200-"), args.replay_failed)
    out = render()
    print(f"chaos_200: {out['status']}; failed {out['summary'].get('failed', 0)}, state mismatches "
          f"{out['summary'].get('state_mismatches', 0)}, silent hangs {out['silent_hangs']}")
    return 1 if out["summary"].get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
