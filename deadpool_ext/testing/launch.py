"""Run multi-process jobs with a deadline, and always reap the whole process tree (their command lines:
``jobs.Job``).

torchrun starts each worker in its own session, so killing torchrun's process group leaves workers running;
we walk the tree with psutil and kill every descendant. DeepSpeed's CPU communication op leaves 69 MB
buffers in /dev/shm when a process dies; :func:`sweep_deepspeed_shm` removes the ones a run created.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    return env


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def sweep_deepspeed_shm(since: float, root: str = "/dev/shm") -> int:
    removed = 0
    for name in os.listdir(root):
        if name.startswith("deepspeed_") and os.path.getmtime(os.path.join(root, name)) >= since - 1:
            try:
                os.unlink(os.path.join(root, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


@dataclass
class RunResult:
    returncode: int
    output: str
    elapsed_s: float
    timed_out: bool = False
    events: list[str] = field(default_factory=list)


def run_job(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
            while_running: Callable[[subprocess.Popen], None] | None = None, cwd: str = REPO) -> RunResult:
    """Run ``cmd``; ``while_running(proc)`` may inject faults. The whole tree is killed at the deadline."""
    start = time.time()
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    import threading

    chunks: list[str] = []
    stdout = proc.stdout
    assert stdout is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: chunks.extend(iter(stdout.readline, "")), daemon=True)
    reader.start()
    timed_out = False
    try:
        if while_running is not None:
            while_running(proc)
        proc.wait(timeout=max(1.0, timeout_s - (time.time() - start)))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_tree(proc.pid)
        reader.join(5)
        sweep_deepspeed_shm(start)
    return RunResult(proc.returncode if not timed_out else -9, "".join(chunks), time.time() - start, timed_out)


def read_metrics(path: str) -> dict[int, float]:
    """step -> loss; a step recomputed after a restore appears twice and the last value wins. Records without a
    loss (an example's events, e.g. the HF Trainer's ``train_begin``) are not steps."""
    out: dict[int, float] = {}
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                if "loss" in rec:
                    out[int(rec["step"])] = float(rec["loss"])
    return out


def wait_for_step(path: str, step: int, *, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if max(read_metrics(path), default=0) >= step:
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"job exited (rc={proc.returncode}) before reaching step {step}")
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout_s}s for step {step} in {path}")
