"""Hugging Face ``Trainer``: continue from a step restored *after* the engine was built (from memory).

Why: the Trainer decides where training starts (``TrainerState.global_step``, the epoch, the batches to skip)
in ``_init_training_state``, from a checkpoint directory, *before* ``_prepare_for_training`` builds the DeepSpeed
engine. A restore from memory can only happen once the engine exists (every rank agrees on a version and loads
it into the engine), so the Trainer would restart from step 0 on a restored engine. The patch adds one call
after ``_prepare_for_training``, ``resume(trainer) -> step or None`` (supplied by the caller), and, when it
returns a step, makes ``_run_epoch`` start where an uninterrupted run would be: earlier epochs skipped, the
resumed epoch fast-forwarded by the Trainer's own ``skip_first_batches`` over the steps already done (times
gradient accumulation). The Trainer's own ``resume_from_checkpoint`` path is left untouched (``resume`` is not
called then). ``_load_rng_state`` returns at once for that resumed epoch's marker (:data:`MEMORY`): the RNG was
restored from memory with the engine, and the Trainer would otherwise warn that no RNG file exists (a false
"reproducibility is not guaranteed").

Call order: ``set_resume(fn)``, then ``apply()`` (before ``Trainer.train``). Tested with transformers 5.24; the
private methods it wraps are checked to exist. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")

MEMORY = "<deadpool memory>"
"""What ``_run_epoch`` is given as ``resume_from_checkpoint`` for the resumed epoch: not a directory, so the
Trainer's RNG-file lookup finds nothing (the extension restored the RNG itself)."""
STEP_ATTR = "_deadpool_resumed_step"


class TrainerResume(Patch):
    name = "transformers_trainer_resume"
    requires = {"transformers": ">=5.0,<6"}
    why = "the HF Trainer continues from the step restored from memory after its engine was built"

    def __init__(self) -> None:
        super().__init__()
        self._resume: Callable[[Any], int | None] | None = None

    def set_resume(self, fn: Callable[[Any], int | None]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_resume() after apply()")
        self._resume = fn

    def _apply(self) -> None:
        from transformers import trainer as trainer_module

        cls = trainer_module.Trainer
        resume = self._resume
        if resume is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_resume()")
        prepare, run_epoch, load_rng = cls._prepare_for_training, cls._run_epoch, cls._load_rng_state

        @functools.wraps(prepare)
        def _prepare_for_training(trainer: Any, max_steps: Any, train_dataloader: Any,
                                  resume_from_checkpoint: Any) -> Any:
            out = prepare(trainer, max_steps, train_dataloader, resume_from_checkpoint)
            setattr(trainer, STEP_ATTR, None)
            if resume_from_checkpoint is None:
                step = resume(trainer)
                if step:
                    trainer.state.global_step = int(step)
                    setattr(trainer, STEP_ATTR, int(step))
            return out

        @functools.wraps(run_epoch)
        def _run_epoch(trainer: Any, **kwargs: Any) -> Any:
            step = getattr(trainer, STEP_ATTR, None)
            if step:
                per_epoch = int(kwargs["num_update_steps_per_epoch"])
                epoch_r, done = divmod(step, per_epoch)
                if kwargs["epoch"] < epoch_r:
                    return None  # an epoch the restored run had finished
                setattr(trainer, STEP_ATTR, None)
                kwargs.update(epochs_trained=epoch_r, resume_from_checkpoint=MEMORY,
                              steps_trained_in_current_epoch=done * trainer.args.gradient_accumulation_steps)
                log.info("Trainer resumes at step %d: epoch %d, %d batch(es) of it skipped", step, epoch_r,
                         kwargs["steps_trained_in_current_epoch"])
            return run_epoch(trainer, **kwargs)

        @functools.wraps(load_rng)
        def _load_rng_state(trainer: Any, checkpoint: Any) -> Any:
            if checkpoint == MEMORY:
                return None  # restored with the engine from memory; there is no RNG file to look for
            return load_rng(trainer, checkpoint)

        self._swap(cls, "_prepare_for_training", _prepare_for_training)
        self._swap(cls, "_run_epoch", _run_epoch)
        self._swap(cls, "_load_rng_state", _load_rng_state)


PATCH = TrainerResume()
apply = PATCH.apply
revert = PATCH.revert
