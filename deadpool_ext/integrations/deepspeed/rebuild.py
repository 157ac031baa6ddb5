"""Reset DeepSpeed's module-level caches so a new world and engine can be built in the same process.

DeepSpeed caches process groups in ``deepspeed.utils.groups`` and its backend in ``deepspeed.comm.comm.cdb``
(whose CPU shared-memory op is sized for the old world). After ``destroy_process_group`` those handles are
dangling; the next ``deepspeed.initialize`` must not see them. A teardown hook of the REBUILD path (registered
with ``rebuild.worker.on_teardown``); an in-place hot-swap keeps the engine and its groups, and abandons the
interrupted step instead (``runtime.py``). Version-guarded: the names below are those of DeepSpeed 0.16-0.19
(``runtime.SUPPORTED``); other versions are refused with a clear error rather than half-reset.
"""
from __future__ import annotations

from packaging.version import Version

from .runtime import SUPPORTED

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


def comm_ready_again() -> None:
    """A rebuild, once the new generation's process group exists and before the script's factory runs: DeepSpeed's
    communication backend set up again on it (``deepspeed.comm.init_distributed``, the call a script makes at its
    start and ``deepspeed.initialize`` makes again), since the teardown reset it (above). Why before the factory: a
    ``PipelineModule`` asks ``deepspeed.comm`` for the world while it is built, before ``deepspeed.initialize``; a
    factory that builds one failed with "DeepSpeed backend not set"."""
    import sys

    if "deepspeed" not in sys.modules:
        return
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist

    if ds_comm.cdb is None and dist.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
