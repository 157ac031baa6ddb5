"""A spare's engine, built ahead for one data-parallel rank, relabelled to take another rank in place.

Why: a spare builds its engine ahead of any failure for the ranks of the node it shadows (``rebuild/spare.py``).
Under pure data parallelism every rank's engine has the same shapes (ZeRO partitions are equal and padded), so the
engine built for rank r' can serve rank r once what DeepSpeed cached from r' is set for r; the restore from memory
then overwrites every tensor of the state (``state.py``), the RNG included. Without this the spare assigned another
node's ranks starts again from its script's first line (seconds: imports, model, engine).

What DeepSpeed (0.19) keeps from the rank, found by building one engine per rank and comparing every attribute
(each relabelled below, or a reason in :func:`refusal`):

- every stage: ``engine.global_rank`` (``engine.py`` ``_set_distributed_vars``), ``save_non_zero_checkpoint`` and
  ``save_zero_checkpoint`` (``_configure_checkpointing``: which ranks write the checkpoint's files), the monitor's
  writers (``monitor/monitor.py`` ``MonitorMaster``: opened on rank 0 only; made anew for a relabel to rank 0);
- ZeRO-1/2 (``stage_1_and_2.py`` ``__init__``): ``groups_padding``, ``params_in_partition``,
  ``params_not_in_partition``, ``first_offset`` (from ``get_partition_info`` with the rank's ``partition_id``),
  ``is_param_in_current_partition``, each low-precision parameter's ``_hp_mapping`` (``_link_all_hp_params``) and
  ``_param_slice_mappings``; the fp32 partition (same size on every rank) is restored from memory;
- ZeRO-3 (``stage3.py`` ``_create_fp16_partitions_with_defragmentation``): ``groups_padding`` (padding on the last
  rank only); ``partition_parameters.py`` ``_convert_to_deepspeed_param``: each parameter's
  ``ds_zero_partition_rank``; the partitions themselves are read by rank from the group at each use.

The process's own groups are relabelled first (``rebuild/swap.py`` :func:`relabel`), so ``dist.get_rank`` already
answers the new rank when this runs.
"""
from __future__ import annotations

from typing import Any

SUPPORTED = ("0.17", "0.20")
"""DeepSpeed versions whose optimizer attributes :func:`relabel` sets (>= first, < second). Tested with 0.19.8."""


def refusal(engine: Any) -> str | None:
    """Why this engine cannot take another data-parallel rank in place (None: it can). Pure reads of the engine."""
    import deepspeed
    from packaging.version import Version

    v = Version(deepspeed.__version__.split("+")[0])
    lo, hi = (Version(x) for x in SUPPORTED)
    if not lo <= v < hi:
        return f"DeepSpeed {v} (the relabel supports >={lo},<{hi})"
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        return "pipeline parallelism (each stage's engine has its own layers)"
    if getattr(engine, "mpu", None) is not None:
        return "model parallelism given as an mpu (a rank's shard has its own coordinates)"
    if getattr(engine, "has_moe_layers", False):
        return "MoE layers (expert-parallel groups hold a subset of the ranks)"
    if engine.zero_cpu_offload() or _offloads_params(engine):
        return "ZeRO offload (the offloaded partitions and their swap files are laid out for one rank)"
    if getattr(engine, "training_dataloader", None) is not None and not _sampler_of(engine):
        return "DeepSpeed's data loader (training_data=) has a sampler other than a DistributedSampler"
    stage = int(engine.zero_optimization_stage())
    kind = type(engine.optimizer).__name__
    expected = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    if stage in expected and kind != expected[stage]:
        return f"ZeRO-{stage} with the {kind} wrapper (its partitions are laid out for one rank)"
    if stage == 0 and kind in ("BF16_Optimizer",):
        return "bf16 at stage 0 (BF16_Optimizer partitions its masters by rank)"
    if stage == 3 and getattr(engine.optimizer, "zero_hpz_partition_size", 1) > 1:
        return "ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1: node-local groups)"
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                             "zero_quantized_gradients") if getattr(engine, k, lambda: False)()]
    if quantized:  # not checked against DeepSpeed's own build for another rank (tests/integration/test_takeover.py)
        return f"ZeRO++ quantized communication ({', '.join(quantized)}), not verified for a relabel"
    return None


def _offloads_params(engine: Any) -> bool:
    try:
        return bool(engine.zero_offload_param())
    except AttributeError:  # stage < 3 engines of some versions
        return False


