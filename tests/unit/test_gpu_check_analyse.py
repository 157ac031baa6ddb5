"""benchmarks/gpu_check_analyse.py: the pure analysis of the GPU device check (no torch, no CUDA)."""
from __future__ import annotations

import os
import sys

import pytest

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_check_analyse as ga  # noqa: E402


def test_parts_parse_in_run_order_and_name_what_is_allowed():
    assert ga.parse_parts("c, a") == ["a", "c"]
    assert ga.parse_parts("A,b,e") == ["a", "b", "e"]
    with pytest.raises(ValueError, match="z is not a part; allowed: a comma-separated subset of a,b,c,d,e"):
        ga.parse_parts("a,z")
    with pytest.raises(ValueError, match="nothing is not a part"):
        ga.parse_parts(" , ")


def test_schedule_warms_up_then_rotates_the_order_of_modes():
    s = ga.schedule(2, ["none", "deadpool_t1", "deadpool"])
    assert s[:3] == [(0, "none"), (0, "deadpool_t1"), (0, "deadpool")]
    assert s[3:6] == [(1, "deadpool_t1"), (1, "deadpool"), (1, "none")]
    assert s[6:] == [(2, "deadpool"), (2, "none"), (2, "deadpool_t1")]


def _block(rnd, mode, window, steps=(1.0, 1.0), warm=False, blocking=(), tail=0.0):
    return {"round": rnd, "mode": mode, "warmup": warm, "steps": len(steps), "window_s": window,
            "step_s": list(steps), "tail_s": tail, "blocking_s": list(blocking)}


def test_windows_pair_rounds_count_the_tail_and_ignore_warm_up():
    blocks = [_block(0, "none", 99.0, warm=True), _block(0, "deadpool_t1", 99.0, warm=True, blocking=[5.0]),
              _block(1, "none", 2.0), _block(1, "deadpool_t1", 2.2, blocking=[0.01, 0.02], tail=0.2),
              _block(2, "deadpool_t1", 2.02, blocking=[0.01, 0.01], tail=0.02), _block(2, "none", 2.0),
              _block(3, "none", 2.0), _block(3, "deadpool_t1", 2.0, blocking=[0.0, 0.0])]
    an = ga.windows(blocks)
    t1 = an["modes"]["deadpool_t1"]
    assert t1["window_ratios"] == pytest.approx([1.1, 1.01, 1.0])  # the tail's 0.2 s is inside round 1's window
    assert t1["window_ratio"] == pytest.approx(1.01)
    lo, hi = t1["window_ratio_ci90"]
    assert lo <= t1["window_ratio"] <= hi
    assert t1["blocking_s"]["n"] == 6 and t1["blocking_s"]["max"] == 0.02  # the warm-up's 5 s is not counted
    assert t1["tail_s"]["max"] == 0.2 and t1["windows_measured"] == 3
    assert t1["goal_ratio"] == 1.005 and t1["goal_met"] is None  # 3 rounds x 2 steps: under the rule of 10 x 8
    assert t1["goal_verdict"].startswith("no verdict: 3 round(s) x 2 step(s)")
    assert an["modes"]["none"]["window_ratio"] == pytest.approx(1.0) and "blocking_s" not in an["modes"]["none"]
    assert list(an["modes"]) == ["none", "deadpool_t1"]
    assert "CUDA events" in an["rule"]


def test_windows_of_a_run_cut_short_have_no_interval_and_no_verdict():
    # one measured round under the goal: a ratio, no interval, so no goal is called met (issue 45)
    an = ga.windows([_block(1, "none", 1.0), _block(1, "deadpool", 1.004, blocking=[0.001])])
    m = an["modes"]["deadpool"]
    assert m["window_ratio"] == pytest.approx(1.004) and m["window_ratio_ci90"] is None
    assert m["goal_met"] is None and m["goal_verdict"] == "no verdict: 1 measured round(s) give no interval"


@pytest.mark.parametrize("ci, met, verdict", [([0.998, 1.004], True, "met"), ([1.006, 1.02], False, "not met"),
                                              ([1.0, 1.01], None, "not resolved")])
