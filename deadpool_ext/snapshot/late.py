"""Client state that is whole only after the step's snapshot was taken (the HF Trainer's bookkeeping).

Why: a framework that owns the training loop finishes a step's bookkeeping after the optimizer step, where the
snapshot is taken. The HF Trainer (through Accelerate) runs DeepSpeed's ``engine.step`` inside the last
micro-batch's backward; only afterwards does it add that micro-batch's loss to its running sum, count its FLOPs
and tokens, step its own LR scheduler and log the step (``log_history``, ``total_flos``). State captured with the
snapshot (``set_client_state``) would hold step N half done, and no restore could complete it: the missing loss
exists only in the failed process. So the framework *posts* the state once its step is done, and the snapshot
worker waits for it between the copy (the only phase the next optimizer step waits for) and the seal, then
writes it into the header's meta under :data:`LATE_KEY`. The restore hands it back with the version it restores.

Rules (every one decided without a collective, the same on every rank):

- one post per snapshot; a post for another version, or a second one, is ignored (the first is what was whole);
- the next snapshot is taken while a version is still unposted (the framework's hook did not run): that version is
  sealed without the section, with one warning; the engine state stays protected, the bookkeeping is not;
- a failure before the post (``drop``, from the hot-swap's quiesce): the version is never sealed, so every rank
  restores the previous version, whose section is whole;
- the worker waits at most ``timeout_s``; then the version is sealed without the section (one warning);
- the header's room for the section is ``headroom`` bytes, reserved when the slots are sized (once per job:
  restored slots keep their size); a poster keeps its section under :meth:`LateState.room` (``fits``), so a seal
  never fails for it.

Call order: ``LateState(restored, headroom)`` handed to the manager before its first snapshot (``arm_late``);
per snapshot ``begin`` (main thread, at the snapshot) -> ``post`` (main thread, after the framework's step) ->
``wait`` (worker, before the seal); ``restored(section or None)`` from the restore, after the adapter's state.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .skeleton import flatten_state, unflatten_state

log = logging.getLogger("deadpool_ext")

LATE_KEY = "late"
"""Where the section lies in a snapshot header's meta (encoded as a tensor-free skeleton)."""

POLL_S = 0.05
"""How often the worker's wait looks whether a hot-swap replaced it (it then leaves at once)."""


