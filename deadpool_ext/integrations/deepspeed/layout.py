"""Where DeepSpeed keeps each parameter's elements in a rank's ZeRO partitions: the
:class:`deadpool_ext.recovery.reshard.PartitionLayout` an elastic restore reshards by.

ZeRO-1/2 (``rule="flat"``): group ``i`` is ``round_robin_bit16_groups[i]`` flattened in order (aligned, padded
at the end), rank ``r`` owning ``single_partition_of_fp32_groups[i]`` = elements ``[r*P, (r+1)*P)``;
``BF16_Optimizer`` (ZeRO-1, bf16 with fp32 gradient accumulation) the same with ``bf16_groups[i]`` and
``fp32_groups_flat_partition[i]``. ZeRO-3
(``rule="per_param"``): sub-group ``i`` is ``fp16_groups[i]``, each parameter's piece ``ds_tensor`` of
``ceil(numel / dp)`` elements, the pieces back to back in ``fp16_partitioned_groups_flat[i]``.

Not assumed but checked on the live engine: every parameter's offset in its flat buffer, every piece's
length. An engine laid out otherwise (a DeepSpeed that changed it, round-robin gradients, a partition group
narrower than data parallelism) gets no layout, with the reason, and a shrink is refused with it.
"""
from __future__ import annotations

import hashlib
from typing import Any

from ...recovery.reshard import PartitionLayout, piece


def _offset(t: Any, base: Any) -> int:
    return (t.data_ptr() - base.data_ptr()) // base.element_size()


def _fingerprint(module: Any) -> tuple[dict[int, int], str]:
    pids: dict[int, int] = {}
    h = hashlib.sha256()
    for i, (name, p) in enumerate(module.named_parameters()):
        pids[id(p)] = i
        shape = tuple(getattr(p, "ds_shape", p.shape))
        h.update(f"{name}:{shape};".encode())
    return pids, h.hexdigest()[:16]


def partition_layout(engine: Any, zero_stage: int) -> dict[str, Any]:
    """The layout of this rank's partitions as JSON; ValueError (the reason) where it cannot be given."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {zero_stage} has no partitions to reshard (stages 1-3 do)")
    opt = engine.optimizer
    import torch.distributed as dist

    dp = int(engine.dp_world_size)
    dp_rank = dist.get_rank(group=engine.data_parallel_group) if dp > 1 else 0
    pids, model = _fingerprint(engine.module)
    groups: list[tuple[tuple[int, int], ...]] = []
    part: list[int] = []
    if zero_stage in (1, 2):
        if type(opt).__name__ == "BF16_Optimizer":  # ZeRO-1 with bf16 and fp32 gradient accumulation
            bit16_groups, bit16_flat, parts = opt.bf16_groups, opt.bf16_groups_flat, opt.fp32_groups_flat_partition
        else:
            if getattr(opt, "round_robin_gradients", False):
                raise ValueError("round_robin_gradients reorders the flat buffers")
            bit16_groups, bit16_flat = opt.round_robin_bit16_groups, opt.bit16_groups_flat
            parts = opt.single_partition_of_fp32_groups
        for i, params in enumerate(bit16_groups):
            flat = bit16_flat[i]
            at = 0
            for p in params:
                if _offset(p, flat) != at:
                    raise ValueError(f"group {i}: a parameter is not where the flat layout puts it")
                at += p.numel()
            size = parts[i].numel()
            if size * dp != flat.numel():
                raise ValueError(f"group {i}: {dp} partitions of {size} do not make the flat buffer of {flat.numel()}")
            groups.append(tuple((pids[id(p)], int(p.numel())) for p in params))
            part.append(int(size))
        rule = "flat"
    else:
        for i, params in enumerate(opt.fp16_groups):
            if opt.sub_group_partition_counts[i] != dp:
                raise ValueError(f"sub-group {i} is partitioned over {opt.sub_group_partition_counts[i]} ranks, "
                                 f"not the {dp} of data parallelism (hpZ/MiCS)")
            flat = opt.fp16_partitioned_groups_flat[i]
            at = 0
            for p in params:
                n = int(p.ds_numel)
                if p.ds_tensor.numel() != piece(n, dp) or _offset(p.ds_tensor, flat) != at:
                    raise ValueError(f"sub-group {i}: a parameter's piece is not where the per-parameter layout "
                                     "puts it")
                at += piece(n, dp)
            if opt.fp32_partitioned_groups_flat[i].numel() != at:
                raise ValueError(f"sub-group {i}: the fp32 partition does not match its pieces")
            groups.append(tuple((pids[id(p)], int(p.ds_numel)) for p in params))
            part.append(at)
        rule = "per_param"
    return PartitionLayout(rule=rule, dp=dp, dp_rank=dp_rank, groups=tuple(groups), part=tuple(part),
                           model=model).to_json()
