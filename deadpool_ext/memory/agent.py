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

The pid files (``agent.pid``, ``launcher.pid``) hold ``"<pid> <start time>"`` (``/proc/<pid>/stat`` field 22)
and a process counts as the one recorded only if both match: a pid reused by another process after the
launcher exited never keeps the memory. They are read and written without following symbolic links, in a
directory that must be this user's and private (:mod:`.trust`).

Run by hand: ``python -m deadpool_ext.memory.agent --dir /dev/shm/deadpool.JOB.NODE --watch-pid PID [--keep-s S]``.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import stat
import subprocess
import sys
import time

from .trust import (
    UntrustedPathError,
    ensure_private_dir,
    open_private_dir,
    process_start_time,
    read_private_file,
    write_private_file,
)

log = logging.getLogger("deadpool_ext")
PIDFILE = "agent.pid"
LAUNCHER_FILE = "launcher.pid"

Record = tuple[int, int]
"""(pid, start time of that process): what a pid file holds, ``"<pid> <start>"``. A pid alone is never trusted:
once its process has exited the number may belong to any other process, which must not keep a job's memory."""
_INVALID: Record = (0, -1)  # a pid file that is there but is not a record: nobody is running under it


def running(record: Record | None) -> bool:
    """Whether the process recorded is alive: that pid, started at that time (not a reuse of the pid)."""
    return record is not None and record[0] > 0 and process_start_time(record[0]) == record[1]


def read_record(directory: str, name: str) -> Record | None:
    """The record in pid file ``name`` of ``directory``; None if there is no such file (or directory). A file
    that is not a record (an older version's bare pid, garbage) is logged and reads as a record of nobody."""
    try:
        dfd = open_private_dir(directory)
    except FileNotFoundError:
        return None
    try:
        raw = read_private_file(dfd, name, limit=64, where=directory)
    finally:
        os.close(dfd)
    if raw is None:
        return None
    fields = raw.split()
    if len(fields) == 2 and all(f.isdigit() and len(f) <= 20 for f in fields) and int(fields[0]) > 0:
        return int(fields[0]), int(fields[1])
    log.warning("ignoring %s: expected '<pid> <process start time>', got %r; nobody is taken to run under it",
                os.path.join(directory, name), raw[:64])
    return _INVALID


def write_record(directory: str, name: str, pid: int) -> Record:
    """Record process ``pid`` (with its start time) in pid file ``name`` of ``directory``, atomically."""
    start = process_start_time(pid)
    if start is None:
        raise RuntimeError(f"cannot record pid {pid} in {os.path.join(directory, name)}: no such running process")
    dfd = open_private_dir(directory)
    try:
        write_private_file(dfd, name, f"{pid} {start}\n".encode())
    finally:
        os.close(dfd)
    return pid, start


def claim_directory(directory: str, launcher_pid: int, *, keep_s: float = 0.0) -> bool:
    """Make ``directory`` this job's (created 0700, or adopted only if it is this user's and private). If it was
    left by a launcher that has exited (an earlier run with the same job id), it is removed, so its snapshots
    are never restored into this job, unless ``keep_s`` > 0 and the earlier run's agent still holds it (inside
    its keep window): then it is adopted, and the agent watches this launcher from now on. Returns True if
    stale contents were removed. Called by local rank 0 before any rank scans."""
    ensure_private_dir(directory)
    previous = read_record(directory, LAUNCHER_FILE)
    # Written first: an agent inside its keep window checks this file before it removes anything.
    me = write_record(directory, LAUNCHER_FILE, launcher_pid)
    if previous is None or previous == me or running(previous):
        return False
    agent = read_record(directory, PIDFILE)
    if keep_s > 0 and running(agent):
        assert agent is not None
        log.warning("adopting %s: memory of an earlier run of this job (launcher pid %d exited), kept by its node "
                    "agent (pid %d) for local.keep_after_exit_s=%gs; a restore may resume from it", directory,
                    previous[0], agent[0], keep_s)
        return False
    whose = f"whose launcher (pid {previous[0]}) has exited" if previous != _INVALID else "that recorded no launcher"
    log.warning("removing %s: left by an earlier job %s%s", directory, whose,
                "" if keep_s > 0 else " (set local.keep_after_exit_s to resume from it after a relaunch)")
    _remove(directory)
    ensure_private_dir(directory)
    write_record(directory, LAUNCHER_FILE, launcher_pid)
    return True


