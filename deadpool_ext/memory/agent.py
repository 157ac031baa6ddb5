"""Per-node agent: keeps a job's tier-1 shared memory alive across worker crashes, removes it at job end.

Snapshot buffers are files in a tmpfs, so they already outlive a crashed worker. What must outlive the
workers is the *decision to delete them*: the agent is a small detached process, one per node and job, that
watches the launcher (torchrun's, the deepspeed launcher's or deadpool-run's process) and removes the job's
shared-memory directory when the launcher is gone, i.e. when the job has ended - also when the launcher was
killed and could not clean up itself.

Run by hand: ``python -m deadpool_ext.memory.agent --dir /dev/shm/deadpool.JOB.NODE --watch-pid PID``.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time

log = logging.getLogger("deadpool_ext")
PIDFILE = "agent.pid"
LAUNCHER_FILE = "launcher.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_directory(directory: str, launcher_pid: int) -> bool:
    """Make ``directory`` this job's: if it was left by a launcher that has exited (an earlier job with the
    same job id that died without cleaning up), remove it, so its snapshots are never restored into this job.
    Returns True if stale contents were removed. Called by local rank 0 before any rank scans."""
    path = os.path.join(directory, LAUNCHER_FILE)
    stale = False
    try:
        with open(path) as fh:
            previous = int(fh.read().strip() or 0)
        if previous != launcher_pid and not _alive(previous):
            log.warning("removing %s: left by an earlier job whose launcher (pid %d) has exited", directory, previous)
            shutil.rmtree(directory, ignore_errors=True)
            stale = True
    except (FileNotFoundError, ValueError):
        pass
    os.makedirs(directory, exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        fh.write(str(launcher_pid))
    os.replace(path + ".tmp", path)
    return stale


def ensure_agent(directory: str, watch_pid: int) -> int:
    """Start the node's agent for ``directory`` unless one is running; return its pid."""
    os.makedirs(directory, exist_ok=True)
    pidfile = os.path.join(directory, PIDFILE)
    try:
        with open(pidfile) as fh:
            pid = int(fh.read().strip() or 0)
        if pid and _alive(pid):
            return pid
    except (FileNotFoundError, ValueError):
        pass
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool_ext.memory.agent", "--dir", directory, "--watch-pid", str(watch_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the workers' process group: a kill of the workers spares it
    )
    with open(pidfile + ".tmp", "w") as fh:
        fh.write(str(proc.pid))
    os.replace(pidfile + ".tmp", pidfile)
    log.info("started node agent pid %d for %s (removes it when pid %d exits)", proc.pid, directory, watch_pid)
    return proc.pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the job's shared-memory directory on this node")
    p.add_argument("--watch-pid", type=int, required=True, help="remove --dir when this process exits")
    p.add_argument("--poll-s", type=float, default=0.5)
    args = p.parse_args(argv)
    while _alive(args.watch_pid):
        time.sleep(args.poll_s)
    try:
        with open(os.path.join(args.dir, LAUNCHER_FILE)) as fh:
            owner = int(fh.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        owner = args.watch_pid
    # A newer job with the same id may have claimed the directory meanwhile; it is theirs now.
    if owner == args.watch_pid:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
