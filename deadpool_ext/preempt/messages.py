"""The drain's store values, defined once: what the writer builds and the bounded decoder its readers use.

``launcher/keys.py`` names the keys and points at these schemas (``DRAIN``, ``DRAINED``, ``JOB_GRACE``); every value
is read through ``launcher/values.py``'s bounded JSON decoder, so a wrong value written by anyone holding the job's
token reads as absent (one warning), never as a drain that did not happen or a step that is not safe.

- ``drain`` (:class:`DrainRequest`): a launcher that got SIGTERM, or a worker that got one itself (first writer
  wins, ``compare_set``); read by every worker's watcher (``preempt/worker.py``) and every launcher.
- ``drained`` (:class:`DrainOutcome`): rank 0 once its drain is decided (persisted and verified, or why not); read by
  every launcher for its final line.
- ``config/preempt_grace_s``: the job's ``deadpool.preemption.grace_s``, written by rank 0 at attach; read by the
  launcher when no ``--preempt-grace-s`` was given.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..config import MAX_PATH, MAX_SECONDS
from ..launcher import values

MAX_WHY = 300
"""Longest text of a request's origin or an outcome's reason."""
MAX_STEP = 1 << 62


def _obj(key: str, raw: bytes, allowed: set[str]) -> dict[str, Any]:
    d = values.decode_json(key, raw)
    if not isinstance(d, dict):
        raise values.BadValue(key, f"must be a JSON object, got {values.echo(d)}")
    extra = sorted(set(d) - allowed)
    if extra:
        raise values.BadValue(key, f"unknown field(s) {extra} (allowed: {', '.join(sorted(allowed))})")
    return d


def _text(key: str, field: str, v: object, limit: int = MAX_WHY) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise values.BadValue(key, f"{field!r} must be a string of at most {limit} characters, got {values.echo(v)}")
    return v


def _seconds(key: str, field: str, v: object) -> float:
    f = values._num(key, field, v)
    if not 0 < f <= MAX_SECONDS:
        raise values.BadValue(key, f"{field!r} must be in (0, {MAX_SECONDS}] seconds, got {values.echo(v)}")
    return f


def _step(key: str, field: str, v: object) -> int | None:
    return None if v is None else values._int(key, field, v, 0, MAX_STEP)


@dataclass(frozen=True, slots=True)
class DrainRequest:
    """``drain``: a preemption was noticed at ``requested_at`` (the noticing process's clock) by ``by`` ("SIGTERM to
    the launcher of host 0", "SIGTERM to worker node1.0"). The budget is not in it: every process resolves it the
    same way (``decide.resolve_grace``: the launcher's flag, handed to workers, else the job's config)."""

    requested_at: float
    by: str

    def to_json(self) -> dict[str, Any]:
        return {"requested_at": float(self.requested_at), "by": self.by[:MAX_WHY]}


def drain_request(key: str, raw: bytes) -> DrainRequest:
    """``drain``: ``{"requested_at": t, "by": text}``; nothing else."""
    d = _obj(key, raw, {"requested_at", "by"})
    return DrainRequest(values._num(key, "requested_at", d.get("requested_at")), _text(key, "by", d.get("by")))


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    """``drained``: what the drain did, as rank 0 saw it (``decide.Outcome``'s fields, and the total bytes)."""

    step: int | None
    persisted: int | None
    safe: int | None
    url: str | None
    seconds: float
    why: str
    nbytes: int = 0
    written_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "persisted": self.persisted, "safe": self.safe,
                "url": None if self.url is None else self.url[:MAX_PATH], "seconds": float(self.seconds),
                "why": self.why[:MAX_WHY], "nbytes": int(self.nbytes), "written_at": self.written_at or time.time()}


def drain_outcome(key: str, raw: bytes) -> DrainOutcome:
    """``drained``: ``{"step", "persisted", "safe": int or null, "url": text or null, "seconds", "why", "nbytes",
    "written_at"}``; nothing else."""
    d = _obj(key, raw, {"step", "persisted", "safe", "url", "seconds", "why", "nbytes", "written_at"})
    url = d.get("url")
    seconds = values._num(key, "seconds", d.get("seconds"))
    if not 0 <= seconds <= MAX_SECONDS:
        raise values.BadValue(key, f"'seconds' must be in [0, {MAX_SECONDS}], got {values.echo(seconds)}")
    return DrainOutcome(step=_step(key, "step", d.get("step")), persisted=_step(key, "persisted", d.get("persisted")),
                        safe=_step(key, "safe", d.get("safe")),
                        url=None if url is None else _text(key, "url", url, MAX_PATH), seconds=seconds,
                        why=_text(key, "why", d.get("why", "")),
                        nbytes=values._int(key, "nbytes", d.get("nbytes", 0), 0, MAX_STEP),
                        written_at=values._num(key, "written_at", d.get("written_at", 0.0)))


def grace_seconds(key: str, raw: bytes) -> float:
    """``config/preempt_grace_s``: a number of seconds in (0, MAX_SECONDS]."""
    return _seconds(key, "value", values.decode_json(key, raw))


__all__ = ["DrainOutcome", "DrainRequest", "drain_outcome", "drain_request", "grace_seconds"]
