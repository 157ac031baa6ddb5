"""Per-node agent: keeps a job's tier-1 shared memory alive across worker crashes, removes it at job end.

Snapshot buffers are files in a tmpfs, so they already outlive a crashed worker. What must outlive the
workers is the *decision to delete them*: the agent is a small detached process, one per node and job, that
watches the launcher (torchrun's, the deepspeed launcher's or deadpool-run's process) and removes the job's
shared-memory directory when the launcher is gone, i.e. when the job has ended - also when the launcher was
killed and could not clean up itself.

With ``local.keep_after_exit_s`` > 0 the agent waits that long after the launcher exits before removing
anything. A relaunch of the same job (same job id) inside the window writes its launcher's pid into the
directory (``claim_directory``); the agent then watches the new launcher instead and the relaunched workers
restore from the memory left by the earlier run. This is how a job under a launcher that never restarts
workers itself (DeepSpeed's ``deepspeed``) still restores from memory: relaunch it.

Run by hand: ``python -m deadpool_ext.memory.agent --dir /dev/shm/deadpool.JOB.NODE --watch-pid PID [--keep-s S]``.
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


def _read_pid(path: str) -> int:
    try:
        with open(path) as fh:
            return int(fh.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _write_pid(path: str, pid: int) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(str(pid))
    os.replace(path + ".tmp", path)


def claim_directory(directory: str, launcher_pid: int, *, keep_s: float = 0.0) -> bool:
    """Make ``directory`` this job's. If it was left by a launcher that has exited (an earlier run with the same
    job id), it is removed, so its snapshots are never restored into this job, unless ``keep_s`` > 0 and the
    earlier run's agent still holds it (inside its keep window): then it is adopted, and the agent watches this
    launcher from now on. Returns True if stale contents were removed. Called by local rank 0 before any rank
    scans."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LAUNCHER_FILE)
    previous = _read_pid(path)
    # Written first: an agent inside its keep window checks this file before it removes anything.
    _write_pid(path, launcher_pid)
    if not previous or previous == launcher_pid or _alive(previous):
        return False
    agent = _read_pid(os.path.join(directory, PIDFILE))
    if keep_s > 0 and agent and _alive(agent):
        log.warning("adopting %s: memory of an earlier run of this job (launcher pid %d exited), kept by its node "
                    "agent (pid %d) for local.keep_after_exit_s=%gs; a restore may resume from it", directory,
                    previous, agent, keep_s)
        return False
    log.warning("removing %s: left by an earlier job whose launcher (pid %d) has exited%s", directory, previous,
                "" if keep_s > 0 else " (set local.keep_after_exit_s to resume from it after a relaunch)")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    _write_pid(path, launcher_pid)
    return True


def ensure_agent(directory: str, watch_pid: int, *, keep_s: float = 0.0) -> int:
    """Start the node's agent for ``directory`` unless one is running; return its pid. A running agent of an
    earlier run of the job switches to the launcher recorded by ``claim_directory`` by itself."""
    os.makedirs(directory, exist_ok=True)
    pidfile = os.path.join(directory, PIDFILE)
    pid = _read_pid(pidfile)
    if pid and _alive(pid):
        return pid
    # --daemon: the started process forks the agent, records its pid and exits, so the agent is nobody's
    # descendant. Launchers that kill a failed job's process tree (DeepSpeed's launch.py walks the children
    # of each worker) would otherwise take the agent with them, and with it a keep window.
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool_ext.memory.agent", "--dir", directory, "--watch-pid", str(watch_pid),
         "--keep-s", str(keep_s), "--daemon"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the workers' process group: a kill of the workers spares it
    )
    if proc.wait(timeout=60) != 0 or not _read_pid(pidfile):
        raise RuntimeError(f"the node agent for {directory} did not start (exit code {proc.returncode})")
    pid = _read_pid(pidfile)
    log.info("started node agent pid %d for %s (removes it %s pid %d exits)", pid, directory,
             f"{keep_s:g}s after" if keep_s > 0 else "when", watch_pid)
    return pid


def _new_owner(directory: str, watching: int) -> int:
    """The launcher that claimed the directory after ``watching``, if it is alive; else 0."""
    owner = _read_pid(os.path.join(directory, LAUNCHER_FILE))
    return owner if owner and owner != watching and _alive(owner) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the job's shared-memory directory on this node")
    p.add_argument("--watch-pid", type=int, required=True, help="remove --dir when this process exits")
    p.add_argument("--keep-s", type=float, default=0.0, help="wait this long for a relaunch before removing --dir")
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--daemon", action="store_true", help="fork, record the agent's pid in the directory, return")
    args = p.parse_args(argv)
    if args.daemon:
        child = os.fork()
        if child:
            _write_pid(os.path.join(args.dir, PIDFILE), child)
            os._exit(0)
    watching = args.watch_pid
    while True:
        while _alive(watching):
            time.sleep(args.poll_s)
        # A relaunch of the job may have claimed the directory already, or may do so inside the keep window.
        deadline = time.monotonic() + args.keep_s
        owner = _new_owner(args.dir, watching)
        while not owner and time.monotonic() < deadline:
            time.sleep(args.poll_s)
            owner = _new_owner(args.dir, watching)
        owner = owner or _new_owner(args.dir, watching)  # last look, right before removing
        if not owner:
            shutil.rmtree(args.dir, ignore_errors=True)
            return 0
        watching = owner


if __name__ == "__main__":
    sys.exit(main())
