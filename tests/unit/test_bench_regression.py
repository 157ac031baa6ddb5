"""benchmarks/bench_regression.py's pure parts: the verdict per figure and the rendered table."""
from __future__ import annotations

import importlib
import json
import os
import sys

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
reg = importlib.import_module("bench_regression")


def test_a_recovery_figure_regresses_only_beyond_ten_percent_and_the_spread():
    assert not reg.verdict_recovery([3.0, 3.2], [3.25, 3.3])["regressed"]  # +6%, within 10%
    assert reg.verdict_recovery([3.0, 3.1], [3.6, 3.7])["regressed"]  # +18%, beyond the spread (0.1)
    assert not reg.verdict_recovery([3.0, 4.0], [3.5, 4.4])["regressed"]  # +0.45 s inside a 1 s spread
    assert not reg.verdict_recovery([3.0], [9.0], judged=False)["regressed"]  # context is shown, never judged


def test_an_overhead_ratio_regresses_only_when_its_ci_lies_above_the_other():
    before = [{"window_ratio": 1.04, "window_ratio_ci90": [1.02, 1.09]}]
    assert not reg.verdict_overhead(before, [{"window_ratio": 1.08, "window_ratio_ci90": [1.05, 1.12]}],
                                    "window_ratio")["regressed"]
    assert reg.verdict_overhead(before, [{"window_ratio": 1.15, "window_ratio_ci90": [1.10, 1.20]}],
                                "window_ratio")["regressed"]


def test_the_committed_result_renders_as_committed():
    path = os.path.join(REPO, "benchmarks", "results", "regression_issue31")
    with open(path + ".json") as fh:
        doc = json.load(fh)
    with open(path + ".md") as fh:
        assert fh.read() == reg.render(doc)
    assert not doc["regressed"] and not doc["failures"]


def test_no_regression_is_said_only_when_every_part_produced_figures():
    """A run whose benchmarks wrote no result (a failed job, or results written where the check does not read them)
    shows nothing: its verdict says so, never "no regression"."""
    ran = {"regressed": False, "complete": True}
    assert reg.verdict(ran) == "no regression"
    assert reg.verdict({"regressed": False, "complete": False}).startswith("none: ")
    assert reg.verdict({"regressed": True, "complete": False}) == "REGRESSION"
    assert reg.verdict({"regressed": False}) == "no regression"  # a result from before the field: rendered as it was
