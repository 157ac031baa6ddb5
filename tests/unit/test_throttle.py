"""The test bed's real slowdowns (deadpool_ext/testing/throttle.py) on a real child process: a CPU-quota cgroup it
is moved into and back out of, and the SIGSTOP/SIGCONT duty cycle."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deadpool_ext.testing.throttle import CpuQuota, DutyCycle, quota_unavailable
from deadpool_ext.testing.wait import wait_until


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(quota_unavailable() is not None, reason=f"no CPU quota: {quota_unavailable()}")
def test_a_process_goes_into_the_quota_and_back(child):
    before = open(f"/proc/{child.pid}/cgroup").read()
    quota = CpuQuota(0.25)
    try:
        quota.add(child.pid)
        assert quota.pids() == [child.pid]
        assert os.path.basename(quota.path) in open(f"/proc/{child.pid}/cgroup").read()
        period = 10_000
        if quota.version == "v1":
            assert open(os.path.join(quota.path, "cpu.cfs_quota_us")).read().strip() == str(period // 4)
        else:
            assert open(os.path.join(quota.path, "cpu.max")).read().split() == [str(period // 4), str(period)]
    finally:
        quota.release()
    assert open(f"/proc/{child.pid}/cgroup").read() == before and not os.path.exists(quota.path)


def test_the_duty_cycle_stops_and_continues_the_process(child):
    duty = DutyCycle([child.pid], 0.5, period_s=0.05)
    try:
        wait_until(lambda: _state(child.pid) == "T", 5, "the child stopped by the duty cycle's SIGSTOP")
        wait_until(lambda: _state(child.pid) != "T", 5, "the child continued by its SIGCONT")
    finally:
        duty.release()
    wait_until(lambda: _state(child.pid) != "T", 5, "the child running again after the release")
    assert child.poll() is None
