"""The numerical canary's decisions (pure: no torch, no process group, no clock; unit-tested in
tests/unit/test_canary.py).

A restore whose checksums are valid can still hold bad values (a bit-exact copy of poisoned state passes every
checksum). The first ``canary.steps`` steps after a restore are therefore checked against bounds learned from the
run before it, and a version that fails is quarantined and the next older one restored
(``integrations/canary.py`` carries these decisions out):

- :class:`Bounds`: the recent losses and gradient norms, a small JSON record that travels in every snapshot's
  header (the runtime's client state), so a restarted process knows the bounds of the version it restored;
  :func:`learn` adds a step's values;
- :func:`judge`: a checked step's verdict;
- :func:`after_failure`: what a failed check leads to: quarantine the version and restore the next older one
  (:class:`Rollback`), or stop the job (:class:`Stop`: the crash-loop guard, or nothing older is left);
- :func:`older_versions`: which versions a restore may still choose, the quarantined left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CANARY_EXIT", "KEY", "Bounds", "Rollback", "Stop", "Verdict", "after_failure", "judge", "learn",
           "no_older_line", "older_versions"]

KEY = "deadpool/canary"
"""The bounds' key in a snapshot's client state (JSON, beside the script's own keys)."""
CANARY_EXIT = 6
"""The exit status of a job the canary stopped (crash-loop guard, or no older version to fall back to)."""
MAX_VALUES = 1000
"""The most values of each kind a record may carry (``canary.window`` is at most this)."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """The recent values of a run, newest last (finite values only)."""

    losses: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    @classmethod
    def from_json(cls, data: Any) -> Bounds | None:
        """The record of a snapshot's header, strictly: lists of at most :data:`MAX_VALUES` finite numbers; None
        for anything else (a record this version cannot read checks finiteness only)."""
        if not isinstance(data, dict) or set(data) != {"losses", "grad_norms"}:
            return None
        out: list[tuple[float, ...]] = []
        for name in ("losses", "grad_norms"):
            values = data[name]
            if not isinstance(values, list) or len(values) > MAX_VALUES or not all(_number(v) for v in values):
                return None
            out.append(tuple(float(v) for v in values))
        return cls(losses=out[0], grad_norms=out[1])


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def learn(b: Bounds, loss: float | None, grad_norm: float | None, window: int) -> Bounds:
    """``b`` with a step's values added (a value that is None or not finite is left out), the newest ``window``
    kept."""
    losses, norms = b.losses, b.grad_norms
    if loss is not None and math.isfinite(loss):
        losses = (*losses, float(loss))[-window:]
    if grad_norm is not None and math.isfinite(grad_norm):
        norms = (*norms, float(grad_norm))[-window:]
    return Bounds(losses=losses, grad_norms=norms)


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    why: str = ""


def judge(b: Bounds, loss: float | None, grad_norm: float | None, factor: float) -> Verdict:
    """A checked step: its loss and gradient norm (None: not measured, not checked) must be finite and their
    magnitude at most ``factor`` times the largest recent one ``b`` carries (no recent values: finite is
    enough)."""
    for name, value, recent in (("loss", loss, b.losses), ("gradient norm", grad_norm, b.grad_norms)):
        if value is None:
            continue
        if not math.isfinite(value):
            return Verdict(False, f"{name} {value}")
        if recent:
            bound = factor * max(abs(v) for v in recent)
            if abs(value) > bound:
                return Verdict(False, f"{name} {value:.6g} above {factor:g} x {max(abs(v) for v in recent):.6g} "
                                      f"(the largest of the {len(recent)} values before the restore)")
    return Verdict(True)


@dataclass(frozen=True, slots=True)
class Rollback:
    """Quarantine ``version`` in every tier, then restore the newest older version not quarantined."""

    version: int
    quarantined: tuple[int, ...]
    """Every version quarantined so far in this job, ``version`` included."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the job with :data:`CANARY_EXIT` and this one line."""

    version: int
    line: str


def after_failure(version: int, quarantined: tuple[int, ...], max_rollbacks: int, why: str,
                  step: int) -> Rollback | Stop:
    """A restored ``version`` failed its check at ``step`` (``why``); ``quarantined``: the versions this job
    quarantined before. Each failed version is quarantined; up to ``max_rollbacks`` of them the next older version is
    restored, after that the job stops (the crash-loop guard)."""
    now = tuple(sorted({*quarantined, version}))
    if len(now) > max_rollbacks:
        return Stop(version, f"deadpool_ext: the numerical canary stopped the job: step {step} after the restore of "
                             f"step {version} failed ({why}), and {len(now)} restored versions failed their check "
                             f"({', '.join(map(str, now))}: canary.max_rollbacks is {max_rollbacks}); the versions "
                             "are quarantined in every tier. Fix: load an older tier-3 base (--load), or raise "
                             "canary.factor if this is a genuine loss spike")
    return Rollback(version, now)


def no_older_line(version: int, step: int, why: str) -> str:
    """The job's last line when a failed version has no older one in memory to fall back to."""
    return (f"deadpool_ext: the numerical canary stopped the job: step {step} after the restore of step {version} "
            f"failed ({why}), and memory holds no older version to fall back to; step {version} is quarantined in "
            "every tier. Fix: load an older tier-3 base (--load)")


def older_versions(held: list[int], failed: int, quarantined: tuple[int, ...]) -> list[int]:
    """The versions a restore after quarantining ``failed`` may still choose, newest first: older than it and not
    quarantined."""
    return sorted((v for v in set(held) if v < failed and v not in quarantined), reverse=True)
