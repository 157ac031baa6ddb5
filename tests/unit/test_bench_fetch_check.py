"""benchmarks/bench_fetch_check.py: its analysis and rendering from the committed result, without running a job."""
from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from deadpool_ext.testing.launch import REPO
from tests.log_interface import assert_refusal

BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)
bench = importlib.import_module("bench_fetch_check")


def _committed() -> dict:
    with open(os.path.join(BENCH, "results", "fetch_check.json")) as fh:
        return json.load(fh)


def test_analysis_and_markdown_are_reproduced_from_the_raw_runs():
    doc = _committed()
    assert json.loads(json.dumps(bench.analyse(doc["raw"]))) == doc["results"]
    with open(os.path.join(BENCH, "results", "fetch_check.md")) as fh:
        assert bench.render(doc) == fh.read()


def test_analysis_of_known_runs():
    runs = {"after": [0.10, 0.12, 0.11], "overlapped": [0.08, 0.09, 0.10], "transfer": [0.07, 0.08, 0.09],
            "check": [0.02, 0.03, 0.04]}
    got = bench.analyse({"sizes": {"1": {"blob_nbytes": 1 << 20, "runs": runs}}})["1"]
    assert got["diff_overlapped_minus_after"]["median"] == pytest.approx(-0.02)
    assert got["floor_overlapped_s"] == pytest.approx(0.08) and got["sum_transfer_check_s"] == pytest.approx(0.11)
    assert got["check_hidden_fraction"] == pytest.approx((0.11 - 0.09) / 0.03)


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--pairs", "0"])
    assert_refusal((exc.value.code, capsys.readouterr().err), rc=2, names="--pairs must be positive")
