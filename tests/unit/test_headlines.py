"""The README's benchmark headlines cannot go stale: the block is what the current results render, and no headline
result was measured under a default of the "deadpool" section that has changed since (issue "honest numbers")."""
from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import headlines  # noqa: E402


def test_the_readme_block_is_what_the_current_results_render():
    block = headlines.readme_block()
    assert block is not None, "README.md has no headlines markers"
    assert block == headlines.render(), (
        "README.md's benchmark block differs from what benchmarks/results renders: run "
        "`python benchmarks/headlines.py --write-readme` (never edit the block by hand)")


def test_no_headline_result_was_measured_under_a_changed_default():
    problems = headlines.stale()
    assert not problems, "stale headline result(s), re-run them:\n" + "\n".join(problems)


def test_a_changed_default_names_the_result_to_rerun(tmp_path):
    doc = {"command": "python benchmarks/bench_recovery.py --sizes small", "sizes": {},
           "machine": {"deadpool_defaults": headlines.deadpool_defaults()}}
    doc["machine"]["deadpool_defaults"]["hot_swap"]["in_place"] = False
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    [line] = headlines.stale(str(tmp_path))
    assert line.startswith("recovery: measured under other defaults (hot_swap.in_place (False then, True now))")
    assert "python benchmarks/bench_recovery.py --sizes small" in line


def test_a_result_without_recorded_defaults_is_stale(tmp_path):
    (tmp_path / "recovery.json").write_text(json.dumps({"command": "x", "sizes": {}, "machine": {}}))
    assert headlines.stale(str(tmp_path)) == ["recovery: records no deadpool defaults; re-run `x`"]


@pytest.mark.parametrize("rule, rule_met, used", [("window", True, True), ("window", False, False),
                                                  (None, True, False)])
def test_only_overhead_results_counted_whole_are_headlines(tmp_path, rule, rule_met, used):
    doc = {"sizes": {"small": {"analysis": {"rule": rule}, "rule_met": rule_met}}}
    (tmp_path / "snapshot_overhead_small_n2.json").write_text(json.dumps(doc))
    assert ("snapshot_overhead_small_n2" in headlines.sources(str(tmp_path))) is used
