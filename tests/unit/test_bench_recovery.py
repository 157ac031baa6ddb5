"""benchmarks/bench_recovery.py and its modules: rendering and analysis from a saved result, without running a
job (the split into recovery_procs / recovery_run / recovery_analyse / recovery_render keeps the output)."""
from __future__ import annotations

import copy
import importlib
import json
import os
import sys

from deadpool_ext.testing.launch import REPO

BENCH = os.path.join(REPO, "benchmarks")
RESULTS = os.path.join(BENCH, "results")
sys.path.insert(0, BENCH)
recovery_render = importlib.import_module("recovery_render")
recovery_analyse = importlib.import_module("recovery_analyse")


def _load(stem):
    with open(os.path.join(RESULTS, f"{stem}.json")) as fh:
        return json.load(fh)


def test_render_from_saved_json_reproduces_the_committed_markdown():
    for stem in ("recovery",):
        with open(os.path.join(RESULTS, f"{stem}.md")) as fh:
            assert recovery_render.render_markdown(_load(stem)) == fh.read(), stem


def test_analysis_from_saved_runs_reproduces_the_saved_analysis():
    doc = _load("recovery")
    entry = doc["sizes"]["small"]
    saved = dict(entry["analysis"])
    # the same analysis over the rebuild path's and the unready runs (bench_recovery.analyse_entry)
    others = {k: saved.pop(k) for k in ("rebuild", "unready") if k in saved}  # no unready runs since issue 44
    saved.pop("per_node", None)  # every node killed in turn: bench_recovery.analyse_entry, checked below
    again = recovery_analyse.analyze_size("small", copy.deepcopy(entry))
    assert again == saved
    assert again["hotswap"]["raw_s"]["median"] > 0 and again["losses_identical"] is True
    for kind, analysis in others.items():
        view = {**entry, "runs": {**entry["runs"], "hotswap": entry["runs"][kind]}}
        assert recovery_analyse.analyze_size("small", copy.deepcopy(view)) == analysis
    bench_recovery = importlib.import_module("bench_recovery")
    assert bench_recovery.analyse_entry("small", copy.deepcopy(entry)) == entry["analysis"]


def test_render_only_writes_the_markdown_and_leaves_the_json(tmp_path):
    bench_recovery = importlib.import_module("bench_recovery")
    src = os.path.join(RESULTS, "recovery.json")
    dst = tmp_path / "recovery.json"
    dst.write_bytes(open(src, "rb").read())
    assert bench_recovery.main(["--render-only", str(dst)]) == 0
    assert dst.read_bytes() == open(src, "rb").read()
    assert (tmp_path / "recovery.md").read_text() == open(os.path.join(RESULTS, "recovery.md")).read()


def test_one_normal_step_leaves_out_the_warm_up_and_the_redone_steps():
    procs = importlib.import_module("recovery_procs")
    recs = [{"step": s, "step_time_s": t} for s, t in [(1, 7.0), (2, 4.4), (3, 2.8), (4, 3.1), (5, 2.9), (6, 2.7)]]
    assert abs(procs.steady_step_s(recs, {4}) - 2.85) < 1e-9  # steps 2, 3, 5, 6
    assert procs.steady_step_s(recs[:1], set()) is None
    relaunched = [{"step": s, "step_time_s": t} for s, t in [(4, 5.0), (5, 3.0), (6, 2.6)]]
    assert abs(procs.steady_step_s(recs[:3], set(), after=relaunched) - 2.9) < 1e-9  # 4.4, 2.8 | 3.0, 2.6
