"""Hugging Face ``Trainer``: a failure inside the training loop is recovered in place and the loop re-entered at
the restored step, without the job's script knowing.

Why: the Trainer's loop (``_inner_training_loop``: data loader, ``_run_epoch``, gradient accumulation, logging,
callbacks) is the Trainer's, not the script's; nothing outside it can catch a lost peer's collective error and
redo the step. The patch wraps ``_inner_training_loop``: an exception that a caller-supplied
``recover(trainer, exc) -> bool`` handles (it swaps the communicators and restores the engine in place, then
returns True) makes the wrapper call the loop again, which then starts where a restarted job would: the Trainer's
state, data loader and epoch iterator built anew, the engine (kept, restored) continuing from the restored step.
A ``False`` (or an exception of ``recover``) re-raises the original error unchanged.

Before re-entering, the Trainer is set back to what a fresh one holds (``model_wrapped = model``, no optimizer or
scheduler: the re-entered ``_prepare_for_training`` then prepares it as the spare's fresh Trainer does, through
Accelerate's ``prepare`` and ``deepspeed.initialize``, which the caller answers with the kept engine), and
Accelerate's handle on the engine is dropped (``accelerator.deepspeed_engine_wrapped = None``): the loop's first
line, ``accelerator.free_memory()``, would otherwise ``destroy()`` the engine being kept.

Call order: ``set_recover(fn)``, then ``apply()`` (before ``Trainer.train``). Tested with transformers 5.24 and
accelerate 1.15. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")


class TrainerHotSwap(Patch):
    name = "transformers_trainer_hot_swap"
    requires = {"transformers": ">=5.0,<6"}
    why = "a failed step inside the HF Trainer's loop is recovered in place and redone"

    def __init__(self) -> None:
        super().__init__()
        self._recover: Callable[[Any, BaseException], bool] | None = None

    def set_recover(self, fn: Callable[[Any, BaseException], bool]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_recover() after apply()")
        self._recover = fn

    def _apply(self) -> None:
        from transformers import trainer as trainer_module

        cls = trainer_module.Trainer
        recover = self._recover
        if recover is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_recover()")
        inner = cls._inner_training_loop

        @functools.wraps(inner)
        def _inner_training_loop(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            while True:
                try:
                    return inner(trainer, *args, **kwargs)
                except Exception as exc:
                    if not recover(trainer, exc):
                        raise
                # The Trainer as a fresh one sees it, so the re-entered loop prepares it the same way (the spare's
                # way): the bare model (Accelerate's prepare -> deepspeed.initialize, which the caller's hook answers
                # with the kept engine), no optimizer or scheduler yet; and Accelerate without its handle on the
                # engine, whose free_memory() would otherwise destroy() it.
                trainer.model_wrapped = trainer.model
                trainer.optimizer, trainer.lr_scheduler = None, None
                if hasattr(trainer, "deepspeed"):
                    trainer.deepspeed = None
                accelerator = getattr(trainer, "accelerator", None)
                if accelerator is not None and hasattr(accelerator, "deepspeed_engine_wrapped"):
                    accelerator.deepspeed_engine_wrapped = None
                kwargs["resume_from_checkpoint"] = None  # the state comes from memory, not from a directory
                if len(args) > 2:
                    args = (*args[:2], *args[3:])
                log.info("HF Trainer: training loop re-entered after an in-place recovery")

        self._swap(cls, "_inner_training_loop", _inner_training_loop)


PATCH = TrainerHotSwap()
apply = PATCH.apply
revert = PATCH.revert
