"""benchmarks/bench_trainer_recovery.py's pure parts: medians, speedups against the Trainer's own relaunch, the
issue's targets, the loss check against the uninterrupted run, and the rendered table."""
from __future__ import annotations

import importlib
import os
import sys

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
bench = importlib.import_module("bench_trainer_recovery")


def _run(kind: str, restored: float, raw: float, losses: dict[int, float], failed: str | None = None) -> dict:
    return {"kind": kind, "restored_s": restored, "raw_s": raw, "normal_step_s": 0.5, "first_step_time_after_s": 0.55,
            "records": [{"step": s, "loss": v} for s, v in losses.items()], **({"failed": failed} if failed else {})}


def _doc() -> dict:
    ref = {1: 5.5, 2: 5.25, 3: 5.0}
    return {"title": "t", "date": "2026-12-04", "command": "python b.py", "wall_s": 60.0, "repeats": 2,
            "machine": {"cpu_count": 2}, "reference_losses": {str(k): v for k, v in ref.items()},
            "runs": [_run("ready", 0.4, 1.2, ref), _run("ready", 0.6, 1.4, ref),
                     _run("unready", 4.0, 5.0, ref), _run("unready", 5.0, 6.0, {**ref, 3: 5.1}),
                     _run("relaunch", 8.0, 9.0, ref), _run("relaunch", 9.0, 10.0, ref),
                     _run("relaunch", 0.1, 0.2, ref, failed="rc 1")]}


def test_medians_speedups_and_targets():
    an = bench.analyse(_doc())
    assert an["ready"]["restored_s"] == 0.5 and an["relaunch"]["restored_s"] == 8.5 and an["relaunch"]["n"] == 2
    assert an["ready"]["speedup_restored"] == 17.0 and an["unready"]["speedup_restored"] == 8.5 / 4.5
    assert abs(an["ready"]["minus_step_s"] - 0.8) < 1e-9
    # the worst node (node0, 4.5 s) decides the targets: neither 1.0 s nor 10x is met there
    assert an["worst"] == "unready" and an["targets"]["restored_worst_node"]["value_s"] == 4.5
    assert not an["targets"]["restored_worst_node"]["met"] and not an["targets"]["restored_speedup_worst_node"]["met"]
    assert not an["targets"]["next_step_minus_step_worst_node"]["met"]
    fast = _doc()
    fast["runs"] = [r for r in fast["runs"] if r["kind"] != "unready"] + [_run("unready", 0.7, 1.3, {1: 5.5})] * 2
    an = bench.analyse(fast)
    assert an["worst"] == "unready" and all(t["met"] for t in an["targets"].values()), an["targets"]


def test_a_loss_off_by_one_ulp_is_not_identical():
    an = bench.analyse(_doc())
    assert an["ready"]["losses_identical"] and an["relaunch"]["losses_identical"]
    assert an["unready"]["losses_identical"] is False


def test_the_table_names_every_kind_and_the_targets():
    doc = _doc()
    doc["analysis"] = bench.analyse(doc)
    md = bench.render(doc)
    assert "| kill -> every rank restored (s) | 0.50 | 4.50 | 8.50 |" in md
    assert "17.0x / " in md and "Worst node: node0. Targets (issue 44" in md
    assert "restored_worst_node NOT met (4.50 against 1.0)" in md
