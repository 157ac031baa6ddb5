"""Reset DeepSpeed's module-level caches so a new world and engine can be built in the same process.

DeepSpeed caches process groups in ``deepspeed.utils.groups`` and its backend in ``deepspeed.comm.comm.cdb``
(whose CPU shared-memory op is sized for the old world). After ``destroy_process_group`` those handles are
dangling; the next ``deepspeed.initialize`` must not see them. Version-guarded: the names below are those of
DeepSpeed 0.16-0.19; other versions are refused with a clear error rather than half-reset.
"""
from __future__ import annotations

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
        raise RuntimeError(f"deadpool_ext hot-swap supports DeepSpeed {SUPPORTED[0]} to <{SUPPORTED[1]}, found {version}")
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


def preload_comm_op() -> float | None:
    """Load DeepSpeed's CPU shared-memory communication op now, before this process has a world.

    A spare calls this while it waits for an assignment: ``deepspeed.initialize`` loads the op on first use
    (a JIT extension: a build check, then dlopen), which cost a spare ~1.5-2 s on the hot-swap critical path,
    after its assignment, while every survivor (op already loaded) waited for it in the first collective.
    DeepSpeed keeps loaded ops per process, so the later load returns this one. Returns the seconds it took,
    or None when the accelerator has no such op (e.g. CUDA: NCCL needs none) or DeepSpeed is not in use."""
    import sys
    import time

    if "deepspeed" not in sys.modules:
        return None
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    builder.load(verbose=False)
    return time.perf_counter() - t0