def ensure_agent(directory: str, watch_pid: int, *, keep_s: float = 0.0) -> int:
    """Start the node's agent for ``directory`` unless one is running; return its pid. A running agent of an
    earlier run of the job switches to the launcher recorded by ``claim_directory`` by itself."""
    ensure_private_dir(directory)
    rec = read_record(directory, PIDFILE)
    if running(rec):
        assert rec is not None
        return rec[0]
    start = process_start_time(watch_pid)
    if start is None:
        raise RuntimeError(f"the launcher (pid {watch_pid}) the node agent for {directory} would watch is not running")
    # --daemon: the started process forks the agent, records its pid and exits, so the agent is nobody's
    # descendant. Launchers that kill a failed job's process tree (DeepSpeed's launch.py walks the children
    # of each worker) would otherwise take the agent with them, and with it a keep window.
    proc = subprocess.Popen(
        [sys.executable, "-m", "deadpool_ext.memory.agent", "--dir", directory, "--watch-pid", str(watch_pid),
         "--watch-start", str(start), "--keep-s", str(keep_s), "--daemon"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the workers' process group: a kill of the workers spares it
    )
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"the node agent for {directory} did not start within 60 s") from None
    rec = read_record(directory, PIDFILE)
    if code != 0 or not running(rec):
        raise RuntimeError(f"the node agent for {directory} did not start (exit code {code})")
    assert rec is not None
    log.info("started node agent pid %d for %s (removes it %s pid %d exits)", rec[0], directory,
             f"{keep_s:g}s after" if keep_s > 0 else "when", watch_pid)
    return rec[0]


def _new_owner(directory: str, watching: Record) -> Record | None:
    """The launcher that claimed the directory after ``watching``, if it is running; else None."""
    try:
        owner = read_record(directory, LAUNCHER_FILE)
    except UntrustedPathError as exc:
        log.warning("%s", exc)
        return None
    return owner if owner is not None and owner != watching and running(owner) else None


def _remove(directory: str) -> None:
    """Remove the job's directory: only a real directory of this user's (a link or another user's entry put in
    its place is left alone; rmtree itself never follows links inside)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        log.warning("not removing %s: it is no longer a directory of this user's", directory)
        return
    shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the job's shared-memory directory on this node")
    p.add_argument("--watch-pid", type=int, required=True, help="remove --dir when this process exits")
    p.add_argument("--watch-start", type=int, default=None,
                   help="start time of --watch-pid (/proc/<pid>/stat field 22; default: read now)")
    p.add_argument("--keep-s", type=float, default=0.0, help="wait this long for a relaunch before removing --dir")
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--daemon", action="store_true", help="fork, record the agent's pid in the directory, return")
    args = p.parse_args(argv)
    watching: Record = (args.watch_pid, args.watch_start if args.watch_start is not None
                        else process_start_time(args.watch_pid) or -1)
    if args.daemon:
        child = os.fork()
        if child:
            write_record(args.dir, PIDFILE, child)
            os._exit(0)
    while True:
        while running(watching):
            time.sleep(args.poll_s)
        # A relaunch of the job may have claimed the directory already, or may do so inside the keep window.
        deadline = time.monotonic() + args.keep_s
        owner = _new_owner(args.dir, watching)
        while owner is None and time.monotonic() < deadline:
            time.sleep(args.poll_s)
            owner = _new_owner(args.dir, watching)
        owner = owner or _new_owner(args.dir, watching)  # last look, right before removing
        if owner is None:
            _remove(args.dir)
            return 0
        watching = owner


if __name__ == "__main__":
    sys.exit(main())
