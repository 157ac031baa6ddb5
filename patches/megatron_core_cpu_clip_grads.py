"""Megatron-Core on a machine without CUDA: gradient clipping accepts CPU gradients.

Why: ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (0.16) asserts
``param.grad.type() == 'torch.cuda.FloatTensor'`` before scaling the gradients, so every optimizer step with
``clip_grad > 0`` fails on the CPU. The replacement keeps the same contract and arithmetic (fp32 gradients,
``clip_coeff = max_norm / (total_norm + 1e-6)``, each gradient multiplied in place when ``clip_coeff < 1``,
which is what Megatron's CPU fallback ``local_multi_tensor_scale`` computes) and asserts fp32 instead of
CUDA fp32. Replaced in both the defining module and ``megatron.core.optimizer.optimizer``, which imported
the name.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .base import Patch
from .megatron_core_cpu_device import SUPPORTED_MEGATRON_CORE, SUPPORTED_TORCH


def clip_grad_by_total_norm_fp32_cpu(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                                     total_norm: float, use_decoupled_grad: bool = False) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if (grad.dtype not in (torch.float32, torch.bfloat16)
                or (not use_decoupled_grad and grad.dtype != torch.float32)):
            raise AssertionError(f"clip_grad_by_total_norm_fp32: gradient of dtype {grad.dtype}, expected float32")
        grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.copy_(g * clip_coeff)


class CpuClipGrads(Patch):
    name = "megatron_core_cpu_clip_grads"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE, "torch": SUPPORTED_TORCH}
    why = "clip_grad_by_total_norm_fp32 without its CUDA tensor-type assertion"

    def _check_environment(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(f"patch {self.name}: CUDA is available; this shim is only for machines without it")

    def _apply(self) -> None:
        from megatron.core.optimizer import clip_grads, optimizer

        self._swap(clip_grads, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32_cpu)
        self._swap(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32_cpu)


PATCH = CpuClipGrads()
apply = PATCH.apply
revert = PATCH.revert
