"""The Slurm side, pure: the bed's slurm.conf, a drain under Slurm (every launcher signalled, each leaving when its
part is done), and the Slurm benchmark's measure (the end-to-end tests: tests/multihost/test_slurm.py)."""
from __future__ import annotations

from deadpool_ext.launcher.decide import Observation
from deadpool_ext.launcher.drain import LauncherDrain, drained_observation
from deadpool_ext.testing.slurm import slurm_conf


def test_the_beds_slurm_conf():
    conf = slurm_conf("ab12", "/w", "/run/x", "/run/x/munge/sock", [("dpab12n0", "10.0.0.1"), ("dpab12n1", "10.0.0.2")],
                      ("dpab12ctl", "10.0.0.3"), cred_expire_s=5, grace_time_s=7)
    lines = conf.splitlines()
    assert "SlurmctldHost=dpab12ctl(10.0.0.3)" in lines
    assert "AuthInfo=socket=/run/x/munge/sock,cred_expire=5" in lines
    assert "SlurmdSpoolDir=/run/x/spool/%n" in lines and "PreemptMode=REQUEUE" in lines
    assert any(line.startswith("NodeName=dpab12n1 NodeAddr=10.0.0.2 ") for line in lines)
    main = [line for line in lines if line.startswith("PartitionName=main ")]
    assert main and main[0].endswith("PriorityTier=1 GraceTime=7") and "Nodes=dpab12n0,dpab12n1" in main[0]
    assert "AuthInfo=socket=/s" in slurm_conf("t", "/w", "/r", "/s", [("n", "1.2.3.4")], ("c", "1.2.3.5")).splitlines()


def test_a_host_that_left_after_its_drain_is_not_a_lost_host():
    """Under Slurm every launcher is signalled and each ends once its workers drained: its lease lapses before the
    coordinator reads its workers' exits. While draining that is no lost host; before a drain it still is."""
    obs = Observation(now=1.0, hosts_seen=frozenset({0, 1, 2}), hosts_now=frozenset({0}))
    ranks = ("node0.0", "node1.0", "node2.0")
    assert drained_observation(obs, ranks, draining=True).hosts_now == frozenset({0, 1, 2})
    assert drained_observation(obs, ranks, draining=False).hosts_now == frozenset({0})


class _Reads:
    def __init__(self, outcome: object | None) -> None:
        self.outcome = outcome

    def get(self, key: str, decoder: object) -> object | None:
        return self.outcome if key == "drained" else None


def test_a_launcher_of_spares_only_waits_for_the_jobs_outcome():
    """The spare node of a Slurm allocation holds no rank: its launcher's part ends with rank 0's outcome (so its
    line says which step is safe), or at the budget's end."""
    drain = LauncherDrain(6.0, 3, lambda **_: None)
    drain.deadline = 100.0
    ranks, local = ("node0.0", "node1.0"), {"spare0.0"}
    assert not drain.over(ranks, local, {}, 10.0, _Reads(None))       # type: ignore[arg-type]
    assert drain.over(ranks, local, {}, 10.0, _Reads(object()))       # type: ignore[arg-type]
    assert drain.over(ranks, local, {}, 100.0, _Reads(None))          # type: ignore[arg-type]
    assert drain.over(ranks, {"node1.0"}, {"node1.0": 75}, 10.0, _Reads(None))   # type: ignore[arg-type]
    assert not drain.over(ranks, {"node1.0"}, {}, 10.0, _Reads(object()))       # type: ignore[arg-type]


def test_the_benchmarks_restored_is_the_first_step_past_the_one_before_the_fault():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from bench_slurm import restored_after

    recs = [{"step": 1, "time": 1.0}, {"step": 2, "time": 2.0}, {"step": 3, "time": 3.0},
            {"step": 2, "time": 9.0}, {"step": 3, "time": 10.0}, {"step": 4, "time": 11.0}]   # a relaunch redoes 2-3
    assert restored_after(recs, 3.5) == {"last_step_before": 3, "restored_s": 7.5}
    assert restored_after(recs[:3], 3.5) == {"last_step_before": 3, "restored_s": None}


def test_the_docs_sbatch_script_is_the_file_the_suite_runs():
    """docs/slurm.md shows scripts/slurm/deadpool.sbatch as it is (the Slurm tests submit the file itself)."""
    import os

    from deadpool_ext.testing.launch import REPO
    from deadpool_ext.testing.slurmjob import SBATCH_SCRIPT

    with open(SBATCH_SCRIPT) as fh:
        script = fh.read()
    with open(os.path.join(REPO, "docs", "slurm.md")) as fh:
        doc = fh.read()
    assert "```bash\n" + script + "```" in doc


def test_a_dead_beds_run_directory_is_swept(tmp_path, monkeypatch):
    from deadpool_ext.testing import hosts, slurm

    records, run = tmp_path / "records", tmp_path / "run"
    records.mkdir()
    (records / "live.json").write_text("{}")
    for tag in ("live", "dead"):
        (run / tag / "munge").mkdir(parents=True)
    monkeypatch.setattr(hosts, "RECORDS", str(records))
    monkeypatch.setattr(slurm, "RUN_ROOT", str(run))
    assert slurm.sweep_stale_run_dirs() == ["dead"]
    assert sorted(p.name for p in run.iterdir()) == ["live"]
