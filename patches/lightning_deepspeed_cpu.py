"""Lightning's ``DeepSpeedStrategy`` on DeepSpeed's CPU accelerator.

Why: DeepSpeed trains on CPU (``DS_ACCELERATOR=cpu``: gloo, its CPU Adam), but Lightning's strategy refuses any
accelerator but CUDA in three places: ``setup_environment`` raises ("The DeepSpeed strategy is only supported on
CUDA GPUs"), ``setup_distributed`` checks that device indices equal local ranks (a CPU device has no index), and
``deepspeed.initialize`` is called with ``args.device_rank = root_device.index`` (None on CPU, which DeepSpeed
compares with 0). With the accelerator a ``CPUAccelerator``, the patch skips the first two checks (the rest of
``setup_environment`` / ``setup_distributed`` runs as Lightning wrote it) and hands DeepSpeed the local rank as
``device_rank``; on CUDA nothing changes.

Applied by ``python -m deadpool_ext.run`` / ``deadpool-run`` only when DeepSpeed's accelerator is the CPU (the
job asked DeepSpeed for CPU), with a log line; the test harness applies it for the reference runs of the same
script under plain ``torchrun`` (``deadpool_ext.testing.lightning_cpu``). Tested with lightning 2.6.
This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from .base import Patch


class _NamespaceWithDeviceRank:
    """``argparse`` as the strategy module sees it: ``Namespace(device_rank=None)`` (a CPU device has no index)
    becomes ``Namespace(device_rank=<LOCAL_RANK>)``, the launcher's local rank, which Lightning's own device index
    equals on GPUs (DeepSpeed's CPU accelerator maps every index to "cpu"); everything else is ``argparse``."""

    def Namespace(self, **kwargs: Any) -> argparse.Namespace:  # noqa: N802 - argparse's name
        if "device_rank" in kwargs and kwargs["device_rank"] is None:
            kwargs["device_rank"] = int(os.environ.get("LOCAL_RANK", "0"))
        return argparse.Namespace(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(argparse, name)


class LightningDeepSpeedCPU(Patch):
    name = "lightning_deepspeed_cpu"
    requires = {"lightning": ">=2.6,<2.7"}
    why = "Lightning's DeepSpeedStrategy runs on DeepSpeed's CPU accelerator"

    def _apply(self) -> None:
        from lightning.pytorch.accelerators.cpu import CPUAccelerator
        from lightning.pytorch.strategies import deepspeed as module
        from lightning.pytorch.strategies.ddp import DDPStrategy

        cls = module.DeepSpeedStrategy
        setup_environment, setup_distributed = cls.setup_environment, cls.setup_distributed
        on_cpu = lambda s: isinstance(s.accelerator, CPUAccelerator)  # noqa: E731

        @functools.wraps(setup_environment)
        def _setup_environment(self: Any) -> None:
            if not on_cpu(self):
                return setup_environment(self)
            return DDPStrategy.setup_environment(self)  # what DeepSpeedStrategy's own does after its CUDA check

        @functools.wraps(setup_distributed)
        def _setup_distributed(self: Any) -> None:
            if not on_cpu(self):
                return setup_distributed(self)
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()  # the rest of DeepSpeedStrategy.setup_distributed, without the device index check
            self.set_world_ranks()
            self._init_deepspeed_distributed()
            return None

        self._swap(cls, "setup_environment", _setup_environment)
        self._swap(cls, "setup_distributed", _setup_distributed)
        self._swap(module, "argparse", _NamespaceWithDeviceRank())


PATCH = LightningDeepSpeedCPU()
apply = PATCH.apply
revert = PATCH.revert
