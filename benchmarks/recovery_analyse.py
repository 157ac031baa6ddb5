"""bench_recovery, the analysis: from the runs of one model size to medians, speedups, targets and loss checks.

Pure functions of the results JSON (``entry["runs"]``): nothing is run, so ``bench_recovery.py --rerender JSON``
recomputes every number of a saved result. Rendering is in ``recovery_render.py``. Split out of the single-file
``bench_recovery.py`` without changing what it computes.
"""
from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from outside benchmarks/: common.py lives beside this file
    sys.path.insert(0, HERE)
from common import median, ratio, summarize  # noqa: E402

TARGET_E2E_S = {"small": 10.0}
TARGET_SPEEDUP = 5.0
TARGET_RESTORED_S = 1.0
"""Issue 32: kill -> every rank restored on the default path, at most this; and at least TARGET_RESTORED_SPEEDUP times
faster than relaunch + load to restored; kill -> the next completed step at most one normal step + this."""
TARGET_RESTORED_SPEEDUP = 10.0


def losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """step -> loss; a step recomputed after recovery appears twice and the later value wins."""
    out: dict[int, float] = {}
    for r in records:
        out[int(r["step"])] = float(r["loss"])
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    common = sorted(set(a) & set(b))
    diff = [{"step": s, "a": a[s], "b": b[s]} for s in common if a[s] != b[s]]
    return {"steps": common, "identical": bool(common) and not diff, "mismatches": diff,
            "max_abs_diff": max((abs(x["a"] - x["b"]) for x in diff), default=0.0)}


