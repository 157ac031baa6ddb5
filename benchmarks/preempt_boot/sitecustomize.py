"""bench_preempt.py's harness: lands the SIGTERM of a trial at an exact point, from inside the job's workers.

On ``PYTHONPATH`` only in that benchmark's jobs; it also installs the chaos harness's step fault when
``DEADPOOL_INJECT`` names one (the ``recovery`` kind's lost rank), then runs the ``sitecustomize`` it shadows.
``BENCH_PREEMPT=KIND:STEP:MARKER`` names where; the process that sends the signal first
creates ``MARKER`` exclusively and writes the time it sent it (so a trial's signal is sent once, and the benchmark
measures from that instant). Kinds (rank 1 sends, to the launcher unless said):

- ``backward``: as rank 1's backward of step STEP + 1 begins (``torch.autograd.backward``);
- ``snapshot``: right after rank 1's step STEP queued its snapshot copy (the ``after_step`` hook point);
- ``tier3``: once rank 1's tier-3 writer has written STEP x 80 KiB of a base (``_ChunkSink.write``: mid-write);
- ``recovery``: as any worker begins a restore from memory in a hot-swap (``before_restore`` of a generation
  >= 1), the lost rank SIGKILLed by the chaos harness's ``kill@step`` in the same job;
- ``worker``: to rank 1's own process (a SIGTERM to one worker only), after its step STEP.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time


def _send(marker: str, pid: int) -> None:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    sent = time.time()
    os.kill(pid, signal.SIGTERM)
    os.write(fd, f"{sent!r} {os.getpid()}\n".encode())
    os.close(fd)


def _install() -> None:
    if os.environ.get("DEADPOOL_INJECT"):
        from deadpool_ext.chaos.at_step import install

        install()
    spec = os.environ.get("BENCH_PREEMPT")
    launcher = os.environ.get("DEADPOOL_LAUNCHER_PID")
    if not spec or not launcher or not os.environ.get("DEADPOOL_WORKER_ID"):
        return
    kind, step_s, marker = spec.split(":", 2)
    step, target = int(step_s), int(launcher)
    from deadpool_ext import hooks

    if kind in ("snapshot", "worker"):
        def after_step(step: int = 0, rank: int = -1, **_: object) -> None:
            if rank == 1 and step_now[0] < 0 and step >= want:
                step_now[0] = step
                _send(marker, os.getpid() if kind == "worker" else target)

        want, step_now = step, [-1]
        hooks.register(hooks.AFTER_STEP, after_step)
    elif kind == "recovery":
        def before_restore(generation: int = 0, **_: object) -> None:
            if generation >= 1:
                _send(marker, target)

        hooks.register(hooks.BEFORE_RESTORE, before_restore)
    elif kind == "backward":
        import torch

        seen = {"rank": -1, "step": 0}

        def note(step: int = 0, rank: int = -1, **_: object) -> None:
            seen["rank"], seen["step"] = rank, step

        hooks.register(hooks.AFTER_STEP, note)
        original = torch.autograd.backward

        def backward(*args: object, **kwargs: object) -> object:
            if seen["rank"] == 1 and seen["step"] >= step:
                _send(marker, target)
            return original(*args, **kwargs)  # type: ignore[arg-type]

        torch.autograd.backward = backward  # type: ignore[assignment]
    elif kind == "tier3":
        from deadpool_ext.persist import writer

        write_file, sink_write = writer.BaseWriter._write_file, writer._ChunkSink.write
        active, threshold = [False], step * 80 * 1024

        def watched_file(self: object, job: writer.BaseJob, f: writer.CapturedFile) -> object:
            active[0] = job.rank == 1
            return write_file(self, job, f)  # type: ignore[arg-type]

        def watched_write(self: writer._ChunkSink, data: object) -> int:
            n = sink_write(self, data)
            if active[0] and self.nbytes >= threshold:
                _send(marker, target)
            return n

        writer.BaseWriter._write_file = watched_file  # type: ignore[method-assign,assignment]
        writer._ChunkSink.write = watched_write  # type: ignore[method-assign,assignment]


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(os.path.dirname(candidate)) == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_bench_preempt_shadowed_sitecustomize", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


_install()
_chain()
