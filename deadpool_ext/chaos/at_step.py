"""In-process fault injection at an exact step boundary.

An outside poller that watches the metrics file and then signals a worker lands "at step S or a few steps
later", depending on how loaded the host is; a test that needs the failure between two bases (so that the
restore must replay differentials) cannot rely on that. This injector runs inside the training process and
fails rank R right after its optimizer step S (after the snapshot of S has been started, before the next
step), whatever the host's load.

It is configured through the environment, so an unchanged training script can be faulted::

    env = harness_env({ENV: "kill@step=6,rank=1,marker=/tmp/run/fault"})   # DEADPOOL_INJECT=...

:func:`harness_env` also puts ``deadpool_ext/chaos/boot`` on ``PYTHONPATH``: its ``sitecustomize`` runs
:func:`install` at interpreter start in every process of the job (whatever launched it), which registers the
fault on the product's hook points (:mod:`deadpool_ext.hooks`). The product itself never reads these
variables and never calls into this module.

- the action before ``@``: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang), ``term`` (SIGTERM),
  ``raise`` (a Python exception out of ``engine.step()``) or ``hang`` (the main thread blocks for good while
  every other thread, the heartbeat included, runs on: a rank alive but not training) or ``hold`` (the main
  thread waits until the file ``<marker>.release`` exists, at most ``HOLD_MAX_S``: the job kept at a step while
  a harness lands a sequence of faults on it, e.g. on the store);
- ``step``: the optimizer step (``engine.global_steps`` after the step) to fail at;
- ``rank``: the global rank that fails;
- ``marker``: a file created (exclusively, holding the pid) just before the fault fires. It makes the fault
  fire once per job: a restarted or replacement worker that redoes step S finds the marker and goes on. A
  test waits for it to know the fault happened. Required.

The fault fires from the ``after_step`` hook point, which every integration's runtime fires after each
optimizer step.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("deadpool_ext")

ENV = "DEADPOOL_INJECT"
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "raise": None, "hang": None,
           "hold": None}
HOLD_MAX_S = 120.0


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` action."""


@dataclass(frozen=True, slots=True)
class StepFault:
    action: str
    step: int
    rank: int
    marker: str

    @classmethod
    def parse(cls, spec: str) -> StepFault:
        action, sep, rest = spec.strip().partition("@")
        if not sep or action not in ACTIONS:
            raise ValueError(f"{ENV}={spec!r}: expected ACTION@step=S,rank=R,marker=PATH with ACTION one of "
                             f"{sorted(ACTIONS)}")
        fields: dict[str, str] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in ("step", "rank", "marker"):
                raise ValueError(f"{ENV}={spec!r}: unknown or malformed field {item!r} "
                                 "(allowed: step=INT, rank=INT, marker=PATH)")
            fields[key] = value
        missing = {"step", "rank", "marker"} - set(fields)
        if missing:
            raise ValueError(f"{ENV}={spec!r}: missing {sorted(missing)}")
        try:
            step, rank = int(fields["step"]), int(fields["rank"])
        except ValueError as exc:
            raise ValueError(f"{ENV}={spec!r}: step and rank must be integers") from exc
        if step < 1 or rank < 0:
            raise ValueError(f"{ENV}={spec!r}: step must be >= 1 and rank >= 0")
        return cls(action, step, rank, fields["marker"])

    def render(self) -> str:
        return f"{self.action}@step={self.step},rank={self.rank},marker={self.marker}"

    def due(self, step: int, rank: int) -> bool:
        return step == self.step and rank == self.rank and not os.path.exists(self.marker)

    def fire(self) -> None:
        """Claim the marker (once per job) and fail this process."""
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        log.warning("fault injection (%s): %s at step %d on rank %d", ENV, self.action, self.step, self.rank)
        for handler in logging.getLogger("deadpool_ext").handlers:
            handler.flush()
        if self.action == "hang":
            import threading

            threading.Event().wait()
        if self.action == "hold":
            import time

            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(self.marker + ".release"):
                if time.monotonic() > deadline:
                    log.warning("fault injection (%s): hold at step %d released by its %.0f s deadline (no %s)",
                                ENV, self.step, HOLD_MAX_S, self.marker + ".release")
                    break
                time.sleep(0.05)
            return
        sig = ACTIONS[self.action]
        if sig is None:
            raise InjectedFault(f"injected fault at step {self.step} on rank {self.rank}")
        os.kill(os.getpid(), sig)


_UNSET = object()
_fault: object = _UNSET


def configured() -> StepFault | None:
    """The fault named by the environment (parsed once per process), or None."""
    global _fault
    if _fault is _UNSET:
        spec = os.environ.get(ENV, "")
        _fault = StepFault.parse(spec) if spec.strip() else None
    return _fault  # type: ignore[return-value]


def after_step(step: int, rank: int, **_: object) -> None:
    fault = configured()
    if fault is not None and fault.due(step, rank):
        fault.fire()


GATE_ENV = "DEADPOOL_RESTORE_GATE"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
"""Folder holding the ``sitecustomize`` that calls :func:`install` in every process of a faulted job."""


def restore_gate(generation: int, timeout_s: float = 120.0, **_: object) -> None:
    """Hold a hot-swap restore until a fault injector has done its work.

    ``DEADPOOL_RESTORE_GATE=PATH``: in generation >= 1 (a hot-swap; never at job start) the memory-tier
    restore waits until PATH exists before it scans its buffers, so an injector that corrupts tier-1/2 copies
    after the failure is not raced by a recovery faster than it (the chaos runner sets it for corruption
    trials and creates PATH once the bytes are flipped). Bounded: after ``timeout_s`` the restore goes on and
    says so."""
    import time

    path = os.environ.get(GATE_ENV)
    if not path or generation < 1:
        return
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            log.warning("%s: %s did not appear within %.0f s; restoring anyway", GATE_ENV, path, timeout_s)
            return
        time.sleep(0.02)


_installed = False


def install() -> bool:
    """Register the faults this process's environment names on the product's hook points (once per process).
    Returns whether anything was registered. Called by ``boot/sitecustomize.py``; a test may call it directly."""
    global _installed
    if _installed:
        return True
    from .. import hooks

    fault = configured()
    if fault is not None:
        hooks.register(hooks.AFTER_STEP, after_step)
    if os.environ.get(GATE_ENV):
        hooks.register(hooks.BEFORE_RESTORE, restore_gate)
    _installed = fault is not None or bool(os.environ.get(GATE_ENV))
    return _installed


def harness_env(extra: dict[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """``extra`` (``ENV`` and/or ``GATE_ENV``) plus a ``PYTHONPATH`` that loads :func:`install` in every Python
    process of the job, for a harness to merge into the job's environment."""
    base = os.environ if environ is None else environ
    path = [BOOT_DIR] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    return {**extra, "PYTHONPATH": os.pathsep.join(path)}