def _read_scalars(obj: Any) -> Any:
    """0-dim tensors (a running loss the framework keeps on its device) as Python floats. Read here, in the
    snapshot worker, so that the training thread never waits for the device to post its state."""
    if isinstance(obj, torch.Tensor) and obj.dim() == 0:
        return float(obj.item())
    if isinstance(obj, dict):
        return {k: _read_scalars(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_read_scalars(v) for v in obj]
    return obj


def encode(value: dict[str, Any]) -> Any:
    """The section as header JSON: the skeleton encoding (non-finite floats, tuples round-trip); 0-dim
    tensors become floats; no other tensors."""
    skeleton, tensors, _ = flatten_state(_read_scalars(value))
    if tensors:
        raise ValueError("a late client state holds tensors; it must be plain values (the data layout is fixed "
                         "when the snapshot is taken)")
    return skeleton


def decode(skeleton: Any) -> dict[str, Any]:
    value = unflatten_state(skeleton, [])
    if not isinstance(value, dict):
        raise ValueError(f"late client state decodes to {type(value).__name__}, not a dict")
    return value


def encoded_nbytes(skeleton: Any) -> int:
    """Bytes the encoded section takes in the header (compact JSON, as ``format.build_header`` writes it)."""
    return len(json.dumps(skeleton, separators=(",", ":"), allow_nan=False)) + len(LATE_KEY) + 4


class LateStep:
    """One snapshot's section: posted (a value), cancelled (sealed without), or dropped (never sealed)."""

    __slots__ = ("version", "event", "value", "outcome")

    def __init__(self, version: int) -> None:
        self.version = version
        self.event = threading.Event()
        self.value: Any = None
        self.outcome = "pending"


class LateState:
    def __init__(self, restored: Callable[[dict[str, Any] | None], None], headroom: int,
                 timeout_s: float = 600.0) -> None:
        self.restored_cb = restored
        self.headroom = max(0, int(headroom))
        self.timeout_s = timeout_s
        self.current: LateStep | None = None
        self._warned: set[str] = set()
        self.sealed_without: deque[tuple[int, str]] = deque(maxlen=64)
        """(version, why) of the newest snapshots sealed without the framework's section: ``cancelled`` (the next
        step's snapshot came first), ``timeout`` (not posted in time), ``encode`` (the section did not encode)."""
        self._lock = threading.Lock()  # a step settles once: the worker's deadline and the main thread's post race

    def room(self) -> int:
        """Bytes a posted section may take (the headroom reserved for it)."""
        return self.headroom

    # -- main thread ----------------------------------------------------------------------------------
    def begin(self, version: int) -> LateStep:
        """At the snapshot of ``version``: an unposted earlier version is sealed without its section."""
        prev = self.current
        if prev is not None and self._settle(prev, "cancelled"):
            self.sealed_without.append((prev.version, "cancelled"))
            self._warn_once("cancelled", "snapshot of step %d sealed without the framework's late client state: the "
                            "next step's snapshot was taken first (its step-end hook did not run); a restore of that "
                            "step restores the engine but not the framework's bookkeeping", prev.version)
        step = self.current = LateStep(version)
        return step

    def post(self, version: int, value: dict[str, Any]) -> bool:
        """The framework's state once step ``version`` is done; False when no snapshot of that step waits for it."""
        step = self.current
        if step is None or step.version != version or step.outcome != "pending":
            return False
        return self._settle(step, "posted", value)  # encoded by the worker (wait), off the training thread

    def drop(self) -> None:
        """A failure before the post: the version in flight is never sealed (restores take the one before)."""
        step = self.current
        if step is not None:
            self._settle(step, "dropped")

    # -- worker ---------------------------------------------------------------------------------------
    def wait(self, step: LateStep, replaced: Callable[[], bool]) -> Any:
        """(worker) The encoded section to seal with, None to seal without it; raises :class:`LateDropped` when the
        version must not be sealed (dropped, or the worker was replaced at a hot-swap)."""
        deadline = time.monotonic() + self.timeout_s
        while not step.event.wait(POLL_S):
            if replaced():
                raise LateDropped(f"snapshot of step {step.version}: replaced at a hot-swap while it waited for the "
                                  "framework's step-end state; not sealed")
            if time.monotonic() > deadline and self._settle(step, "cancelled"):
                self.sealed_without.append((step.version, "timeout"))
                self._warn_once("timeout", "snapshot of step %d sealed without the framework's late client state: "
                                "not posted within %.0f s (replication.timeout_s)", step.version, self.timeout_s)
                break
        if step.outcome == "dropped":
            raise LateDropped(f"snapshot of step {step.version} dropped: the step failed before its state was whole")
        if step.outcome != "posted":
            return None
        try:
            return encode(step.value)
        except ValueError as exc:
            self.sealed_without.append((step.version, "encode"))
            self._warn_once("encode", "snapshot of step %d sealed without the framework's late client state: %s",
                            step.version, exc)
            return None

    # -- restore --------------------------------------------------------------------------------------
    def restored(self, meta: dict[str, Any], version: int) -> None:
        """Hand the section of the restored version's header back (None when it was sealed without one)."""
        raw = meta.get(LATE_KEY)
        value = None
        if raw is not None:
            try:
                value = decode(raw)
            except Exception as exc:  # noqa: BLE001 - a malformed section is said, never the reason a restore fails
                log.warning("snapshot of step %d: its late client state does not decode (%s); restored without it",
                            version, exc)
        self.restored_cb(value)

    def _settle(self, step: LateStep, outcome: str, value: Any = None) -> bool:
        """Move a pending step to ``outcome`` (once; False when it had settled already)."""
        with self._lock:
            if step.outcome != "pending":
                return False
            step.value, step.outcome = value, outcome
        step.event.set()
        return True

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


class LateDropped(RuntimeError):
    """The worker must not seal this version (it was dropped, or the worker replaced)."""
