"""The node agent (deadpool_ext.memory.agent) with real processes: it removes a job's tier-1 directory when the
job's launcher exits, or, with a keep window, hands it to a relaunch of the job that claims it in time."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deadpool_ext.memory import agent
from deadpool_ext.testing.wait import holds_for, wait_until


def _launcher() -> subprocess.Popen:
    """Stands in for a launcher process: something alive whose pid the agent watches."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _start_agent(directory: str, pid: int, keep_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "deadpool_ext.memory.agent", "--dir", directory, "--watch-pid",
                             str(pid), "--keep-s", str(keep_s), "--poll-s", "0.05"])
    agent.write_record(directory, agent.PIDFILE, proc.pid)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def _stop_all(*procs: subprocess.Popen | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            _stop(p)


def _wait_gone(path: str, timeout_s: float, why: str) -> None:
    wait_until(lambda: not os.path.exists(path), timeout_s, f"the agent to remove {path} ({why})")


def _kept(path: str, window_s: float, why: str) -> None:
    """``path`` is still there at every poll for ``window_s`` (the agent polls every 0.05 s, so it has looked)."""
    holds_for(lambda: os.path.exists(path), window_s, f"{path} kept ({why})")


@pytest.fixture
def job_dir(tmp_path):
    d = tmp_path / "deadpool.job.node0"
    d.mkdir()
    return str(d)


def test_directory_removed_when_the_launcher_exits(job_dir):
    first = _launcher()
    agent.claim_directory(job_dir, first.pid)
    ag = _start_agent(job_dir, first.pid, keep_s=0)
    try:
        open(os.path.join(job_dir, "snap.r0.0"), "wb").write(b"x")
        _kept(job_dir, 0.3, "its launcher is alive")
        _stop(first)
        _wait_gone(job_dir, 10, "its launcher exited")
        assert ag.wait(timeout=10) == 0
    finally:
        _stop_all(first, ag)


def test_relaunch_inside_the_keep_window_adopts_the_memory(job_dir):
    first = _launcher()
    agent.claim_directory(job_dir, first.pid, keep_s=30)
    ag = _start_agent(job_dir, first.pid, keep_s=30)
    second = None
    try:
        snap = os.path.join(job_dir, "snap.r0.0")
        open(snap, "wb").write(b"version 7")
        _stop(first)
        _kept(snap, 0.5, "the agent is inside its keep window")
        assert open(snap, "rb").read() == b"version 7"
        second = _launcher()
        assert agent.claim_directory(job_dir, second.pid, keep_s=30) is False  # adopted, not removed
        assert open(snap, "rb").read() == b"version 7"
        assert agent.ensure_agent(job_dir, second.pid, keep_s=30) == ag.pid  # the same agent carries on
        holds_for(lambda: ag.poll() is None and os.path.exists(snap), 0.5,
                  "the agent runs on and keeps the memory for the relaunch")
        # It now watches the relaunch: when that ends and nobody relaunches within the window, it cleans up.
        # (The window of this agent is 30 s; a second agent with a short one checks the same logic quickly.)
        _stop(ag)
        ag2 = _start_agent(job_dir, second.pid, keep_s=0.5)
        _stop(second)
        _wait_gone(job_dir, 10, "the relaunch exited and its 0.5 s window passed")
        assert ag2.wait(timeout=10) == 0
    finally:
        _stop_all(first, second, ag)


@pytest.mark.parametrize("keep_s,with_agent", [(0, False), (30, True)])
def test_stale_memory_is_removed_at_a_relaunch(job_dir, keep_s, with_agent):
    """Without a keep window, or with one whose agent is gone (the agent is what guarantees the window),
    an earlier run's memory is stale: a relaunch's claim removes it."""
    first = _launcher()
    agent.claim_directory(job_dir, first.pid, keep_s=keep_s)
    ag = _start_agent(job_dir, first.pid, keep_s=keep_s) if with_agent else None
    open(os.path.join(job_dir, "snap.r0.0"), "wb").write(b"old")
    _stop_all(ag, first)  # the agent, if any, dies too: as if killed together with the job
    second = _launcher()
    try:
        assert agent.claim_directory(job_dir, second.pid, keep_s=keep_s) is True
        assert os.listdir(job_dir) == [agent.LAUNCHER_FILE]
    finally:
        _stop(second)


def test_window_passes_without_a_relaunch(job_dir):
    first = _launcher()
    agent.claim_directory(job_dir, first.pid, keep_s=1.0)
    ag = _start_agent(job_dir, first.pid, keep_s=1.0)
    try:
        _stop(first)
        _kept(job_dir, 0.4, "inside the 1 s keep window")
        _wait_gone(job_dir, 10, "the keep window passed without a relaunch")
        assert ag.wait(timeout=10) == 0
    finally:
        _stop_all(first, ag)


def test_started_agent_is_nobodys_descendant(job_dir):
    """DeepSpeed's launcher kills the process tree of a failed job; the agent must not be in it."""
    import psutil

    launcher = _launcher()
    try:
        pid = agent.ensure_agent(job_dir, launcher.pid, keep_s=5)
        assert pid == agent.read_record(job_dir, agent.PIDFILE)[0]
        assert psutil.pid_exists(pid)
        assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
        assert agent.ensure_agent(job_dir, launcher.pid, keep_s=5) == pid  # one agent per directory
        _stop(launcher)
        _kept(job_dir, 0.8, "inside its 5 s keep window")
        os.kill(pid, 9)
    finally:
        _stop_all(launcher)
