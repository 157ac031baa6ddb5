"""Megatron-Core on a machine without CUDA: ``torch.cuda.current_device()`` answers ``cpu``.

Why: Megatron-Core 0.16 allocates its buffers with ``device=torch.cuda.current_device()`` (the DDP grad
buffers, tensor-parallel gathers, the GPT model's rotary/attention scratch, dist_checkpointing's failure
flags). On a CPU build of torch that call raises "Torch not compiled with CUDA enabled". Answering
``torch.device("cpu")`` puts exactly those buffers on the CPU, where the rest of the model already lives.

Refuses on a machine with CUDA: there the real answer is needed, and silently moving Megatron's buffers to
the CPU would be wrong.
"""
from __future__ import annotations

import torch

from .base import Patch

SUPPORTED_MEGATRON_CORE = "==0.16.*"
SUPPORTED_TORCH = ">=2.6,<2.14"


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


class CpuCurrentDevice(Patch):
    name = "megatron_core_cpu_device"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE, "torch": SUPPORTED_TORCH}
    why = "torch.cuda.current_device() -> cpu, for Megatron-Core buffer allocation without CUDA"

    def _check_environment(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(f"patch {self.name}: CUDA is available; this shim is only for machines without it")

    def _apply(self) -> None:
        self._swap(torch.cuda, "current_device", _cpu_current_device)


PATCH = CpuCurrentDevice()
apply = PATCH.apply
revert = PATCH.revert
