"""benchmarks/bench_hosts.py's pure parts: the compared --suspect-age-s values and the rendered table."""
from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
hosts = importlib.import_module("bench_hosts")


def test_compared_values_parse_and_bad_ones_are_named():
    assert hosts.parse_variants("0,default") == [0.0, None]
    assert hosts.parse_variants(" 0.5 , 1.5 ") == [0.5, 1.5]
    assert hosts.run_key("follower_host", 0.0) == "follower_host@0"
    assert hosts.run_key("follower_host", None) == "follower_host@default"
    for bad, why in [("0", "two or more"), ("0,0", "two or more"), ("0,fast", "'fast' is not a number"),
                     ("-1,default", "'-1' is negative")]:
        with pytest.raises(ValueError, match=why):
            hosts.parse_variants(bad)


def _run(detect: float, reported: float | None) -> dict:
    ph = {k: 0.5 for k in hosts.PHASES} | {"detect_s": detect, "reported_s": reported}
    return {"rcs": [0, 0, 0], "steps": 6, "losses_identical": True, "phases": ph, "assignment_s": 4.0,
            "took_over_s": None, "replaced": {"node2": "spare1"}}


def _doc(**extra) -> dict:
    return {"command": "python benchmarks/bench_hosts.py", "machine": {"cpu_count": 2}, "size": "tiny",
            "kill_step": 3, "steps_after": 3, "leader_ttl_s": 4, "detect_timeout_s": 3.0, "wall_s": 10.0,
            "modes": ["follower_host"], "references": {}, **extra}


def test_a_comparison_renders_one_row_per_value_with_its_runs():
    doc = _doc(variants=[0.0, None], suspect_age_s=None,
               runs={"follower_host@0": [_run(2.8, 0.1), _run(3.1, 0.2)],
                     "follower_host@default": [_run(0.7, 0.1), _run(0.5, 0.1)]})
    md = hosts.render(json.loads(json.dumps(doc)))
    assert "`--suspect-age-s compared: 0, off / default (1.5 x --heartbeat-s)`" in md
    rows = [line for line in md.splitlines() if line.startswith("| follower_host")]
    assert [r.split(" | ")[0] for r in rows] == ["| follower_host, --suspect-age-s 0, off",
                                                "| follower_host, --suspect-age-s default (1.5 x --heartbeat-s)"]
    assert "| 2.95 (2.80, 3.10) |" in rows[0] and "| 0.60 (0.70, 0.50) |" in rows[1]
    assert "alternated repeat by repeat" in md


def test_a_single_value_renders_as_before():
    md = hosts.render(_doc(suspect_age_s=None, runs={"follower_host": [_run(0.7, 0.1)]}))
    assert [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| follower_host")] == \
        ["| follower_host"]
    assert "alternated" not in md
