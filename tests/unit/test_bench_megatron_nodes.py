"""benchmarks/bench_megatron_nodes.py's pure parts (issue 44): the fallback against the rebuild path judged round by
round, paired, and the table with kinds left out of a run."""
from __future__ import annotations

import importlib
import os
import sys

from pytest import approx

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
bench = importlib.import_module("bench_megatron_nodes")

RECORDS = [{"step": s, "loss": 5.0 - s / 10} for s in range(6, 11)]


def _run(kind: str, i: int, restored: float | None, failed: str | None = None) -> dict:
    return {"kind": kind, "tag": f"{kind}_r{i}", "restored_s": restored, "raw_s": (restored or 0) + 0.1,
            "normal_step_s": 0.05, "records": RECORDS, "how": ["start_again"] if kind == "node0" else [],
            **({"failed": failed} if failed else {})}


def _doc(node0: list, rebuild: list, failed: int | None = None) -> dict:
    runs = [r for i, (x, y) in enumerate(zip(node0, rebuild))
            for r in (_run("node0", i, x, "exit 1" if i == failed else None), _run("rebuild", i, y))]
    return {"runs": runs, "reference_losses": {str(r["step"]): r["loss"] for r in RECORDS},
            "kinds": ["node0", "rebuild"],
            "title": "t", "date": "2026-12-07", "command": "python b.py", "wall_s": 60.0, "repeats": len(node0),
            "size": "tiny", "machine": {"cpu_count": 2}, "layout": "pp2", "name": "megatron_nodes_pp2"}


def test_the_fallback_is_judged_on_paired_rounds_not_on_two_medians():
    # the host drifted: every round slower than the one before, the fallback first in half of them
    an = bench.analyse(_doc([3.0, 3.3, 3.6, 3.9], [3.05, 3.32, 3.58, 3.95]))
    fr = an["fallback_vs_rebuild"]
    assert fr["paired_diffs_s"] == approx([-0.05, -0.02, 0.02, -0.05])
    assert fr["rounds_not_slower"] == 3 and fr["met"]
    assert not bench.analyse(_doc([3.1, 3.4], [3.0, 3.3]))["fallback_vs_rebuild"]["met"]


def test_a_round_one_kind_failed_in_is_not_paired_and_no_round_is_not_met():
    fr = bench.analyse(_doc([9.0, 3.0], [3.1, 3.1], failed=0))["fallback_vs_rebuild"]
    assert fr["paired_diffs_s"] == approx([-0.1])
    assert not bench.analyse(_doc([], []))["fallback_vs_rebuild"]["met"]


def test_a_run_of_two_kinds_renders_with_the_others_empty():
    doc = _doc([3.0, 3.2, 3.1], [3.1, 3.1, 3.2])
    doc["analysis"] = bench.analyse(doc)
    md = bench.render(doc)
    assert "median -0.10 s (-0.10, +0.10, -0.10), not slower in 2 of 3 rounds (not slower)" in md
    assert "| kill -> every rank restored, median (s) | - | 3.10 | 3.10 | - |" in md


def test_kinds_are_checked():
    import pytest

    for bad in ("node0,reboot", "node0,node0", ","):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--kinds", bad])
        assert exc.value.code == 2, bad  # argparse's usage error, before any job


def test_the_next_iteration_is_the_first_completed_after_the_restore():
    """A 0.06 s iteration can be complete on every rank when the kill lands and logged by rank 0 just after it: that
    record is not the recovery's next step."""
    recs = [{"step": s, "time": t, "step_time_s": 0.06, "loss": 1.0} for s, t in [(5, 99.9), (6, 100.005), (7, 103.2)]]
    run = {"kind": "rebuild", "t_kill": 100.0, "restored_s": 3.1, "records": recs, "last_step_before_kill": 5,
           "raw_s": 0.005}
    assert bench.next_step_s(run) == approx(3.2)
    assert bench.next_step_s({**run, "kind": "relaunch"}) == 0.005
    assert bench.next_step_s({**run, "restored_s": None}) == 0.005