def redo_check(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps logged twice (once before the kill, once recomputed): equal?"""
    seen: dict[int, float] = {}
    twice = []
    for r in records:
        s = int(r["step"])
        if s in seen:
            twice.append({"step": s, "before": seen[s], "after": float(r["loss"]),
                          "equal": seen[s] == float(r["loss"])})
        seen[s] = float(r["loss"])
    return {"steps": twice, "all_equal": all(x["equal"] for x in twice)}


def loss_checks(hs: dict[str, Any] | None, bl: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """Exact loss comparisons of one repeat (``hs`` None: the baseline's own checks only)."""
    bl_l = losses(bl.get("records1", []) + bl.get("records2", []))
    out: dict[str, Any] = {"baseline_redone_steps": redo_check(bl.get("records1", []) + bl.get("records2", []))}
    ref_l = losses(ref["records"]) if ref and ref.get("records") else None
    if ref_l:
        out["baseline_vs_reference"] = compare(bl_l, ref_l)
    if hs is None:
        return out
    hs_l = losses(hs.get("records", []))
    out["hotswap_vs_baseline"] = compare(hs_l, bl_l)
    out["hotswap_redone_steps"] = redo_check(hs.get("records", []))
    out["steps_after_kill_compared"] = [s for s in out["hotswap_vs_baseline"]["steps"]
                                        if s > min(hs.get("last_step_before_kill") or 0,
                                                   bl.get("last_step_before_kill") or 0)]
    if ref_l:
        out["hotswap_vs_reference"] = compare(hs_l, ref_l)
    return out


def analyze_size(size: str, entry: dict[str, Any]) -> dict[str, Any]:
    runs = entry["runs"]
    hs_ok = [r for r in runs["hotswap"] if not r.get("failed")]
    bl_ok = [r for r in runs["baseline"] if not r.get("failed")]
    ref = runs.get("reference")

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        return median([r[key] for r in rs if r.get(key) is not None])

    phase_keys = ("detect_s", "agree_s", "assign_s", "spare_s", "communicators_s", "rebuild_s", "restore_s",
                  "recompute_s", "total_s")
    phases = {p: median([r["phases"][p] for r in hs_ok if r.get("phases") and r["phases"].get(p) is not None])
              for p in phase_keys}
    bkeys = ("detect_s", "relaunch_s", "startup_and_load_s", "first_step_s", "total_s")
    bphases = {p: median([r["breakdown"][p] for r in bl_ok if r["breakdown"].get(p) is not None]) for p in bkeys}
    hs_raw, hs_minus = med(hs_ok, "raw_s"), med(hs_ok, "minus_step_s")
    bl_raw, bl_minus = med(bl_ok, "raw_s"), med(bl_ok, "minus_step_s")
    an: dict[str, Any] = {
        "hotswap": {"n": len(hs_ok), "raw_s": summarize([r["raw_s"] for r in hs_ok]),
                    "minus_step_s": summarize([r["minus_step_s"] for r in hs_ok if r.get("minus_step_s") is not None]),
                    "normal_step_s": med(hs_ok, "normal_step_s"), "phases_median": phases,
                    "restored_version": [r["events"]["restored_version"] for r in hs_ok],
                    "last_step_before_kill": [r["last_step_before_kill"] for r in hs_ok],
                    "first_step_time_after_s": med(hs_ok, "first_step_time_after_s"),
                    "step_time_after_s": median([x for r in hs_ok for x in r.get("step_time_after_s", [])]),
                    "busy_fraction_recovery": med(hs_ok, "busy_fraction_recovery")},
        "baseline": {"n": len(bl_ok), "raw_s": summarize([r["raw_s"] for r in bl_ok]),
                     "minus_step_s": summarize([r["minus_step_s"] for r in bl_ok if r.get("minus_step_s") is not None]),
                     "normal_step_s": med(bl_ok, "normal_step_s"), "phases_median": bphases,
                     "loaded_step": [r.get("loaded_step") for r in bl_ok],
                     "last_step_before_kill": [r["last_step_before_kill"] for r in bl_ok],
                     "first_step_time_after_s": med(bl_ok, "first_step_time_after_s"),
                     "step_time_after_s": median([x for r in bl_ok for x in r.get("step_time_after_s", [])]),
                     "busy_fraction_recovery": med(bl_ok, "busy_fraction_recovery")},
        "speedup_raw": ratio(bl_raw, hs_raw),
        "speedup_minus_step": ratio(bl_minus, hs_minus) if hs_minus and hs_minus > 0 else None,
        "failed_runs": [{"kind": r["kind"], "tag": r["tag"], "why": r["failed"]}
                        for r in runs["hotswap"] + runs["baseline"] + ([ref] if ref else []) if r.get("failed")],
    }
    checks = []
    for bl in runs["baseline"]:
        rep = bl["tag"].split("_")[-1]
        hs = next((h for h in runs["hotswap"] if h["tag"].split("_")[-1] == rep), None)
        checks.append({"repeat": rep, **loss_checks(hs, bl, ref)})
    an["loss_checks"] = checks
    an["losses_identical"] = None if not runs["hotswap"] else bool(checks) and all(
        c["hotswap_vs_baseline"]["identical"] and c["hotswap_redone_steps"]["all_equal"]
        and c.get("hotswap_vs_reference", {"identical": True})["identical"] for c in checks)
    targets: dict[str, Any] = {}
    if size in TARGET_E2E_S:
        t = TARGET_E2E_S[size]
        targets["end_to_end_raw"] = {"target_s": t, "value_s": hs_raw, "met": hs_raw is not None and hs_raw <= t}
        targets["end_to_end_minus_step"] = {"target_s": t, "value_s": hs_minus,
                                            "met": hs_minus is not None and hs_minus <= t}
    targets["speedup_raw"] = {"target": TARGET_SPEEDUP, "value": an["speedup_raw"],
                              "met": an["speedup_raw"] is not None and an["speedup_raw"] >= TARGET_SPEEDUP}
    targets["speedup_minus_step"] = {"target": TARGET_SPEEDUP, "value": an["speedup_minus_step"],
                                     "met": an["speedup_minus_step"] is not None
                                     and an["speedup_minus_step"] >= TARGET_SPEEDUP}
    an["raw_speedup_ceiling"] = raw_speedup_ceiling(an)
    an["ready"] = rd = ready_to_redo(hs_ok, bl_ok)
    targets["restored"] = {"target_s": TARGET_RESTORED_S, "value_s": rd["hotswap_s"],
                           "met": rd["hotswap_s"] is not None and rd["hotswap_s"] <= TARGET_RESTORED_S}
    targets["restored_speedup"] = {"target": TARGET_RESTORED_SPEEDUP, "value": rd["speedup"],
                                   "met": rd["speedup"] is not None and rd["speedup"] >= TARGET_RESTORED_SPEEDUP}
    targets["next_step_minus_step"] = {"target_s": TARGET_RESTORED_S, "value_s": hs_minus,
                                       "met": hs_minus is not None and hs_minus <= TARGET_RESTORED_S}
    an["targets"] = targets
    return an


def ready_to_redo(hs_ok: list[dict[str, Any]], bl_ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Kill -> every rank ready to redo the interrupted step, measured directly (not by subtracting a step, whose
    run-to-run noise is seconds for GPT medium): hot-swap detect + agree + rebuild + restore (the last rank,
    spare included, restored); baseline detect + relaunch + start-up and ``load_checkpoint`` (rank 0 ready)."""
    def total(r: dict[str, Any], src: str, keys: tuple[str, ...]) -> float | None:
        vals = [(r.get(src) or {}).get(k) for k in keys]
        return None if any(v is None for v in vals) else sum(vals)

    hs = [t for t in (total(r, "phases", ("detect_s", "agree_s", "rebuild_s", "restore_s")) for r in hs_ok)
          if t is not None]
    bl = [t for t in (total(r, "breakdown", ("detect_s", "relaunch_s", "startup_and_load_s")) for r in bl_ok)
          if t is not None]
    h, b = median(hs), median(bl)
    return {"hotswap_s": h, "baseline_s": b, "hotswap_each_s": hs, "baseline_each_s": bl, "speedup": ratio(b, h)}


def raw_speedup_ceiling(an: dict[str, Any]) -> dict[str, float | None]:
    """The ceiling of the raw ratio: a recovery that took no time at all still redoes the interrupted step."""
    bl_raw = an["baseline"]["raw_s"]["median"]
    return {"with_first_step_after_recovery": ratio(bl_raw, an["hotswap"]["first_step_time_after_s"]),
            "with_normal_step": ratio(bl_raw, an["hotswap"]["normal_step_s"])}
