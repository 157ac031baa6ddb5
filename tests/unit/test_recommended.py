"""The recommended setup's overhead (benchmarks/bench_recommended.py, issue 45 part 2), its pure parts: the paired
analysis of per-round jobs, the split of a job's CPU by process, the kernel's count of a whole tree, and a peer's
files made durable without a machine-wide sync. No training job runs here."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import file_sync  # noqa: E402
import job_cpu  # noqa: E402
import paired  # noqa: E402
import recommended_analyse as ra  # noqa: E402


def _job(rnd: int, mode: str, window: float, cpu: float, roles: dict | None = None) -> dict:
    return {"round": rnd, "mode": mode, "result": {"steps": 8, "window_s": window, "cpu_s": cpu,
                                                   "cpu_by_role_s": roles or {"ranks": cpu}}}


def test_modes_are_paired_with_plain_round_by_round():
    jobs = []
    for r in range(10):
        base = 20.0 + 3 * (r % 4)  # the machine drifts from round to round
        jobs += [_job(r, "plain", base, 2 * base),
                 _job(r, "off", base * (1.0 + (0.01 if r % 2 else -0.01)), 2 * base),
                 _job(r, "recommended", base * 1.02, 2 * base * 1.06,
                      {"ranks": 2 * base * 1.03, "launcher": 0.3, "spare": 0.5})]
    an = ra.analyze(jobs)
    rec, off = an["modes"]["recommended"], an["modes"]["off"]
    assert rec["window"]["median"] == pytest.approx(1.02) and rec["window"]["verdict"] == paired.WORSE
    assert rec["cpu"]["median"] == pytest.approx(1.06)
    assert off["window"]["verdict"] == paired.NO_DIFFERENCE
    assert an["target_step_ratio"]["met"] is True  # 1.02, its CI's upper end under 1.05
    assert rec["cpu_s_per_step_by_role"]["spare"] == pytest.approx(0.5 / 8)
    text = ra.render_markdown({"analysis": an, "command": "c", "machine": {}, "size": "small", "params": 24e6,
                               "micro_batch": 2, "rounds": 10, "steps": 8, "warmup_steps": 3,
                               "cpu_source": "cgroup v1 cpuacct.usage"})
    assert "recommended / plain, paired per round, 1.020" in text and "**worse**" in text


def test_a_failed_job_leaves_its_round_without_a_pair():
    jobs = [_job(0, "plain", 10.0, 20.0), _job(0, "recommended", 10.5, 21.0), _job(1, "plain", 10.0, 20.0),
            {"round": 1, "mode": "recommended", "error": "timed out"}]
    an = ra.analyze(jobs)
    assert an["modes"]["recommended"]["window"]["rounds"] == 1
    assert an["modes"]["recommended"]["window"]["verdict"] == paired.NO_DIFFERENCE  # one pair: no interval
    assert an["target_step_ratio"]["met"] is False
    assert an["failed_jobs"] == [{"round": 1, "mode": "recommended", "error": "timed out"}]


@pytest.mark.parametrize("role, cmdline, share", [
    ("rank0", "python bench_recommended.py --worker", "ranks"),
    ("script", "python bench_recommended.py --worker", "spare"),
    (None, "python -m deadpool_ext.launcher.cli --nnodes 2", "launcher"),
    (None, "python -m torch.distributed.run --nproc-per-node 2", "launcher"),
    (None, "python -m some.helper", "other"),
])
def test_each_process_is_counted_in_its_share(role, cmdline, share):
    assert job_cpu.classify(role, cmdline) == share


def test_the_kernel_counts_a_tree_and_its_exited_children():
    try:
        cg = job_cpu.JobCgroup.create(f"deadpool_test_{os.getpid()}")
    except job_cpu.NoCgroup as exc:
        pytest.skip(str(exc))
    with cg:
        # a shell whose child burns CPU and exits before the count is read: the kernel still counts it
        cmd = cg.wrap([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                       "'sum(range(3 * 10**6))'], check=True)"])
        subprocess.run(cmd, check=True, timeout=60)
        assert cg.usage_s() > 0.02
        assert cg.pids() == []
    assert not os.path.exists(cg.path)


def test_a_peer_syncs_its_own_files_only(tmp_path):
    (tmp_path / "tag1").mkdir()
    (tmp_path / "tag1" / "model.pt").write_bytes(b"x" * 100)
    (tmp_path / "tag1" / "optim.pt").write_bytes(b"y" * 100)
    (tmp_path / "latest").write_text("tag1")
    assert file_sync.fsync_tree(str(tmp_path)) == 3
    assert file_sync.fsync_tree(str(tmp_path / "missing")) == 0
