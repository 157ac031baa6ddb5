"""Reset DeepSpeed's module-level caches so a new world and engine can be built in the same process.

DeepSpeed caches process groups in ``deepspeed.utils.groups`` and its backend in ``deepspeed.comm.comm.cdb``
(whose CPU shared-memory op is sized for the old world). After ``destroy_process_group`` those handles are
dangling; the next ``deepspeed.initialize`` must not see them. Version-guarded: the names below are those of
DeepSpeed 0.16-0.19; other versions are refused with a clear error rather than half-reset.
"""
from __future__ import annotations

from typing import Any

from packaging.version import Version

SUPPORTED = (Version("0.16"), Version("0.20"))

_GROUP_DEFAULTS: dict[str, object] = {
    "_EXPERT_PARALLEL_GROUP": dict, "_EXPERT_PARALLEL_GROUP_RANKS": dict, "_EXPERT_DATA_PARALLEL_GROUP": dict,
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict, "_ALL_TO_ALL_GROUP": dict, "_WORLD_GROUP": None,
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None, "mpu": None, "mesh_device": None,
    "_TENSOR_MODEL_PARALLEL_GROUP": None, "_MODEL_PARALLEL_GROUP": None, "_DATA_PARALLEL_GROUP": None,
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None, "_MPU_TENSOR_MODEL_PARALLEL_RANK": None,
}


def reset_deepspeed_comm_state() -> None:
    import sys

    if "deepspeed" not in sys.modules:
        return  # never imported in this process (e.g. a Megatron-Core job): no cached state, and no import cost
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    version = Version(deepspeed.__version__.split("+")[0])
    if not (SUPPORTED[0] <= version < SUPPORTED[1]):
        raise RuntimeError(f"deadpool_ext hot-swap supports DeepSpeed {SUPPORTED[0]} to <{SUPPORTED[1]}, "
                           f"found {version}")
    for name, default in _GROUP_DEFAULTS.items():
        if hasattr(groups, name):
            setattr(groups, name, default() if callable(default) else default)
    ds_comm.cdb = None
    # ZeRO-3 numbers parameters from a process-wide counter and checks the ids agree across ranks: a survivor
    # building its second engine must count from 0 like a spare building its first.
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    # Module ids come from a mutable default argument (count=[0]) of _register_deepspeed_module: another
    # process-wide counter that must restart for the rebuilt module's ids to match the spare's.
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    defaults = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if defaults and isinstance(defaults[0], list) and defaults[0]:
        defaults[0][0] = 0


_COORD = "_PartitionedParameterCoordinator__"   # name-mangled attributes of DeepSpeed's ZeRO-3 coordinator


def abandon_step(engine: Any) -> None:
    """In-place hot-swap, survivor: drop what the interrupted step left half done, so that the engine (whose
    tensors the restore then overwrites) is in the state of a freshly built one at a step boundary, the state
    the spare's engine is in. No collective (the communicators are dead). Version-guarded like the reset above.

    ZeRO-3: in-flight parameter all-gathers are forgotten (never waited: their peer is gone), parameters still
    gathered or half gathered are marked for release (the restore's prologue partitions all of them), the
    coordinator's trace is invalidated like a new one's (its next step records it again, as the spare's does:
    the trace agreement of DeepSpeed's reset_step is then the same collective on every rank). Every stage:
    gradient buckets emptied, accumulated gradients and "already reduced" flags cleared, micro-step counters
    reset, as after DeepSpeed's own ``step``."""
    import deepspeed

    version = Version(deepspeed.__version__.split("+")[0])
    if not (SUPPORTED[0] <= version < SUPPORTED[1]):
        raise RuntimeError(f"deadpool_ext in-place hot-swap supports DeepSpeed {SUPPORTED[0]} to <{SUPPORTED[1]}, "
                           f"found {version}; set deadpool.hot_swap.in_place: false")
    opt: Any = getattr(engine, "optimizer", None)
    stage = int(engine.zero_optimization_stage())
    if stage == 3:
        _abandon_zero3(engine, opt)
    elif stage in (1, 2):
        for bucket in getattr(opt, "ipg_buckets", {}).values():
            bucket.clear()
        flags = getattr(opt, "params_already_reduced", None)
        if isinstance(flags, list):
            flags[:] = [False] * len(flags)
        if hasattr(opt, "reset_partition_gradient_structures"):
            opt.reset_partition_gradient_structures()
        if hasattr(opt, "averaged_gradients"):
            opt.averaged_gradients = {}
        if hasattr(opt, "previous_reduced_grads") and isinstance(opt.previous_reduced_grads, dict):
            opt.previous_reduced_grads.clear()
        large = getattr(opt, "extra_large_param_to_reduce", None)
        if isinstance(large, dict):
            large.clear()
        elif large is not None:
            opt.extra_large_param_to_reduce = None
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt.micro_step_id = INITIAL_MICRO_STEP_ID
    # Gradients dropped directly (ZeRO-3's zero_grad calls record_stream, which host tensors refuse).
    for p in engine.module.parameters():
        p.grad = None
        if hasattr(p, "grad_accum"):
            p.grad_accum = None
    if stage == 3:
        opt.micro_step_id = 0
        if hasattr(opt, "_epilogue_ran_this_backward"):
            opt._epilogue_ran_this_backward = False
    for name in ("_running_engine_backward",):
        if hasattr(engine, name):
            setattr(engine, name, False)
    if hasattr(engine, "_running_engine_backward_count"):
        engine._running_engine_backward_count = 0


def _abandon_zero3(engine: Any, opt: Any) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    coord = opt.parameter_offload.get_param_coordinator()
    getattr(coord, _COORD + "inflight_param_registry").clear()
    for p in engine.module.parameters():
        p.ds_active_sub_modules.clear()
        if p.ds_status == ZeroParamStatus.INFLIGHT:
            p.ds_status = ZeroParamStatus.AVAILABLE  # its buffer is whole in size; partitioned by the restore
    coord._clear_trace_structures()
    setattr(coord, _COORD + "trace_mode", ZeRoTraceMode.INVALID)
    setattr(coord, _COORD + "step_id", 0)
    setattr(coord, _COORD + "n_available_params", 0)
    for name in ("ongoing_fetch_events", "active_backward_submodules", "ongoing_fetch_leaf_module_events"):
        held = getattr(coord, _COORD + name, None)
        if held is not None:
            held.clear()
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        bucket.clear_params()
    flags = getattr(opt, "params_already_reduced", None)
    if isinstance(flags, dict):
        for k in flags:
            flags[k] = False
    if hasattr(opt, "previous_reduced_grads"):
        opt.previous_reduced_grads = None
    if hasattr(opt, "averaged_gradients") and isinstance(opt.averaged_gradients, dict):
        opt.averaged_gradients.clear()
