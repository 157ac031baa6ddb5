"""Megatron-Core on a machine without CUDA: ``torch.cuda.synchronize()`` is a no-op.

Why: ``megatron.core.dist_checkpointing`` (torch_dist strategy, fully-parallel wrappers, async save) calls
``torch.cuda.synchronize()`` to make sure device tensors are final before it reads them, and the pipeline
schedules' point-to-point exchange calls it after ``batch_isend_irecv``; on a CPU build the call raises.
Without CUDA there is no asynchronous device work to wait for, so doing nothing is exact.
(Its ``torch.cuda.current_device()`` calls are covered by ``megatron_core_cpu_device``.)
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Patch
from .megatron_core_cpu_device import SUPPORTED_MEGATRON_CORE, SUPPORTED_TORCH


def _no_device_work(device: Any = None) -> None:
    return None


class CpuSynchronize(Patch):
    name = "megatron_core_cpu_synchronize"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE, "torch": SUPPORTED_TORCH}
    why = "torch.cuda.synchronize() -> no-op, for dist_checkpointing and pipeline p2p without CUDA"

    def _check_environment(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(f"patch {self.name}: CUDA is available; this shim is only for machines without it")

    def _apply(self) -> None:
        self._swap(torch.cuda, "synchronize", _no_device_work)


PATCH = CpuSynchronize()
apply = PATCH.apply
revert = PATCH.revert
