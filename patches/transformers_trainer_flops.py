"""Hugging Face ``Trainer.floating_point_ops``: under ZeRO-3 the estimate counts every parameter, not only the ones
gathered at that moment.

Why: HF's estimate is ``6 x tokens x model.num_parameters(exclude_embeddings=True)``, and ``num_parameters`` adds
``param.numel()``. ZeRO-3 leaves a partitioned parameter empty (``numel() == 0``; its size is ``ds_numel``) until
it is gathered, so the count depends on which parameters DeepSpeed's prefetch happens to hold when the Trainer asks
(at the start of each micro-batch): a process's first step counts about half of a later one. ``total_flos`` is
then neither the model's FLOPs nor the same from one process to the next, and a job that continued in a new
process (a restart, a spare) ends with a different total than the uninterrupted run. With this patch a partitioned
parameter counts its ``ds_numel``: HF's own formula over the whole model, the same in every process and every step.

Nothing else changes: a model with no partitioned parameter (ZeRO 0-2, no DeepSpeed) goes to HF's own method, and a
``Trainer`` subclass that overrides ``floating_point_ops`` keeps its override.

Call order: ``apply()`` before the Trainer's loop runs. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
from typing import Any

from .base import Patch

COUNT_ATTR = "_deadpool_whole_parameter_count"
"""Cached on the model: its non-embedding parameter count with every ZeRO-3 parameter at its full size."""


def whole_parameter_count(model: Any) -> int | None:
    """HF's ``num_parameters(exclude_embeddings=True)`` with each ZeRO-3 parameter counted at ``ds_numel``, or
    None when no parameter is partitioned (HF's own count is right then). Cached on the model: sizes are fixed."""
    cached = getattr(model, COUNT_ATTR, None)
    if cached is not None:
        return int(cached)
    from torch import nn

    embeddings = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    total, partitioned = 0, False
    for name, p in model.named_parameters():
        if name in embeddings:
            continue
        full = getattr(p, "ds_numel", None)
        partitioned = partitioned or full is not None
        total += int(full) if full is not None else p.numel()
    if not partitioned:
        return None
    setattr(model, COUNT_ATTR, total)
    return total


class TrainerFlops(Patch):
    name = "transformers_trainer_flops"
    requires = {"transformers": ">=5.0,<6"}
    why = "under ZeRO-3 the HF Trainer's total_flos counts only the parameters gathered when it asks"

    def _apply(self) -> None:
        from transformers import trainer as trainer_module

        cls = trainer_module.Trainer
        original = cls.floating_point_ops

        @functools.wraps(original)
        def floating_point_ops(trainer: Any, inputs: dict[str, Any]) -> int:
            model = trainer.model
            main = getattr(model, "main_input_name", "input_ids")
            if main in inputs and hasattr(model, "num_parameters"):
                count = whole_parameter_count(model)
                if count is not None:
                    return 6 * inputs[main].numel() * count
            return int(original(trainer, inputs))

        self._swap(cls, "floating_point_ops", floating_point_ops)


PATCH = TrainerFlops()
apply = PATCH.apply
revert = PATCH.revert
