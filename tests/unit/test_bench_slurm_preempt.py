"""benchmarks/bench_slurm_preempt.py's pure parts (issue 47, "Measure"): what the requeued run resumed from, the
steps lost, and the drain's times from the job's timeline."""
from __future__ import annotations

import importlib
import os
import sys

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
bench = importlib.import_module("bench_slurm_preempt")


def _recs(*steps_times):
    return [{"step": s, "time": t, "loss": 1.0, "step_time_s": 3.0} for s, t in steps_times]


def test_a_drained_job_resumes_after_its_last_step_and_loses_none():
    # preempted at t=10 after step 3; step 4 finished inside the drain; the requeued run started at 150
    recs = _recs((1, 3), (2, 6), (3, 9), (4, 12), (5, 160), (6, 163))
    out = bench.requeued(recs, t_fault=10.0, t_started=150.0)
    assert (out["trained"], out["resumed_from"], out["steps_lost"]) == (4, 4, 0)
    assert out["trained_before_signal"] == 3 and out["first_step_s"] == 150.0 and out["started_s"] == 140.0


def test_a_relaunch_trains_again_what_its_checkpoint_did_not_hold():
    recs = _recs((1, 3), (2, 6), (3, 9), (4, 12), (3, 160), (4, 163), (5, 166))
    out = bench.requeued(recs, t_fault=10.0, t_started=150.0)
    assert (out["trained"], out["resumed_from"], out["steps_lost"]) == (4, 2, 2)


def test_a_run_never_requeued_has_no_second_part():
    out = bench.requeued(_recs((1, 3), (2, 6)), t_fault=4.0, t_started=None)
    assert (out["trained"], out["resumed_from"], out["steps_lost"], out["first_step_s"]) == (2, None, None, None)


def test_the_drain_times_come_from_the_launcher_and_rank_0():
    events = [{"event": "drain", "time": 11.0, "requested_at": 10.5, "source": "launcher"},
              {"event": "drain", "time": 11.2, "requested_at": 10.6, "source": "launcher"},
              {"event": "drained", "time": 14.0, "persisted": 4, "seconds": 3.2},
              {"event": "drained", "time": 15.0, "persisted": 4, "source": "launcher"}]
    out = bench.drain_times(events, t_fault=10.0)
    assert out == {"heard_s": 0.5, "persisted_s": 4.0, "persisted_step": 4, "persist_took_s": 3.2}
    assert bench.drain_times([], 10.0)["persisted_s"] is None


def test_the_table_renders_both_modes():
    run = {"heard_s": 0.4, "persisted_s": 3.9, "trained": 4, "resumed_from": 4, "steps_lost": 0, "started_s": 130.0,
           "first_step_s": 150.0, "losses": {"1": 1.0}}
    rl = {**run, "heard_s": None, "persisted_s": None, "resumed_from": 3, "steps_lost": 1, "losses": {"1": 2.0}}
    doc = {"reference": {"losses": {"1": 1.0}}, "modes": ["deadpool", "relaunch"],
           "runs": {"deadpool": [run], "relaunch": [rl]}}
    lines = bench.table(doc)
    assert lines[2].split(" | ")[1:6] == ["0.40", "3.90", "4", "4", "0"] and lines[2].endswith("| 1/1 | 1 |")
    assert lines[3].split(" | ")[1:6] == ["-", "-", "4", "3", "1"] and lines[3].endswith("| 0/1 | 1 |")


def test_the_docs_block_is_rendered_between_its_markers(tmp_path, monkeypatch):
    import pytest

    doc_path = tmp_path / "slurm.md"
    doc_path.write_text(f"before\n{bench.DOC_BEGIN}\nold\n{bench.DOC_END}\nafter\n")
    monkeypatch.setattr(bench, "DOC", str(doc_path))
    run = {"heard_s": 0.4, "persisted_s": 3.9, "trained": 4, "resumed_from": 4, "steps_lost": 0, "started_s": 130.0,
           "first_step_s": 150.0, "losses": {"1": 1.0}}
    doc = {"reference": {"losses": {"1": 1.0}}, "modes": ["deadpool"], "runs": {"deadpool": [run]}, "size": "small",
           "name": "slurm_preempt", "cred_expire_s": None, "machine": {"time_utc": "T", "git": {"commit": "abc"}}}
    bench.write_doc_block(doc)
    text = doc_path.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert bench.table(doc)[2] in text.splitlines()
    doc_path.write_text("no markers\n")
    with pytest.raises(SystemExit):
        bench.write_doc_block(doc)
