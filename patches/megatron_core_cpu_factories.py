"""Megatron-Core on a machine without CUDA: tensors it creates with a literal ``device="cuda"`` go to the CPU.

Why: besides ``torch.cuda.current_device()`` (see ``megatron_core_cpu_device``), Megatron-Core 0.16 creates a
few small tensors with a hard-coded ``device="cuda"`` on the training path: the token counter of every
pipeline schedule, the fp32 optimizer's loss scale, the grad-norm scratch of ``clip_grads``, the default
causal mask, the rerun state machine's flags, dist_checkpointing's exchange buffers. On a CPU build each of
those raises.

How: in exactly the modules listed in ``MODULES`` (and nowhere else), the module-global name ``torch`` is
replaced by a read-only proxy of the real ``torch`` module whose tensor factories (``tensor``, ``zeros``,
``ones``, ``empty``, ``full``, ``empty_like``, ``zeros_like``) rewrite a CUDA ``device`` argument to ``cpu``.
Every other attribute is the real one. Revert puts the real module back. The rest of the process, and
every other module, keep the real ``torch``.
"""
from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

from .base import Patch
from .megatron_core_cpu_device import SUPPORTED_MEGATRON_CORE, SUPPORTED_TORCH

MODULES: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
)
"""Megatron-Core modules (0.16) with a literal ``device="cuda"`` on the training or checkpoint path."""

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "empty_like", "zeros_like", "ones_like")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # pinning needs CUDA too
        return factory(*args, **kwargs)

    return make


class _CpuTorch(types.ModuleType):
    """Proxy of ``torch`` for the listed modules: factories redirected, everything else forwarded."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:  # only called for names not set in __init__
        return getattr(torch, name)


class CpuDeviceFactories(Patch):
    name = "megatron_core_cpu_factories"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE, "torch": SUPPORTED_TORCH}
    why = 'device="cuda" tensor factories in Megatron-Core schedules/optimizer/clip_grads/masks -> cpu'

    def _check_environment(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(f"patch {self.name}: CUDA is available; this shim is only for machines without it")

    def _apply(self) -> None:
        proxy = _CpuTorch()
        for name in MODULES:
            module = importlib.import_module(name)
            if getattr(module, "torch", None) is not torch:
                raise RuntimeError(f"patch {self.name}: {name}.torch is not the torch module; refusing to patch")
            self._swap(module, "torch", proxy)


PATCH = CpuDeviceFactories()
apply = PATCH.apply
revert = PATCH.revert
