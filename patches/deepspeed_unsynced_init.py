"""DeepSpeed: build an engine without the initial weight synchronisation, when every rank restores next.

Why: ``deepspeed.initialize`` makes the ranks' initial weights agree with collectives: the engine broadcasts
every parameter from data-parallel rank 0 (``DeepSpeedEngine._broadcast_model``); ZeRO-3 broadcasts each
parameter again before partitioning it (``Init._zero_init_param``) and all-gathers each one once more to
register its gradient hook (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks``). For GPT
small that is 228 collectives, 0.6 s of a 1.2 s ``initialize`` on the 2-core host. In a hot-swap rebuild
every rank overwrites all of those values right after (survivors from their own memory, the spare from a
peer replica; the restored parameters are verified by checksum), so agreeing on them first is wasted time on
the recovery's critical path.

Inside :func:`unsynced_weights` (a context manager; applied on entry, reverted on exit):

- ``DeepSpeedEngine._broadcast_model`` does nothing;
- ``Init._zero_init_param`` converts and partitions a parameter without broadcasting it first (each rank
  keeps its own slice of its own values);
- ``Init._all_gather`` with ``async_op=False`` materialises each parameter locally at its full size (this
  rank's slice in place, the rest uninitialised) instead of gathering it. Asynchronous gathers (the
  training-time prefetch) and quantized or hierarchical (hpZ) parameters go to DeepSpeed's own code.

The caller must guarantee the precondition on *every* rank (all of them skip the same collectives, or none
does): ``deadpool_ext.rebuild.recover.every_rank_restores()`` agrees on it with one all-reduce.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .base import Patch

SUPPORTED_DEEPSPEED = ">=0.16,<0.20"


def _no_broadcast(engine: Any) -> None:
    return None


def _local_gather_supported(init: Any, param: Any) -> bool:
    return (getattr(init, "zero_param_process_group", None) is None
            and getattr(param, "ds_secondary_tensor", None) is None
            and not hasattr(param.ds_tensor, "ds_quant_scale"))


class UnsyncedInit(Patch):
    name = "deepspeed_unsynced_init"
    requires = {"deepspeed": SUPPORTED_DEEPSPEED}
    why = "engine built without the initial weight broadcast/all-gather: every rank restores its state next"

    def _apply(self) -> None:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.partition_parameters import Init, ZeroParamStatus

        self._swap(DeepSpeedEngine, "_broadcast_model", _no_broadcast)

        def _zero_init_param(init: Any, param: Any) -> None:
            init._convert_to_deepspeed_param(param)
            param.partition()

        self._swap(Init, "_zero_init_param", _zero_init_param)
        gather = Init._all_gather

        def _all_gather(init: Any, param_list: Any, async_op: bool = False, hierarchy: Any = None) -> Any:
            if async_op or not all(_local_gather_supported(init, p) for p in param_list):
                return gather(init, param_list, async_op=async_op, hierarchy=hierarchy)
            for p in param_list:
                if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                    continue
                part = p.ds_tensor
                world = init._partition_world_size(p)
                flat = torch.empty(part.ds_numel * world, dtype=part.dtype, device=init.local_device)
                flat.narrow(0, part.ds_numel * init._partition_rank(p), part.ds_numel).copy_(part.data)
                p.data = flat.narrow(0, 0, p.ds_numel).view(p.ds_shape)
                p.ds_status = ZeroParamStatus.AVAILABLE
            return None

        self._swap(Init, "_all_gather", _all_gather)


PATCH = UnsyncedInit()
apply = PATCH.apply
revert = PATCH.revert


@contextlib.contextmanager
def unsynced_weights(enabled: bool = True) -> Iterator[bool]:
    """Apply the patch for the duration of the block (no-op when ``enabled`` is false). Yields ``enabled``."""
    if not enabled:
        yield False
        return
    PATCH.apply()
    try:
        yield True
    finally:
        PATCH.revert()
