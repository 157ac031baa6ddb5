"""Differential checkpoints (TierCheck): what the optimizer consumed at each step, kept in memory tiers.

In differential mode (``"differential": {"enabled": true}``) the snapshot manager writes a full *base* into
the ping-pong slots every ``base_interval`` steps and, at every other step, a *differential*: the rank's
reduced, partitioned, clipped gradient of every master tensor (exactly what the inner optimizer read) plus
the step's hyper-parameters and the small state (counters, scheduler, RNG, data position). Restoring step v
= restoring base b <= v and replaying the differentials b+1..v (:mod:`deadpool_ext.recovery.replay`), bit for
bit. A differential is one gradient-sized tensor per master: for fp32 Adam, a quarter of the state.

Call order (every rank; the manager does this):

1. ``GradTap(adapter)`` once: wraps the inner optimizer's ``step`` so each call records the gradients and
   hyper-parameters it is about to consume (DeepSpeed ZeRO-3 calls it once per sub-group; the tap gathers
   all calls of one engine step).
2. After the engine step: ``take()`` returns the step's (gradients, hypers) and clears the tap.
3. The worker writes the differential into ring entry ``DiffRing.index(version)``, but only after
   ``DiffRing.check_reuse`` says the entry's old content is no longer needed (watermark GC, below).

The capture hazard and how it is avoided: the tap keeps *references* to the gradient tensors, copied by the
background worker during the next forward/backward. DeepSpeed ZeRO-1/2/3 hand the inner optimizer a freshly
flattened gradient partition every step and drop it afterwards, so nothing writes into it; gradients that
are views of longer-lived buffers (a single-tensor group; stage 0, where ``param.grad`` is reused) are
cloned at capture instead.

Watermark-driven garbage collection: ring entry ``v % K - 1`` is reused by step ``v + K``. Its old content
(differential ``v``) is needed only while no base newer than ``v`` is committed cluster-wide (every rank has
it). Bases are written at multiples of K, so one such base (``b`` in ``(v, v + K)``) was written before, by
the same sequential worker; ``check_reuse`` refuses the overwrite if that base's global commit did not
succeed, so the newest recoverable version is never freed.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..recovery.replay import AdamHyper, AdamTensors
from .state import RankStateAdapter, UnsupportedEngineError

log = logging.getLogger("deadpool_ext")


class GCError(RuntimeError):
    """Writing a differential would free the newest version recoverable cluster-wide."""


def _hyper(group: dict[str, Any], decoupled: bool) -> AdamHyper:
    beta1, beta2 = group["betas"]
    return AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                     weight_decay=float(group.get("weight_decay", 0.0)), decoupled=decoupled,
                     amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group.get("maximize", False)),
                     fused=bool(group.get("fused", False)))


class GradTap:
    """Records what the inner optimizer consumes at each step (see module docstring)."""

    def __init__(self, adapter: RankStateAdapter, compression: str = "none") -> None:
        inner = adapter.inner_optimizer()
        if not isinstance(inner, torch.optim.Adam) and not isinstance(inner, torch.optim.AdamW):
            raise UnsupportedEngineError(
                f"differential checkpoints replay Adam/AdamW steps, but the inner optimizer is {type(inner).__name__}. "
                "Use DeepSpeed's Adam/AdamW with \"torch_adam\": true, or turn deadpool.differential off")
        for g in inner.param_groups:
            if g.get("foreach") or g.get("capturable") or g.get("differentiable"):
                raise UnsupportedEngineError(
                    "differential checkpoints replay torch's single-tensor or fused Adam kernel; this optimizer was "
                    f"built with foreach/capturable/differentiable = "
                    f"{[g.get(k) for k in ('foreach', 'capturable', 'differentiable')]}: set \"fused\": true "
                    "(fastest replay) or leave those options unset")
        self.adapter = adapter
        self.inner = inner
        self.decoupled = isinstance(inner, torch.optim.AdamW) or bool(
            inner.param_groups[0].get("decoupled_weight_decay", False))
        self.compression = compression
        self.clone_always = getattr(adapter, "zero_stage", 1) == 0
        self._pending: dict[int, tuple[torch.Tensor, AdamHyper]] = {}
        self._orig = inner.step
        # instance attribute: the class and other optimizers are untouched
        inner.step = self._step  # type: ignore[method-assign]

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        index = {id(t): i for i, t in enumerate(self.adapter.masters())}
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = index.get(id(p))
                if i is None:
                    raise UnsupportedEngineError("the inner optimizer updates a tensor that is not a snapshot "
                                                 "master; differential checkpoints cannot replay it")
                grad = p.grad
                if self.compression == "bf16":
                    grad = grad.to(torch.bfloat16)
                elif self.clone_always or grad._base is not None:
                    grad = grad.detach().clone()
                self._pending[i] = (grad.detach(), _hyper(group, self.decoupled))
        return self._orig(*args, **kwargs)

    def take(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Gradients (``grad.<i>``) and JSON hypers of the step just taken; empty when the optimizer did not
        run (e.g. an fp16 overflow skipped it)."""
        pending, self._pending = self._pending, {}
        tensors = {f"grad.{i}": g for i, (g, _) in sorted(pending.items())}
        hypers = {str(i): h.to_json() for i, (_, h) in sorted(pending.items())}
        return tensors, hypers

    def discard(self) -> None:
        self._pending = {}

    def remove(self) -> None:
        if self.inner.step == self._step:
            del self.inner.step


class DiffRing:
    """Which ring entry a differential goes to, and whether its old content may be freed (pure logic)."""

    def __init__(self, base_interval: int) -> None:
        self.k = base_interval
        self.size = base_interval - 1
        """Entries: versions that are multiples of K are always bases, so K - 1 entries hold the rest."""
        self.versions: dict[int, int] = {}
        """ring entry -> differential version it holds (complete)."""

    def index(self, version: int) -> int:
        if version % self.k == 0:
            raise ValueError(f"version {version} is a multiple of the base interval {self.k}: always a base")
        return version % self.k - 1

    def check_reuse(self, version: int, committed_base: int | None) -> None:
        old = self.versions.get(self.index(version))
        if old is None or old >= version:
            return
        if committed_base is None or committed_base < old:
            raise GCError(f"differential {version} would overwrite differential {old}, still needed: the newest "
                          f"base committed on every rank is {committed_base}. Refusing to free the newest "
                          "recoverable version (a base write failed on some rank)")

    def stored(self, version: int) -> None:
        self.versions[self.index(version)] = version

    def forget(self, version: int) -> None:
        if self.versions.get(self.index(version)) == version:
            del self.versions[self.index(version)]


def replay_targets(adapter: RankStateAdapter) -> list[AdamTensors]:
    """The live Adam state of every master, in master order (after a base restore)."""
    inner = adapter.inner_optimizer()
    out = []
    for i, t in enumerate(adapter.masters()):
        st = inner.state.get(t, {})
        if "exp_avg" not in st:
            raise RuntimeError(f"master {i} has no Adam state: the base predates the first optimizer step")
        step = st["step"]
        if not torch.is_tensor(step):
            st["step"] = step = torch.tensor(float(step))
        out.append(AdamTensors(param=t.data, exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], step=step,
                               max_exp_avg_sq=st.get("max_exp_avg_sq")))
    return out
