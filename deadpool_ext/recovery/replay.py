"""Replaying optimizer steps from differential checkpoints, bit for bit.

A differential of step ``s`` holds what the optimizer consumed at that step: the rank's reduced, partitioned
(and clipped) gradient of every master tensor, and the step's hyper-parameters (learning rate after the
scheduler, betas, eps, weight decay). Applying the same update rule to the base state reproduces the state
after step ``s`` exactly, because every operation of the rule is elementwise and deterministic on the host:
the result of an element does not depend on which other elements are processed with it.

Supported rules: Adam / AdamW as ``torch.optim.Adam`` computes them, including ``amsgrad``, ``maximize`` and
both weight-decay modes, in two flavours recorded per step (``AdamHyper.fused``):

- the single-tensor path (DeepSpeed's ``torch_adam`` default on CPU): the operation sequence below mirrors
  ``torch.optim.adam._single_tensor_adam`` of torch 2.4-2.13;
- torch's fused kernel (``"fused": true`` in the DeepSpeed optimizer params): replay calls the same kernel
  (``torch._fused_adam_`` / ``torch._fused_adamw_``) with the same scalars. The kernel is elementwise, so running
  it on cache-sized slices of the tensors gives the same bits as running it on the whole tensors.

``tests/unit/test_replay.py`` checks both bit for bit against the real optimizer, so a torch upgrade that changes
a rule fails loudly.

Two implementations, same results:

- :func:`replay_naive`: one step at a time, each operation over whole tensors (what re-running the optimizer
  step would do). Every step streams every state tensor through memory ~8 times.
- :func:`replay_fused`: multi-step and cache-blocked. The tensors are cut into chunks small enough to stay in
  the CPU cache; for each chunk *all* N steps are applied before moving on, and the chunks of all tensors are
  processed with multi-tensor (``torch._foreach_*``) operations in bounded batches. State is read and written
  once per batch of steps instead of once per step. (apex ``multi_tensor_applier`` is the GPU analogue; on
  CPU it is not available and not needed.)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class AdamHyper:
    """Hyper-parameters of one optimizer step for one parameter group (as recorded at that step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    decoupled: bool = False
    """AdamW-style decay (``param *= 1 - lr * wd``) instead of L2 added to the gradient."""
    amsgrad: bool = False
    maximize: bool = False
    fused: bool = False
    """The step ran torch's fused Adam kernel (``fused=True``); replay runs the same kernel."""

    def to_json(self) -> dict[str, float | bool]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AdamHyper:
        # Keys added after a differential was written take their defaults (older blobs had no ``fused``).
        return cls(**{k: d[k] for k in cls.__slots__ if k in d})


@dataclass(kw_only=True, slots=True)
class AdamTensors:
    """Live optimizer state of one master tensor; replay updates it in place."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """Adam's step counter (a 0-d tensor, as torch keeps it)."""
    max_exp_avg_sq: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class StepDiff:
    """One step's differential for the tensors of :class:`AdamTensors` lists, aligned by index."""

    grads: Sequence[torch.Tensor]
    hypers: Sequence[AdamHyper]


def _check(states: Sequence[AdamTensors], diffs: Sequence[StepDiff]) -> None:
    for k, d in enumerate(diffs):
        if len(d.grads) != len(states) or len(d.hypers) != len(states):
            raise ValueError(f"differential {k} covers {len(d.grads)} tensors, the optimizer has {len(states)}")
        for i, (g, s) in enumerate(zip(d.grads, states)):
            if g.shape != s.param.shape or g.dtype != s.param.dtype:
                raise ValueError(f"differential {k}, tensor {i}: gradient {tuple(g.shape)}/{g.dtype} does not "
                                 f"match the master {tuple(s.param.shape)}/{s.param.dtype}")
        for i, (h, s) in enumerate(zip(d.hypers, states)):
            if h.amsgrad and s.max_exp_avg_sq is None:
                raise ValueError(f"differential {k}, tensor {i}: amsgrad step but no max_exp_avg_sq state")
            if h.fused != diffs[0].hypers[i].fused:
                raise ValueError(f"differential {k}, tensor {i}: the optimizer switched between the fused and the "
                                 "single-tensor Adam kernel inside one chain")


def _fused_kernel_step(p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
                       vmax: list[torch.Tensor], steps: list[torch.Tensor], h: AdamHyper) -> None:
    """One step of torch's fused Adam over tensor lists, as ``torch.optim.adam._fused_adam`` calls it."""
    torch._foreach_add_(steps, 1)
    fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    fn(p, g, m, v, vmax if h.amsgrad else [], steps, amsgrad=h.amsgrad, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
       weight_decay=h.weight_decay, eps=h.eps, maximize=h.maximize, grad_scale=None, found_inf=None)


def _scalars(h: AdamHyper, step: float) -> tuple[float, float]:
    bias_correction1 = 1 - h.beta1 ** step
    bias_correction2 = 1 - h.beta2 ** step
    return h.lr / bias_correction1, bias_correction2 ** 0.5


def replay_naive(states: Sequence[AdamTensors], diffs: Sequence[StepDiff]) -> None:
    """Apply ``diffs`` in order, one whole-tensor step at a time."""
    _check(states, diffs)
    with torch.no_grad():
        for d in diffs:
            for s, grad, h in zip(states, d.grads, d.hypers):
                if h.fused:
                    vmax = [cast(torch.Tensor, s.max_exp_avg_sq)] if h.amsgrad else []  # (_check)
                    _fused_kernel_step([s.param], [grad], [s.exp_avg], [s.exp_avg_sq], vmax, [s.step], h)
                    continue
                if h.maximize:
                    grad = -grad
                s.step += 1
                if h.weight_decay != 0:
                    if h.decoupled:
                        s.param.mul_(1 - h.lr * h.weight_decay)
                    else:
                        grad = grad.add(s.param, alpha=h.weight_decay)
                s.exp_avg.lerp_(grad, 1 - h.beta1)
                s.exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
                step_size, bc2_sqrt = _scalars(h, float(s.step.item()))
                if h.amsgrad:
                    vm = cast(torch.Tensor, s.max_exp_avg_sq)  # present for every amsgrad step (_check)
                    torch.maximum(vm, s.exp_avg_sq, out=vm)
                    denom = (vm.sqrt() / bc2_sqrt).add_(h.eps)
                else:
                    denom = (s.exp_avg_sq.sqrt() / bc2_sqrt).add_(h.eps)
                s.param.addcdiv_(s.exp_avg, denom, value=-step_size)


def replay_fused(states: Sequence[AdamTensors], diffs: Sequence[StepDiff], *, chunk_elems: int = 1 << 14,
                 batch_chunks: int = 8, kernel_batch_elems: int = 1 << 20) -> None:
    """Apply ``diffs`` in order: for each group of ``batch_chunks`` cache-sized chunks, every step, with
    multi-tensor operations. Same results as :func:`replay_naive`, bit for bit.

    Tensors trained with torch's fused kernel go through it in batches of ``kernel_batch_elems`` elements (one
    kernel call per step and batch; larger batches amortise the call, 1M elements measured fastest here)."""
    _check(states, diffs)
    if not diffs:
        return
    kernel = [i for i, h in enumerate(diffs[0].hypers) if h.fused]
    if kernel:
        _replay_fused_kernel([states[i] for i in kernel],
                             [StepDiff(grads=[d.grads[i] for i in kernel], hypers=[d.hypers[i] for i in kernel])
                              for d in diffs], chunk_elems=kernel_batch_elems)
        rest = [i for i, h in enumerate(diffs[0].hypers) if not h.fused]
        if not rest:
            return
        states = [states[i] for i in rest]
        diffs = [StepDiff(grads=[d.grads[i] for i in rest], hypers=[d.hypers[i] for i in rest]) for d in diffs]
    start_steps = [float(s.step.item()) for s in states]
    chunks, flat, grads = _flat_views(states, diffs, chunk_elems)
    with torch.no_grad():
        for b in range(0, len(chunks), batch_chunks):
            batch = chunks[b:b + batch_chunks]
            p = [flat[i][0][a:e] for i, a, e in batch]
            m = [flat[i][1][a:e] for i, a, e in batch]
            v = [flat[i][2][a:e] for i, a, e in batch]
            vmax = [fm[a:e] if (fm := flat[i][3]) is not None else None for i, a, e in batch]
            for k, d in enumerate(diffs):
                hs = [d.hypers[i] for i, _, _ in batch]
                g = [grads[k][i][a:e] for i, a, e in batch]
                if any(h.maximize for h in hs):
                    g = [-x if h.maximize else x for x, h in zip(g, hs)]
                decay = [(j, h) for j, h in enumerate(hs) if h.weight_decay != 0]
                for j, h in decay:
                    if h.decoupled:
                        p[j].mul_(1 - h.lr * h.weight_decay)
                    else:
                        g[j] = g[j].add(p[j], alpha=h.weight_decay)
                _foreach_by_scalar(torch._foreach_lerp_, m, g, [1 - h.beta1 for h in hs])
                _foreach_by_scalar(torch._foreach_mul_, v, None, [h.beta2 for h in hs])
                _foreach_by_scalar(torch._foreach_addcmul_, v, (g, g), [1 - h.beta2 for h in hs])
                sc = [_scalars(h, start_steps[i] + k + 1) for h, (i, _, _) in zip(hs, batch)]
                # vmax[j] is a tensor for every amsgrad step (_check)
                src = [cast(torch.Tensor, vmax[j]) if h.amsgrad else v[j] for j, h in enumerate(hs)]
                for j, h in enumerate(hs):
                    if h.amsgrad:
                        torch.maximum(cast(torch.Tensor, vmax[j]), v[j], out=vmax[j])
                denom = torch._foreach_sqrt(src)
                _foreach_by_scalar(torch._foreach_div_, denom, None, [c[1] for c in sc])
                _foreach_by_scalar(torch._foreach_add_, denom, None, [h.eps for h in hs])
                _foreach_by_scalar(torch._foreach_addcdiv_, p, (m, denom), [-c[0] for c in sc])
        for s in states:
            s.step += len(diffs)


_FlatState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Flat views of (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None)."""


def _flat_views(states: Sequence[AdamTensors], diffs: Sequence[StepDiff], chunk_elems: int) -> tuple[
        list[tuple[int, int, int]], list[_FlatState], list[list[torch.Tensor]]]:
    """(tensor index, start, end) of every ``chunk_elems`` slice in order; flat views of each tensor's
    (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None); flat views of every differential's gradients."""
    chunks = [(i, a, min(a + chunk_elems, s.param.numel())) for i, s in enumerate(states)
              for a in range(0, s.param.numel(), chunk_elems)]
    flat = [(s.param.view(-1), s.exp_avg.view(-1), s.exp_avg_sq.view(-1),
             s.max_exp_avg_sq.view(-1) if s.max_exp_avg_sq is not None else None) for s in states]
    return chunks, flat, [[g.view(-1) for g in d.grads] for d in diffs]


def _replay_fused_kernel(states: Sequence[AdamTensors], diffs: Sequence[StepDiff], *, chunk_elems: int) -> None:
    """Tensors whose steps ran torch's fused kernel: cut into slices of about ``chunk_elems`` elements, grouped
    into batches of that many elements; for each batch, every step is one multi-tensor kernel call per distinct
    set of hyper-parameters. A batch stays in cache across its N steps."""
    pieces, flat, grads = _flat_views(states, diffs, chunk_elems)
    batches: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for piece in pieces:
        if size and size + piece[2] - piece[1] > chunk_elems:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += piece[2] - piece[1]
    with torch.no_grad():
        for batch in batches:
            p = [flat[i][0][a:e] for i, a, e in batch]
            m = [flat[i][1][a:e] for i, a, e in batch]
            v = [flat[i][2][a:e] for i, a, e in batch]
            vmax = [fm[a:e] if (fm := flat[i][3]) is not None else None for i, a, e in batch]
            steps = [states[i].step.detach().clone() for i, _, _ in batch]
            for k, d in enumerate(diffs):
                groups: dict[AdamHyper, list[int]] = {}
                for j, (i, _, _) in enumerate(batch):
                    groups.setdefault(d.hypers[i], []).append(j)
                for h, js in groups.items():
                    _fused_kernel_step([p[j] for j in js], [grads[k][batch[j][0]][batch[j][1]:batch[j][2]] for j in js],
                                       [m[j] for j in js], [v[j] for j in js],
                                       [cast(torch.Tensor, vmax[j]) for j in js] if h.amsgrad else [],
                                       [steps[j] for j in js], h)
    for s in states:
        s.step += len(diffs)


def _foreach_by_scalar(op: Callable[..., Any], targets: Sequence[torch.Tensor],
                       others: Sequence[torch.Tensor] | tuple[Sequence[torch.Tensor], ...] | None,
                       scalars: list[float]) -> None:
    """``op`` over the batch with one scalar per tensor. Batches whose tensors share the scalar (the usual
    case: one parameter group) take the single-scalar overload, which is one call."""
    args = [] if others is None else (list(others) if isinstance(others, tuple) else [others])
    if all(x == scalars[0] for x in scalars):
        op(targets, *args, scalars[0])
        return
    for j, t in enumerate(targets):  # mixed groups in one batch: per tensor, same kernels
        op([t], *[[a[j]] for a in args], scalars[j])