def test_a_goal_is_judged_on_the_whole_interval(ci, met, verdict):
    v = ga.goal_verdict(ci, 1.005, rounds=10, steps=8)
    assert v["goal_met"] is met and v["goal_verdict"].startswith(verdict)


def test_the_defaults_follow_the_rule_of_ten_rounds_of_eight_steps():
    an = ga.windows([_block(r, m, 1.0 + (0.001 * (r % 3) if m == "deadpool" else 0.0), steps=(0.1,) * 8)
                     for r in range(1, 11) for m in ("none", "deadpool")])
    assert an["modes"]["deadpool"]["goal_met"] is True


def test_bandwidth_is_a_fraction_of_the_peak_measured_in_the_same_run():
    b = ga.bandwidth(40_000_000_000, [1.0, 0.8, 0.9], peak_gbs=50.0, slot_gbs=48.0)
    assert b["snapshot_gbs"] == pytest.approx(40e9 / 0.9 / 1e9)
    assert b["fraction_of_peak"] == pytest.approx(b["snapshot_gbs"] / 50.0) and b["goal_met"] is True
    assert b["registered_slot_gbs"] == 48.0
    none = ga.bandwidth(1, [], peak_gbs=None)
    assert none["snapshot_gbs"] is None and none["fraction_of_peak"] is None and none["goal_met"] is False


def test_restart_comparison_is_bit_for_bit():
    first = {"version": 3, "checksums": {"a": "01", "b": "02"}, "losses": [2.5, 2.25]}
    same = {"version": 3, "checksums": {"a": "01", "b": "02"}, "losses": [2.5, 2.25], "restored_from": "local"}
    c = ga.compare_restart(first, same)
    assert c["checksums_equal"] and c["losses_equal"] and c["tensors"] == 2 and c["restored_from"] == "local"
    c = ga.compare_restart(first, {**same, "checksums": {"a": "01", "b": "ff"}, "losses": [2.5, 2.2500001]})
    assert not c["checksums_equal"] and c["checksum_mismatches"] == ["b"] and not c["losses_equal"]
    c = ga.compare_restart(first, {**same, "checksums": {"a": "01"}})
    assert c["checksum_mismatches"] == ["b"]  # a tensor the restart does not have is a mismatch
    assert not ga.compare_restart({"checksums": {}, "losses": []}, {"checksums": {}, "losses": []})["losses_equal"]


def _doc(**over):
    doc = {"benchmark": "gpu_check", "schema": ga.SCHEMA_VERSION, "status": "ok", "command": "c", "settings": {},
           "versions": {"torch": "2.11", "cuda": "13.0", "deepspeed": "0.19.8", "driver": "580"},
           "device": {"name": "H200"}, "parts": {"d": {"status": "ok", "bit_exact": True, "speedup": 2.0}},
           "wall_s": 100.0}
    doc.update(over)
    return doc


def test_result_schema_accepts_a_result_and_names_what_is_wrong():
    ga.validate_result(_doc())
    with pytest.raises(ValueError, match="missing 'versions'"):
        d = _doc()
        del d["versions"]
        ga.validate_result(d)
    with pytest.raises(ValueError, match="'wall_s' has type str"):
        ga.validate_result(_doc(wall_s="long"))
    with pytest.raises(ValueError, match="versions.driver missing"):
        ga.validate_result(_doc(versions={"torch": "x", "cuda": "y", "deepspeed": None}))
    with pytest.raises(ValueError, match="unknown part 'z'"):
        ga.validate_result(_doc(parts={"z": {"status": "ok"}}))
    with pytest.raises(ValueError, match="parts.a must say its status"):
        ga.validate_result(_doc(parts={"a": {}}))


def test_summary_says_each_part_or_why_not():
    lines = ga.summary_lines(_doc(parts={"a": {"status": "skipped: /dev/shm has 1.0 GB free"},
                                         "d": {"status": "ok", "bit_exact": True, "speedup": 2.0}}))
    assert lines[0].endswith("skipped: /dev/shm has 1.0 GB free") and "part a" in lines[0]
    assert "bit-exact True, fused replay x2.0" in lines[1]
