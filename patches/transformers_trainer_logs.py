"""Hugging Face ``Trainer.log``: extra metrics (from a caller-supplied function) join every training log entry.

Why: the Trainer's users read ``log_history``, the console and their reporting integrations (TensorBoard,
W&B, ...), all fed from ``Trainer.log``; a callback's ``on_log`` runs after the entry was recorded and after the
reporting callbacks registered before it. Adding the fields before the original ``log`` runs puts them
everywhere the Trainer's own ``loss`` goes.

Call order: ``set_extra(fn)`` (``fn(trainer) -> dict``, called for entries that carry a training ``loss``), then
``apply()``. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .base import Patch


class TrainerLogs(Patch):
    name = "transformers_trainer_logs"
    requires = {"transformers": ">=5.0,<6"}
    why = "the HF Trainer's training logs carry the extension's snapshot metrics"

    def __init__(self) -> None:
        super().__init__()
        self._extra: Callable[[Any], dict[str, float]] | None = None

    def set_extra(self, fn: Callable[[Any], dict[str, float]]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_extra() after apply()")
        self._extra = fn

    def _apply(self) -> None:
        from transformers import trainer as trainer_module

        cls = trainer_module.Trainer
        extra = self._extra
        if extra is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_extra()")
        original = cls.log

        @functools.wraps(original)
        def log(trainer: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
            if "loss" in logs:
                logs = {**logs, **extra(trainer)}
            return original(trainer, logs, *args, **kwargs)

        self._swap(cls, "log", log)


PATCH = TrainerLogs()
apply = PATCH.apply
revert = PATCH.revert
