"""python -m benchmarks.refresh (issue 45, part 3): the plan comes from the current headline results (their
recorded commands and wall times), jobs run in order with a progress line and a total estimate, a result moves
in only when its job succeeded and the one it replaces goes to the archive. No benchmark runs here."""
from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import refresh  # noqa: E402


def _docs() -> dict:
    return {
        "simulate": {"command": "python benchmarks/bench_simulate.py", "wall_s": 40.0},
        "recovery": {"command": "python benchmarks/bench_recovery.py --sizes small,medium"},
        "snapshot_overhead_small_n2": {
            "command": "python benchmarks/bench_snapshot_overhead.py --sizes small --nproc 2 --name "
                       "snapshot_overhead_small_n2 --out /tmp/results",
            "sizes": {"small": {"job_wall_s": 1600.0}}},
        "snapshot_overhead_medium_n4": {"command": ".venv/bin/python benchmarks/bench_snapshot_overhead.py --out=/x "
                                                   "--timeout-s 9000", "sizes": {"medium": {"job_wall_s": 5000.0}}},
    }


def test_the_plan_runs_overhead_then_recovery_then_the_simulation_with_their_own_commands():
    jobs = refresh.plan(_docs())
    assert [j.stem for j in jobs] == ["snapshot_overhead_small_n2", "snapshot_overhead_medium_n4", "recovery",
                                      "simulate"]
    assert jobs[0].argv == (sys.executable, "benchmarks/bench_snapshot_overhead.py", "--sizes", "small", "--nproc",
                            "2", "--name", "snapshot_overhead_small_n2")
    assert jobs[1].argv[1:] == ("benchmarks/bench_snapshot_overhead.py", "--timeout-s", "9000")
    assert jobs[0].estimate_s == 1600.0 + refresh.START_S
    assert jobs[2].estimate_s == refresh.DEFAULT_ESTIMATE_S["recovery"] and "guess" in jobs[2].estimate_from
    assert [j.stem for j in refresh.plan(_docs(), {"simulate"})] == ["simulate"]


def test_the_progress_line_names_the_job_and_the_time_left():
    jobs = refresh.plan(_docs())
    line = refresh.progress_line(1, jobs, 1700.0, [1700.0])
    assert line.startswith("[refresh] 2/4 snapshot_overhead_medium_n4: starting, estimate 84 min; 28 min so far, ")
    left = sum(j.estimate_s for j in jobs[1:])
    assert f"about {refresh.fmt_duration(left)} left" in line
    assert f"(total about {refresh.fmt_duration(1700.0 + left)})" in line
    assert refresh.fmt_duration(4 * 3600 + 6 * 60) == "4 h 06 min"


def test_a_new_result_moves_in_and_the_old_one_to_the_archive(tmp_path):
    results, staging = tmp_path / "results", tmp_path / "staging"
    results.mkdir()
    staging.mkdir()
    (results / "recovery.json").write_text(json.dumps({"machine": {"time_utc": "2026-12-04T13:11:00Z"}}))
    (results / "recovery.md").write_text("old")
    (staging / "recovery.json").write_text("{}")
    (staging / "recovery.md").write_text("new")
    assert refresh.install(str(staging), str(results), "recovery") == ["recovery.json", "recovery.md"]
    assert (results / "recovery.md").read_text() == "new"
    assert sorted(os.listdir(results / "archive")) == ["recovery_20261204.json", "recovery_20261204.md"]
    assert (results / "archive" / "recovery_20261204.md").read_text() == "old"


def test_a_failed_job_leaves_the_current_result_and_fails_the_refresh(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "simulate.md").write_text("current")
    jobs = refresh.plan(_docs(), {"recovery", "simulate"})
    said: list[str] = []

    def run(job, staging, log, deadline_s):
        if job.stem == "simulate":
            return 1
        with open(os.path.join(staging, f"{job.stem}.json"), "w") as fh:
            fh.write("{}")
        return 0

    rc = refresh.refresh(jobs, str(results), str(tmp_path), said.append, run=run, render=lambda d: [])
    assert rc == 1
    assert (results / "simulate.md").read_text() == "current"
    assert (results / "recovery.json").exists()
    assert said[0].startswith("[refresh] 1/2 recovery: starting")
    assert said[1].startswith("[refresh] 1/2 recovery: done in")
    assert said[3].startswith("[refresh] 2/2 simulate: FAILED (rc 1)")
    assert said[-1].startswith("[refresh] 1 of 2 headline(s) re-measured") and "failed: simulate" in said[-1]


def test_list_runs_nothing(monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("--list ran the refresh")

    monkeypatch.setattr(refresh, "refresh", must_not_run)
    monkeypatch.setattr(refresh, "run_job", must_not_run)
    assert refresh.main(["--list"]) == 0
    assert "snapshot_overhead_small_n2" in {j.stem for j in refresh.plan(refresh.current_docs())}
