"""bench_recovery, every node: the same job killed on each active node in turn (issue 44), analysed and rendered.

A spare builds its engine ahead for the node it shadows (node1); before issue 44 a failure of any other node took
the slow path (the spare started its script again), so the published figure held for one node in three. Here the
headline is the **worst node** (its median), with the expected value under uniformly drawn failures (the mean of
the per-node medians) and the best node beside it, each against relaunch + load measured in the same run.

Pure functions of the results document: ``entry["runs"]["hotswap"]`` holds the node1 runs (the shadowed node, as
before), ``entry["runs"]["per_node"][node]`` the others. Nothing is run here.
"""
from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import fmt_s, md_table, ratio, summarize  # noqa: E402
from recovery_analyse import TARGET_RESTORED_S, TARGET_RESTORED_SPEEDUP, compare, losses, ready_to_redo, redo_check  # noqa: E402,E501


def node_runs(entry: dict[str, Any], shadowed: str) -> dict[str, list[dict[str, Any]]]:
    """Killed node -> its runs (the ``hotswap`` runs are the shadowed node's)."""
    out = {shadowed: list(entry["runs"].get("hotswap") or [])} if entry["runs"].get("hotswap") else {}
    for node, rs in (entry["runs"].get("per_node") or {}).items():
        out[node] = list(rs)
    return dict(sorted(out.items()))


def takeover_of(run: dict[str, Any]) -> str:
    """How the spare took the killed node's ranks: ``as_built``, ``relabel`` or ``start_again``."""
    spare = [e for e in run.get("timeline") or [] if e.get("event") == "recover" and e.get("role") == "spare"]
    if not spare:
        return "unknown"
    e = spare[0]
    return "relabel" if e.get("relabelled_from") is not None else "as_built" if e.get("built_ahead") else "start_again"


def spare_restore_parts(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The medians over ``runs`` of where the spare's restore went (its ``recover`` event's ``restore_parts``: plan,
    obtain (the fetch from a peer and its check), apply); None where no run recorded them (results before them)."""
    parts: dict[str, list[float]] = {"plan_s": [], "obtain_s": [], "apply_s": []}
    for run in runs:
        for e in run.get("timeline") or []:
            if e.get("event") == "recover" and e.get("role") == "spare" and e.get("restore_parts"):
                for k, v in parts.items():
                    if isinstance(e["restore_parts"].get(k), (int, float)):
                        v.append(float(e["restore_parts"][k]))
    return {k: summarize(v)["median"] if v else None for k, v in parts.items()}


def _losses_ok(run: dict[str, Any], baselines: dict[str, dict[str, Any]], ref: dict[str, Any] | None) -> bool | None:
    bl = baselines.get(run["tag"].split("_")[-1])
    if bl is None:
        return None
    same = compare(losses(run.get("records", [])), losses(bl.get("records1", []) + bl.get("records2", [])))
    ok = same["identical"] and redo_check(run.get("records", []))["all_equal"]
    if ref and ref.get("records"):
        ok = ok and compare(losses(run.get("records", [])), losses(ref["records"]))["identical"]
    return ok


def analyze_nodes(entry: dict[str, Any], shadowed: str) -> dict[str, Any] | None:
    """Per node: kill -> every rank restored (min/median/max), kill -> next step minus one normal step, how the spare
    took over, losses identical; the worst, expected and best node against relaunch + load; the issue's targets."""
    per = node_runs(entry, shadowed)
    if len(per) < 2:
        return None
    bl_ok = [r for r in entry["runs"]["baseline"] if not r.get("failed")]
    baselines = {r["tag"].split("_")[-1]: r for r in bl_ok}
    base = ready_to_redo([], bl_ok)["baseline_s"]
    rows: dict[str, Any] = {}
    for node, rs in per.items():
        ok = [r for r in rs if not r.get("failed")]
        restored = ready_to_redo(ok, [])["hotswap_each_s"]
        checks = [_losses_ok(r, baselines, entry["runs"].get("reference")) for r in ok]
        rows[node] = {"runs": len(rs), "failed": [r["failed"] for r in rs if r.get("failed")],
                      "restored_s": summarize(restored), "restored_each_s": restored,
                      "next_step_minus_step_s": summarize([r["minus_step_s"] for r in ok
                                                           if r.get("minus_step_s") is not None]),
                      "raw_s": summarize([r["raw_s"] for r in ok if r.get("raw_s") is not None]),
                      "takeover": [takeover_of(r) for r in ok], "spare_restore": spare_restore_parts(ok),
                      "losses_identical": bool(checks) and all(c is True for c in checks)}
    measured = {n: r for n, r in rows.items() if r["restored_s"]["median"] is not None}
    if not measured:
        return {"nodes": rows, "baseline_restored_s": base}
    worst = max(measured, key=lambda n: measured[n]["restored_s"]["median"])
    best = min(measured, key=lambda n: measured[n]["restored_s"]["median"])
    expected = sum(r["restored_s"]["median"] for r in measured.values()) / len(measured)
    w = measured[worst]["restored_s"]["median"]
    solo = [r for r in entry["runs"].get("solo") or [] if not r.get("failed") and r.get("startup_s") is not None]
    floor = summarize([r["startup_s"] for r in solo])
    worst_next = max((r["next_step_minus_step_s"]["median"] for r in measured.values()
                      if r["next_step_minus_step_s"]["median"] is not None), default=None)
    return {
        "nodes": rows, "baseline_restored_s": base, "worst": worst, "best": best,
        "worst_s": w, "expected_s": expected, "best_s": measured[best]["restored_s"]["median"],
        "speedup_worst": ratio(base, w), "speedup_expected": ratio(base, expected),
        "speedup_best": ratio(base, measured[best]["restored_s"]["median"]),
        "floor_s": floor, "floor_failed": [r["failed"] for r in entry["runs"].get("solo") or [] if r.get("failed")],
        "speedup_worst_floor": ratio(floor["median"], w) if floor["median"] is not None else None,
        "targets": {
            "restored_every_node": {"target_s": TARGET_RESTORED_S, "value_s": w, "met": w <= TARGET_RESTORED_S},
            "speedup_every_node": {"target": TARGET_RESTORED_SPEEDUP, "value": ratio(base, w),
                                   "met": (ratio(base, w) or 0) >= TARGET_RESTORED_SPEEDUP},
            "next_step_minus_step_every_node": {"target_s": TARGET_RESTORED_S, "value_s": worst_next,
                                                "met": worst_next is not None and worst_next <= TARGET_RESTORED_S},
            "losses_identical_every_run": {"met": all(r["losses_identical"] for r in rows.values())},
        },
    }


