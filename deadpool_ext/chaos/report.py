"""The campaign summary: one row per trial, totals, and the command that reproduces each failing trial."""
from __future__ import annotations

from typing import Any


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``rows``: ``{"scenario": Scenario.to_json(), "verdict": Verdict.to_json(), "elapsed_s": ...}``."""
    ran = [r for r in rows if r["verdict"]["status"] not in ("skipped",)]
    tiers = ("tier1", "tier2", "tier3")
    hits = [h for r in ran for h in r["verdict"]["hits"]]
    return {
        "trials": len(rows),
        "ran": len(ran),
        "skipped": len(rows) - len(ran),
        "faults_injected": sum(r["verdict"]["faults_injected"] for r in ran),
        "not_injected": sum(r["verdict"]["status"] == "not_injected" for r in ran),
        "recovered": sum(r["verdict"]["status"] == "passed" for r in ran),
        "failed": sum(r["verdict"]["status"] == "failed" for r in ran),
        "hot_swaps": sum(r["verdict"]["hot_swaps"] for r in ran),
        "restores": {t: sum(r["verdict"]["restores"].get(t, 0) for r in ran) for t in tiers},
        "refused": {t: sum(r["verdict"]["refused"].get(t, 0) for r in ran) for t in tiers},
        "state_mismatches": sum(bool(r["verdict"]["mismatch"]) for r in ran),
        "in_window_hits": f"{sum(hits)}/{len(hits)}" if hits else "n/a",
        "faults": sorted({r["scenario"]["fault"] for r in ran}),
        "layouts": sorted({r["scenario"]["layout"] for r in ran}),
        "failing": [{"trial": r["scenario"]["trial"], "seed": r["scenario"]["seed"],
                     "reproduce": r["scenario"]["reproduce"], "problems": r["verdict"]["problems"]}
                    for r in rows if r["verdict"]["status"] == "failed"],
    }


def format_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    head = f"{'trial':>5}  {'layout':<8} {'fault':<15} {'status':<12} {'swaps':>5} {'t1/t2/t3 restored':>17} " \
           f"{'t1/t2/t3 refused':>16} {'time':>6}  scenario"
    lines = [head, "-" * len(head)]
    for r in rows:
        sc, v = r["scenario"], r["verdict"]
        rs = "/".join(str(v["restores"].get(t, 0)) for t in ("tier1", "tier2", "tier3"))
        rf = "/".join(str(v["refused"].get(t, 0)) for t in ("tier1", "tier2", "tier3"))
        lines.append(f"{sc['trial']:>5}  {sc['layout']:<8} {sc['fault']:<15} {v['status']:<12} {v['hot_swaps']:>5} "
                     f"{rs:>17} {rf:>16} {r.get('elapsed_s', 0):>5.0f}s  {sc['description']}")
    s = summary
    lines += ["", f"trials {s['trials']} (ran {s['ran']}, skipped {s['skipped']}, fault landed late/never "
                  f"{s['not_injected']}) | faults injected {s['faults_injected']} | recovered {s['recovered']} | "
                  f"failed {s['failed']} | hot swaps {s['hot_swaps']}",
              "restores by tier (ranks): " + ", ".join(f"{t} {n}" for t, n in s["restores"].items())
              + " | copies refused by tier: " + ", ".join(f"{t} {n}" for t, n in s["refused"].items()),
              f"state mismatches: {s['state_mismatches']} (must be 0) | kills inside a copy/transfer window: "
              f"{s['in_window_hits']}"]
    for f in s["failing"]:
        lines.append(f"FAILED trial {f['trial']} (seed {f['seed']}): {'; '.join(f['problems'])[:400]}")
        lines.append(f"  reproduce: {f['reproduce']}")
    return "\n".join(lines)
