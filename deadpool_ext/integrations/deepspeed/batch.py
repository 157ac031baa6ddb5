"""The global batch across a change of data-parallel size (elastic shrink and grow).

The first engine of a process records its global batch, micro batch and accumulation steps. An engine built
later in the same process on a world of another data-parallel size (the rebuild after a shrink or a grow) gets
a config that keeps the global batch: the micro batch stays, gradient accumulation becomes
``global / (micro x dp)``. Where that is not an integer the rebuild is refused with the reason, unless
``deadpool.elastic.allow_batch_change`` is true: then micro batch and accumulation stay and the global batch
changes (logged). With the samples of a step taken by global sample index (``global_samples``), the data
stream is the uninterrupted run's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...rebuild.context import context
from ...snapshot.plan import RecoveryError

log = logging.getLogger("deadpool_ext")

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class BatchChangeRefused(RecoveryError):
    """The global batch cannot be kept at the new data-parallel size (one line, naming the numbers); final: the
    recovery stops the job with it."""


@dataclass(frozen=True, slots=True)
class BatchShape:
    global_batch: int
    micro: int
    accumulation: int
    dp: int


def record(engine: Any) -> None:
    """Remember the first engine's batch shape (once per process, in its context: ``rebuild/context.py``)."""
    ctx = context()
    if ctx.first_batch is None:
        ctx.first_batch = BatchShape(int(engine.train_batch_size()), int(engine.train_micro_batch_size_per_gpu()),
                                     int(engine.gradient_accumulation_steps()), int(engine.dp_world_size))


def recorded() -> BatchShape | None:
    first = context().first_batch
    return first if isinstance(first, BatchShape) else None


def parallel_dims(model: Any) -> tuple[int, int]:
    """(pipeline stages, model-parallel size) of a model: a ``PipelineModule``'s topology (its ``pipe`` and ``model``
    axes), (1, 1) for any other model."""
    topology = getattr(model, "topology", None)
    topo = topology() if callable(topology) else None
    if topo is None or not hasattr(topo, "get_dim"):
        return 1, 1
    return max(int(topo.get_dim("pipe")), 1), max(int(topo.get_dim("model")), 1)


def data_parallel_size(world_size: int, pipe: int = 1, model: int = 1) -> int:
    """The data-parallel size of ``world_size`` ranks split into ``pipe`` pipeline stages of ``model``-parallel
    groups (pure); a world they do not divide is an error naming the numbers (DeepSpeed refuses it too)."""
    if pipe < 1 or model < 1 or world_size % (pipe * model):
        raise ValueError(f"a world of {world_size} ranks does not split into {pipe} pipeline stage(s) x {model} "
                         "model-parallel rank(s)")
    return world_size // (pipe * model)


def rescale(ds_config: dict[str, Any], first: BatchShape, dp: int, allow_change: bool) -> dict[str, Any]:
    """The config for an engine at data-parallel size ``dp`` (pure)."""
    if dp == first.dp:
        return ds_config
    out = {k: v for k, v in ds_config.items() if k not in KEYS}
    if first.global_batch % (first.micro * dp) == 0:
        ga = first.global_batch // (first.micro * dp)
        log.info("elastic: data parallelism %d -> %d: global batch %d kept (micro batch %d, gradient accumulation "
                 "%d -> %d)", first.dp, dp, first.global_batch, first.micro, first.accumulation, ga)
        return {**out, "train_batch_size": first.global_batch, "train_micro_batch_size_per_gpu": first.micro,
                "gradient_accumulation_steps": ga}
    changed = first.micro * first.accumulation * dp
    if not allow_change:
        raise BatchChangeRefused(
            f"elastic: cannot keep the global batch {first.global_batch} at data-parallel size {dp}: it is not a "
            f"multiple of micro batch {first.micro} x {dp}; set deadpool.elastic.allow_batch_change to true to "
            f"continue with global batch {changed} (micro batch {first.micro}, accumulation {first.accumulation})")
    log.warning("elastic: data parallelism %d -> %d: the global batch changes %d -> %d (micro batch %d, "
                "accumulation %d; deadpool.elastic.allow_batch_change is true)", first.dp, dp, first.global_batch,
                changed, first.micro, first.accumulation)
    return {**out, "train_batch_size": changed, "train_micro_batch_size_per_gpu": first.micro,
            "gradient_accumulation_steps": first.accumulation}
