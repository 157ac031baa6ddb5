"""Which optimizer wrapper a DeepSpeed engine built, and where that wrapper keeps a rank's tensors.

DeepSpeed picks the wrapper from the config (``engine._do_optimizer_sanity_check``, DeepSpeed 0.19):

=====================================================  ==========================================================
config                                                 ``engine.optimizer``
=====================================================  ==========================================================
ZeRO 1/2 (any precision; bf16 ZeRO-2 with fp32 accum)   ``DeepSpeedZeroOptimizer``
ZeRO 1, bf16, ``data_types.grad_accum_dtype: fp32``     ``BF16_Optimizer`` (not with CPU offload: then ZeRO)
ZeRO 3                                                 ``DeepSpeedZeroOptimizer_Stage3``
ZeRO 0, bf16 or fp16, the optimizer a ``FusedAdam``     ``FP16_Optimizer`` (flat buffers)
ZeRO 0, bf16 or fp16, any other optimizer               ``FP16_UnfusedOptimizer`` (one master per parameter)
ZeRO 0, bf16, pipeline engine                          ``BF16_Optimizer``
ZeRO 0, fp32                                           the torch optimizer itself
=====================================================  ==========================================================

(ZeRO 0 with bf16 parameters and ``grad_accum_dtype: fp32`` is refused by DeepSpeed itself: "unsupported mix".)

The dispatch goes by the wrapper's class first, then the stage: the same ZeRO stage can hold different wrappers
(ZeRO-1 holds ``BF16_Optimizer`` or ``DeepSpeedZeroOptimizer``). A wrapper this module does not know, or one
whose state lives outside host/device memory (NVMe offload), is refused when the extension attaches, with one
line naming the config keys that choose another (:class:`UnsupportedWrapperError`); the attributes read here are
checked against DeepSpeed's real classes by ``tests/unit/test_ds_wrappers.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import ConfigError
from ...snapshot.state import UnsupportedEngineError

SUPPORTED = ("ZeRO 1-3 (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3), BF16_Optimizer, "
             "FP16_Optimizer and FP16_UnfusedOptimizer (ZeRO 0 with bf16 or fp16), a torch optimizer at ZeRO 0 (fp32)")
KEYS = ("zero_optimization.stage, bf16.enabled, fp16.enabled, data_types.grad_accum_dtype, optimizer.type")


class UnsupportedWrapperError(ConfigError, UnsupportedEngineError):
    """The engine's optimizer wrapper cannot be snapshotted; ``str(exc)`` is one line naming the config keys that
    pick one that can. A ``ConfigError``: the runner prints it as one line and exits with status 2."""


def refuse(what: str, why: str, keys: str = KEYS) -> UnsupportedWrapperError:
    return UnsupportedWrapperError(f"deadpool_ext: DeepSpeed's {what} cannot be snapshotted ({why}); change "
                                   f"{keys} (supported: {SUPPORTED})")


@dataclass(frozen=True, slots=True)
class WrapperAccess:
    """Where one wrapper keeps a rank's tensors, and how its parameters follow its masters."""

    kind: str
    """DeepSpeed's class name of the wrapper (the torch optimizer's at fp32 ZeRO 0)."""
    bit16: Callable[[], list[torch.Tensor]]
    """The low-precision training parameters (flat buffers where the wrapper keeps them flat); empty at fp32."""
    master: Callable[[], list[torch.Tensor]]
    """The tensors the inner optimizer updates, in a stable order (``master.<i>``)."""
    inner: Any
    """The torch optimizer whose ``state`` is keyed by ``master()``."""
    scaler: Callable[[], Any]
    """The object whose plain attributes are the loss-scale state (``loss_scaler``/``loss_scale_config``), or None;
    looked up at each use (DeepSpeed's ``load_checkpoint`` replaces ZeRO's ``loss_scaler``)."""
    sync: Callable[[], None]
    """Make ``bit16()`` the masters cast to their dtype, as the wrapper's step does at its end."""
    partitioned: bool
    """Masters are this rank's partition of flat buffers (ZeRO 1-3, BF16_Optimizer): ``sync`` is collective
    over data parallelism except at ZeRO-3 (whose epilogue the adapter calls)."""
    flags: tuple[str, ...] = field(default=())
    """Plain attributes of the wrapper a restored step must see as the snapshotted one did."""


