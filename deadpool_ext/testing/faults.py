"""Fault injection as an API: kill or stop a rank's process, drop a node's memory, corrupt a tier.

Faults are applied from outside the worker (real signals delivered by another process), so what is tested
is what happens on a real machine when a process dies.
"""
from __future__ import annotations

import enum
import os
import shutil
import signal
import time

import psutil


class Fault(enum.Enum):
    SIGKILL = "sigkill"
    SIGSTOP = "sigstop"
    DROP_NODE_MEMORY = "drop_node_memory"
    CORRUPT_BYTES = "corrupt_bytes"


def find_rank(launcher_pid: int, rank: int, *, timeout_s: float = 30.0) -> psutil.Process:
    """The worker process of global ``rank`` under a launcher (read from each child's RANK variable)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            for p in psutil.Process(launcher_pid).children(recursive=True):
                try:
                    env = p.environ()
                except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
                if env.get("RANK") == str(rank) and "python" in (p.name() or ""):
                    return p
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    raise TimeoutError(f"no worker with RANK={rank} under pid {launcher_pid} within {timeout_s}s")


def kill_rank(launcher_pid: int, rank: int, sig: int = signal.SIGKILL) -> int:
    proc = find_rank(launcher_pid, rank)
    proc.send_signal(sig)
    return proc.pid


def drop_node_memory(shm_root: str, node: str) -> int:
    """Remove every shared-memory directory of ``node`` under ``shm_root`` (its tier-1 slots and the replicas
    it held): what a lost node's memory looks like to the rest of the job. Returns directories removed."""
    removed = 0
    for name in os.listdir(shm_root):
        if name.startswith("deadpool.") and name.endswith("." + node):
            shutil.rmtree(os.path.join(shm_root, name), ignore_errors=True)
            removed += 1
    return removed


def corrupt_file(path: str, offset_from_end: int = 4096, nbytes: int = 16) -> None:
    """Flip bytes inside a snapshot (or checkpoint) file, away from the header, in place."""
    size = os.path.getsize(path)
    pos = max(0, size - offset_from_end)
    with open(path, "r+b") as fh:
        fh.seek(pos)
        data = bytearray(fh.read(nbytes))
        fh.seek(pos)
        fh.write(bytes(b ^ 0xFF for b in data))
