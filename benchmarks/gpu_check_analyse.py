"""gpu_check, the analysis: what the device workers recorded -> figures. Pure: no torch, no CUDA (unit-tested on
CPU by tests/unit/test_gpu_check_analyse.py).

The window rule is the one of ``overhead_analyse.py`` (issue "honest numbers"): each round runs a window of
consecutive steps per mode, each step with its snapshot; the window ends when the last snapshot in it is committed
(``wait_idle``), so no snapshot work is left outside it; a mode's figure is its window over the window without
snapshots (``none``) of the same round, the median over rounds with a percentile-bootstrap 90% CI over the rounds.
On the GPU the window is timed by CUDA events on the compute stream: one recorded before the first step, one after
the last snapshot's commit; the host never synchronizes the device inside the window.
"""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bootstrap_median_ci, median, ratio, summarize  # noqa: E402
from overhead_analyse import _paired  # noqa: E402  - the per-round pairing of the CPU overhead benchmark

SCHEMA_VERSION = 2
PARTS = ("a", "b", "c", "d", "e")
PART_TITLES = {
    "a": "step ratio counted whole and blocking per snapshot (>= 1.3B GPT, bf16, ZeRO-1, one GPU)",
    "b": "snapshot D2H bandwidth against the pinned-copy peak measured in the same run",
    "c": "restart restored from tier 1 onto the GPU: tensor checksums and the next 10 losses",
    "d": "differentials with torch's CUDA fused Adam: bit-exact replay, fused vs stepwise replay time",
    "e": "tier-3 capture blocking from device memory",
}
GOALS = {"ratio": 1.005, "bandwidth_fraction": 0.80}
MIN_ROUNDS, MIN_STEPS = 10, 8
"""The project's measuring rule (bench_snapshot_overhead's RULE_MIN_ROUNDS / RULE_MIN_STEPS): fewer measured rounds
or steps per window give figures, never a verdict on a goal."""
SNAPSHOT_MODES = ("deadpool_t1", "deadpool")
"""``deadpool_t1``: tier 1 only (the replica switched off for the window); ``deadpool``: with the replica in the
second process's memory (gloo side group)."""


def parse_parts(text: str) -> list[str]:
    """``"a,c"`` -> ``["a", "c"]`` in the order of :data:`PARTS`; ValueError naming what is allowed."""
    got = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [p for p in got if p not in PARTS]
    if bad or not got:
        raise ValueError(f"--parts: {','.join(bad) or 'nothing'} is not a part; allowed: a comma-separated subset of "
                         f"{','.join(PARTS)}")
    return [p for p in PARTS if p in got]


def schedule(rounds: int, modes: list[str]) -> list[tuple[int, str]]:
    """(round, mode) in run order: round 0 is warm-up; the order of modes rotates from round to round so drift hits
    every mode alike."""
    out = []
    for r in range(rounds + 1):
        k = r % len(modes)
        out += [(r, m) for m in modes[k:] + modes[:k]]
    return out