def _classes() -> dict[str, Any]:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return {"stage3": DeepSpeedZeroOptimizer_Stage3, "zero": DeepSpeedZeroOptimizer, "bf16": BF16_Optimizer,
            "fp16": FP16_Optimizer, "fp16_unfused": FP16_UnfusedOptimizer}


# Subclasses DeepSpeed builds for features whose state is not (only) in the attributes read here.
_REFUSED_SUBCLASSES = {
    "ZenFlowZeroOptimizer": ("ZenFlow keeps selective-update state beside the ZeRO partitions",
                             "zero_optimization.zenflow (remove it)"),
    "SuperOffloadOptimizer_Stage3": ("SuperOffload steps the optimizer asynchronously on the CPU",
                                     "zero_optimization.offload_optimizer.super_offload (false)"),
}


def _flat(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for g in groups for t in g]


def wrapper_access(engine: Any, zero_stage: int) -> WrapperAccess:
    """The :class:`WrapperAccess` of ``engine.optimizer``; :class:`UnsupportedWrapperError` (one line) for a
    wrapper that cannot be snapshotted."""
    opt = engine.optimizer
    kind = type(opt).__name__
    if opt is None:
        raise refuse("engine without an optimizer", "deepspeed.initialize got no optimizer= and the config has no "
                     "optimizer section", "the config's optimizer section, or pass optimizer=")
    if kind in _REFUSED_SUBCLASSES:
        why, keys = _REFUSED_SUBCLASSES[kind]
        raise refuse(kind, why, keys)
    c = _classes()
    if isinstance(opt, c["stage3"]):
        if opt.swap_optimizer or opt.params_in_nvme_and_cpu:
            raise refuse(f"{kind} with NVMe offload", "optimizer state or parameters live on NVMe, outside memory",
                         "zero_optimization.offload_optimizer.device and offload_param.device (cpu or none)")

        def sync3() -> None:
            # Release gathered parameters first: the epilogue's all-gather skips parameters that are still
            # "available", which would leave persistent (small, always gathered) parameters stale.
            opt.checkpoint_event_prologue()
            for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                lp.copy_(hp)
            opt.checkpoint_event_epilogue()
        return WrapperAccess(kind, lambda: list(opt.fp16_partitioned_groups_flat),
                             lambda: list(opt.fp32_partitioned_groups_flat), opt.optimizer, lambda: opt.loss_scaler,
                             sync3, True)
    if isinstance(opt, c["zero"]):
        return WrapperAccess(kind, lambda: list(opt.bit16_groups_flat),
                             lambda: list(opt.single_partition_of_fp32_groups), opt.optimizer, lambda: opt.loss_scaler,
                             opt.update_lp_params, True)
    if isinstance(opt, c["bf16"]):
        if not opt.using_real_optimizer:
            raise refuse(kind, "built without an optimizer (DummyOptim)", "the config's optimizer section")
        return WrapperAccess(kind, lambda: list(opt.bf16_groups_flat), lambda: list(opt.fp32_groups_flat_partition),
                             opt.optimizer, lambda: None, opt.update_lp_params, True)
    if isinstance(opt, c["fp16"]):
        def sync_fused() -> None:
            for lp, hp in zip(opt.fp16_groups_flat, opt.fp32_groups_flat):
                lp.copy_(hp)  # the parameters are views into the flat buffers
        return WrapperAccess(kind, lambda: list(opt.fp16_groups_flat), lambda: list(opt.fp32_groups_flat),
                             opt.optimizer, lambda: opt.loss_scale_config, sync_fused, False, ("has_executed_step",))

    if isinstance(opt, c["fp16_unfused"]):
        def sync_unfused() -> None:
            for lp, hp in zip(_flat(opt.fp16_groups), _flat(opt.fp32_groups)):
                lp.data.copy_(hp.data)
        return WrapperAccess(kind, lambda: _flat(opt.fp16_groups), lambda: _flat(opt.fp32_groups), opt.optimizer,
                             lambda: opt.loss_scale_config, sync_unfused, False)
    if isinstance(opt, torch.optim.Optimizer) and zero_stage == 0:
        params = [p for g in opt.param_groups for p in g["params"]]
        return WrapperAccess(kind, lambda: [], lambda: params, opt, lambda: None, lambda: None, False)
    raise refuse(f"optimizer {kind} at ZeRO stage {zero_stage}", "no state adapter knows where it keeps its tensors")


__all__ = ["SUPPORTED", "UnsupportedWrapperError", "WrapperAccess", "wrapper_access"]
