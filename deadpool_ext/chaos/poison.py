"""The ``poison`` fault: a snapshot whose checksums are valid but whose values are bad (a test harness's fault, like
:mod:`.at_step`: never reachable from a job's config).

``DEADPOOL_POISON=step=S,scale=K,marker=PATH``: on every rank, the snapshot of step S has every floating-point
tensor multiplied by K (the optimizer's masters and state, and the parameters a restore re-derives from them, so
that the re-derived ones still match their checksums) *before* it is handed to the writer, which copies,
checksums and seals it as usual. The live training state is untouched: the run goes on, and only a restore of
step S gets the poisoned values. With a power of two for K the scaled values are exact in every float dtype, so a
poisoned copy is consistent (the derived parameters' checksums hold) and passes every check a restore makes.
``marker``: ``PATH.r<rank>`` is created when the rank poisons (once per job per rank).

Installed by ``boot/sitecustomize.py`` on the ``before_seal`` hook point (:mod:`deadpool_ext.hooks`);
:func:`deadpool_ext.chaos.at_step.harness_env` puts the boot folder on ``PYTHONPATH``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("deadpool_ext")

ENV = "DEADPOOL_POISON"


@dataclass(frozen=True, slots=True)
class Poison:
    step: int
    scale: float
    marker: str

    @classmethod
    def parse(cls, spec: str) -> Poison:
        fields: dict[str, str] = {}
        for item in filter(None, spec.strip().split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in ("step", "scale", "marker"):
                raise ValueError(f"{ENV}={spec!r}: unknown or malformed field {item!r} (allowed: step=INT, "
                                 "scale=NUMBER, marker=PATH)")
            fields[key] = value
        if {"step", "marker"} - set(fields):
            raise ValueError(f"{ENV}={spec!r}: step and marker are required")
        try:
            step, scale = int(fields["step"]), float(fields.get("scale", "16"))
        except ValueError as exc:
            raise ValueError(f"{ENV}={spec!r}: step must be an integer and scale a number") from exc
        if step < 1:
            raise ValueError(f"{ENV}={spec!r}: step must be >= 1")
        return cls(step, scale, fields["marker"])

    def render(self) -> str:
        return f"step={self.step},scale={self.scale:g},marker={self.marker}"

    def before_seal(self, version: int, rank: int, snapshot: Any, **_: Any) -> None:
        if version != self.step:
            return
        try:
            fd = os.open(f"{self.marker}.r{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        os.close(fd)
        snapshot.tensors = [_scaled(t, self.scale) for t in snapshot.tensors]
        snapshot.derived = [(name, _scaled(t, self.scale)) for name, t in snapshot.derived]
        log.warning("fault injection (%s): the snapshot of step %d on rank %d poisoned (x %g) before sealing", ENV,
                    version, rank, self.scale)


def _scaled(t: Any, scale: float) -> Any:
    return t.detach().clone().mul_(scale) if t.is_floating_point() else t


def install() -> bool:
    """Register the poison this process's environment names (``boot/sitecustomize.py``); whether it did."""
    spec = os.environ.get(ENV, "")
    if not spec.strip():
        return False
    from .. import hooks

    hooks.register(hooks.BEFORE_SEAL, Poison.parse(spec).before_seal)
    return True