def render_nodes(an: dict[str, Any] | None) -> list[str]:
    """The per-node section of one size (empty without per-node runs)."""
    if not an or "worst" not in an:
        return []
    x = lambda v: f"{v:.1f}x" if v else "n/a"  # noqa: E731
    L = [f"**Every node killed in turn** (issue 44): kill -> every rank restored, worst node **{an['worst']} "
         f"{fmt_s(an['worst_s'])}** ({x(an['speedup_worst'])} relaunch + load's {fmt_s(an['baseline_restored_s'])}, "
         f"same run); expected under a uniformly drawn failure {fmt_s(an['expected_s'])} "
         f"({x(an['speedup_expected'])}); best node {an['best']} {fmt_s(an['best_s'])} ({x(an['speedup_best'])}).", ""]
    floor = an.get("floor_s") or {}
    if floor.get("median") is not None:  # results from before the floor was measured have none
        L += [f"Against the relaunch's floor, one rank's start-up alone on the host (launch -> its engine built and "
              f"training about to start, loading nothing: median {fmt_s(floor['median'])}, {fmt_s(floor['min'])}-"
              f"{fmt_s(floor['max'])} over {floor['n']} runs; no relaunch of any rank can "
              f"be faster), the worst node is **{x(an['speedup_worst_floor'])}**.", ""]
    rows = []
    for node, r in an["nodes"].items():
        s, n = r["restored_s"], r["next_step_minus_step_s"]
        rows.append([node, f"{r['runs']}" + (f" ({len(r['failed'])} failed)" if r["failed"] else ""),
                     fmt_s(s["min"]), fmt_s(s["median"]), fmt_s(s["max"]), fmt_s(n["median"]), fmt_s(n["max"]),
                     ", ".join(sorted(set(r["takeover"]))), _parts(r.get("spare_restore") or {}),
                     "yes" if r["losses_identical"] else "NO"])
    L.append(md_table(["killed node", "runs", "restored min", "median", "max", "next step - one step, median",
                       "max", "spare took over by", "spare's restore: plan / obtain / apply", "losses identical"],
                      rows))
    L.append("")
    L.append("Targets (every node): " + "; ".join(
        f"{k} {'met' if t['met'] else 'NOT met'}" + (f" ({fmt_s(t['value_s'])})" if "value_s" in t else
                                                       f" ({x(t['value'])})" if "value" in t else "")
        for k, t in an["targets"].items()) + ".")
    L.append("")
    return L


def _parts(p: dict[str, float | None]) -> str:
    if not any(v is not None for v in p.values()):
        return "-"
    return " / ".join(fmt_s(p.get(k)) for k in ("plan_s", "obtain_s", "apply_s"))