def _sampler_of(engine: Any) -> Any:
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(engine.training_dataloader, "data_sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else None


def relabel(engine: Any, rank: int) -> None:
    """Set what ``engine`` cached from its build-time rank to ``rank`` (the process's groups already answer
    ``rank``). Local, no collective; call only when :func:`refusal` is None."""
    import torch.distributed as dist

    engine.global_rank = rank
    _relabel_checkpoint_writers(engine)
    monitor = getattr(engine, "monitor", None)
    if rank == 0 and getattr(monitor, "enabled", False) and not any(
            getattr(monitor, w, None) is not None for w in ("tb_monitor", "wandb_monitor", "csv_monitor",
                                                             "comet_monitor")):
        # MonitorMaster opens its writers on rank 0 only (monitor/monitor.py); on other ranks they stay shut
        from deepspeed.monitor.monitor import MonitorMaster

        engine.monitor = MonitorMaster(engine._config.monitor_config)
    if getattr(engine, "training_dataloader", None) is not None:
        sampler = _sampler_of(engine)
        sampler.rank = dist.get_rank(group=engine.data_parallel_group)
    stage = int(engine.zero_optimization_stage())
    if stage in (1, 2):
        _relabel_zero12(engine.optimizer)
    elif stage == 3:
        _relabel_zero3(engine)


def _relabel_checkpoint_writers(engine: Any) -> None:
    """``engine.py`` ``_configure_checkpointing``: which ranks write the model states file and the ZeRO files."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    dp_rank = groups._get_sequence_data_parallel_rank()
    rank = engine.local_rank if engine.use_node_local_storage() else dp_rank
    engine.save_non_zero_checkpoint = bool(
        engine.checkpoint_engine.is_data_parallel_writer(rank)
        or (engine.zero_optimization_partition_weights() and engine.is_first_weights_partition_group()))
    if hasattr(engine.optimizer, "dp_process_group"):
        engine.save_zero_checkpoint = dist.get_rank(group=engine.optimizer.dp_process_group) == dp_rank


def _relabel_zero12(opt: Any) -> None:
    """``stage_1_and_2.py`` ``DeepSpeedZeroOptimizer.__init__``'s rank-dependent part, again for the group's rank."""
    import torch.distributed as dist

    for i in range(len(opt.bit16_groups)):
        group = opt.real_dp_process_group[i]
        partition_id = dist.get_rank(group=group)
        partitions = opt.parallel_partitioned_bit16_groups[i]
        meta = opt.round_robin_bit16_meta[i]
        padded = opt.round_robin_bit16_offsets[i][-1] + meta[-1].numel() + opt.round_robin_bit16_padding[i][-1]
        left = sum(t.numel() for t in partitions[:partition_id])
        size = partitions[partition_id].numel()
        opt.groups_padding[i] = (size if padded <= left else left + size - padded if padded < left + size else 0)
        partition_size = len(opt.bit16_groups_flat[i]) // dist.get_world_size(group=group)
        inside, outside, first = opt.get_partition_info(opt.round_robin_bit16_groups[i], partition_size,
                                                        partition_id, opt.round_robin_bit16_padding[i])
        opt.params_in_partition[i], opt.params_not_in_partition[i], opt.first_offset[i] = inside, outside, first
    opt.is_param_in_current_partition = {}
    for in_part, groups in ((True, opt.params_in_partition), (False, opt.params_not_in_partition)):
        for params in groups:
            for p in params:
                opt.is_param_in_current_partition[opt.get_param_id(p)] = in_part
    for params in opt.bit16_groups:  # link_hp_params sets a mapping only for the parameters of this partition
        for p in params:
            p._hp_mapping = None
    opt._link_all_hp_params()
    opt._hp_optimizer_states_linked = False
    opt._param_slice_mappings = opt._create_param_mapping()


def _relabel_zero3(engine: Any) -> None:
    """``stage3.py``: the last rank's padding per sub-group; ``partition_parameters.py``: each parameter's rank."""
    import torch.distributed as dist

    opt = engine.optimizer
    for i, sub_group in enumerate(opt.fp16_groups):
        group = opt.sub_group_process_groups[i]
        last = dist.get_rank(group) == opt.sub_group_partition_counts[i] - 1
        opt.groups_padding[i] = [p.padding_size() if last else 0 for p in sub_group]
    for p in engine.module.parameters():
        if hasattr(p, "ds_zero_partition_rank"):
            p.ds_zero_partition_rank = dist.get_rank(group=p.ds_process_group)