def windows(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocks ``{"round", "mode", "warmup", "steps", "window_s", "step_s": [...], "tail_s", "blocking_s": [...]}``
    (``window_s`` from CUDA events; ``tail_s``: after the last step's end, the snapshot work still outstanding)
    -> per mode: window ratios per round, their median and 90% CI, steps, tails, blocking per snapshot."""
    measured = [b for b in blocks if not b["warmup"]]
    base = median([s for b in measured if b["mode"] == "none" for s in b["step_s"]])
    out: dict[str, Any] = {"rule": "window (overhead_analyse.py), timed by CUDA events on the compute stream",
                           "modes": {}}
    for mode in sorted({b["mode"] for b in measured}, key=lambda m: (m != "none", m)):
        mine = [b for b in measured if b["mode"] == mode]
        win = _paired(measured, mode, lambda b: b["window_s"] / b["steps"])
        m: dict[str, Any] = {
            "window_s_per_step": summarize([b["window_s"] / b["steps"] for b in mine]),
            "window_ratios": win, "window_ratio": median(win),
            "window_ratio_ci90": list(bootstrap_median_ci(win) or []) or None if mode != "none" else None,
            "step_s": summarize([s for b in mine for s in b["step_s"]]),
            "tail_s": summarize([b["tail_s"] for b in mine]),
            "windows_measured": len(mine),
        }
        if mode in SNAPSHOT_MODES:
            m["blocking_s"] = summarize([v for b in mine for v in b["blocking_s"]])
            m["blocking_fraction_of_step"] = ratio(m["blocking_s"]["median"], base)
            m["goal_ratio"] = GOALS["ratio"]
            m.update(goal_verdict(m["window_ratio_ci90"], GOALS["ratio"], len(win),
                                  min((b["steps"] for b in mine), default=0)))
        out["modes"][mode] = m
    return out


def goal_verdict(ci: list[float] | None, goal: float, rounds: int, steps: int) -> dict[str, Any]:
    """A ratio goal (lower is better) judged on the 90% CI of the median over rounds, never on the median alone:
    met when the whole interval is at or under the goal, not met when it is all above, else not resolved. Under
    :data:`MIN_ROUNDS` x :data:`MIN_STEPS`, or without an interval (one measured round), no verdict:
    ``goal_met`` is None and ``goal_verdict`` says why."""
    if not ci:
        return {"goal_met": None, "goal_verdict": f"no verdict: {rounds} measured round(s) give no interval"}
    if rounds < MIN_ROUNDS or steps < MIN_STEPS:
        return {"goal_met": None, "goal_verdict": f"no verdict: {rounds} round(s) x {steps} step(s) measured, under "
                                                  f"the rule of {MIN_ROUNDS} x {MIN_STEPS}"}
    if ci[1] <= goal:
        return {"goal_met": True, "goal_verdict": "met (the 90% CI's upper end is at or under the goal)"}
    if ci[0] > goal:
        return {"goal_met": False, "goal_verdict": "not met (the 90% CI's lower end is above the goal)"}
    return {"goal_met": None, "goal_verdict": "not resolved (the 90% CI straddles the goal)"}


def bandwidth(snapshot_bytes: int, copy_s: list[float], peak_gbs: float | None,
              slot_gbs: float | None = None) -> dict[str, Any]:
    """Part b: the snapshot's copy phase (median over its snapshots) as GB/s and as a fraction of the device's
    pinned device-to-host peak measured in the same process."""
    med = median(copy_s)
    gbs = snapshot_bytes / med / 1e9 if med else None
    frac = ratio(gbs, peak_gbs)
    return {"snapshot_bytes": snapshot_bytes, "copy_s": summarize(copy_s), "snapshot_gbs": gbs,
            "pinned_peak_gbs": peak_gbs, "registered_slot_gbs": slot_gbs, "fraction_of_peak": frac,
            "goal_fraction": GOALS["bandwidth_fraction"],
            "goal_met": frac is not None and frac >= GOALS["bandwidth_fraction"]}


def compare_restart(first: dict[str, Any], restart: dict[str, Any]) -> dict[str, Any]:
    """Part c: the uninterrupted run's checksums at the snapshot's step and its next losses against the restarted
    process's, bit for bit (checksums are hex strings of the raw bytes, losses compared as recorded floats)."""
    a, b = first["checksums"], restart["checksums"]
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    la, lb = first["losses"], restart["losses"]
    return {"version": first.get("version"), "restored_version": restart.get("version"), "tensors": len(a),
            "checksums_equal": not differ and bool(a), "checksum_mismatches": differ[:20],
            "losses_equal": la == lb and bool(la), "losses_uninterrupted": la, "losses_restarted": lb,
            "restored_from": restart.get("restored_from")}


REQUIRED = {"benchmark": str, "schema": int, "status": str, "command": str, "settings": dict, "versions": dict,
            "device": dict, "parts": dict, "wall_s": float}


def validate_result(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing or mistyped field of a result document."""
    for key, typ in REQUIRED.items():
        if key not in doc:
            raise ValueError(f"gpu_check result: missing {key!r}")
        if not isinstance(doc[key], typ) or (typ is float and isinstance(doc[key], bool)):
            raise ValueError(f"gpu_check result: {key!r} has type {type(doc[key]).__name__}")
    if doc["benchmark"] != "gpu_check" or doc["schema"] != SCHEMA_VERSION:
        raise ValueError(f"gpu_check result: not a schema-{SCHEMA_VERSION} gpu_check document")
    for key in ("torch", "cuda", "deepspeed", "driver"):
        if key not in doc["versions"]:
            raise ValueError(f"gpu_check result: versions.{key} missing")
    for name, part in doc["parts"].items():
        if name not in PARTS:
            raise ValueError(f"gpu_check result: unknown part {name!r}")
        if not isinstance(part, dict) or not isinstance(part.get("status"), str):
            raise ValueError(f"gpu_check result: parts.{name} must say its status")


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One line per part for the log: what was measured, or why not."""
    lines = []
    for name in PARTS:
        part = doc["parts"].get(name)
        if part is None:
            continue
        head = f"[gpu_check] part {name} ({PART_TITLES[name]}): {part['status']}"
        if part["status"] != "ok":
            lines.append(head)
            continue
        if name == "a":
            for mode in SNAPSHOT_MODES:
                m = part["analysis"]["modes"].get(mode)
                if m:
                    head += (f"; {mode} window ratio {m['window_ratio']} (CI {m['window_ratio_ci90']}), goal "
                             f"<= {m['goal_ratio']}: {m['goal_verdict']}, blocking median "
                             f"{m['blocking_s']['median']} s")
        elif name == "b":
            head += f"; {part['snapshot_gbs']} GB/s = {part['fraction_of_peak']} of {part['pinned_peak_gbs']} GB/s"
        elif name == "c":
            head += f"; checksums equal {part['checksums_equal']}, next losses equal {part['losses_equal']}"
        elif name == "d":
            head += f"; bit-exact {part['bit_exact']}, fused replay x{part['speedup']} vs stepwise"
        elif name == "e":
            head += f"; capture blocking median {part['capture_s']['median']} s for {part['bytes']} bytes"
        lines.append(head)
    return lines
