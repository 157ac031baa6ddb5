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

The Trainer's bookkeeping lives partly in locals and attributes that ``_inner_training_loop`` sets *after*
``_prepare_for_training`` (the running loss ``_tr_loss``, ``_total_loss_scalar``, ``_globalstep_last_logged``,
``_initial_global_step``, ``start_time``), so whatever ``resume`` puts in :data:`LOOP_ATTR` (a dict, see
:func:`apply_loop_state`) is applied at the start of the resumed epoch, and its ``elapsed_s`` moves ``start_time``
back (in ``_run_epoch`` and ``_finalize_training``): ``train_loss``, the speed metrics and ``train_runtime`` then
cover the whole run, not the last attempt. ``set_step_end(fn)``: ``fn(trainer, start_time)`` runs after every
``_maybe_log_save_evaluate``, when the step's bookkeeping (loss sums, FLOPs, log entry, LR scheduler) is done.

Call order: ``set_resume(fn)`` (and ``set_step_end(fn)``), then ``apply()`` (before ``Trainer.train``). Tested with
transformers 5.24; the private methods it wraps are checked to exist. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")

MEMORY = "<deadpool memory>"
"""What ``_run_epoch`` is given as ``resume_from_checkpoint`` for the resumed epoch: not a directory, so the
Trainer's RNG-file lookup finds nothing (the extension restored the RNG itself)."""
STEP_ATTR = "_deadpool_resumed_step"
LOOP_ATTR = "_deadpool_loop_state"
"""Set by ``resume``: the training loop's own accumulators at the restored step, applied by the resumed epoch."""
START_ATTR = "_deadpool_start_time"
"""The resumed loop's ``start_time`` (moved back by the restored ``elapsed_s``), for ``_finalize_training``."""


def apply_loop_state(trainer: Any, loop: dict[str, Any]) -> float | None:
    """Set what ``_inner_training_loop`` initialised to a fresh run's values to the restored run's: ``tr_loss``
    (this rank's running loss since the last log, a float of the tensor's value), ``total_loss_scalar``,
    ``globalstep_last_logged``, ``initial_global_step``, ``initial_num_input_tokens_seen``, ``current_flos`` (this
    rank's FLOPs not yet summed into ``total_flos``); returns the ``start_time`` that ``elapsed_s`` implies."""
    import torch

    if "tr_loss" in loop:
        old = getattr(trainer, "_tr_loss", None)
        if isinstance(old, torch.Tensor):
            trainer._tr_loss = torch.full_like(old, float(loop["tr_loss"]))
        else:
            trainer._tr_loss = torch.tensor(float(loop["tr_loss"]))
    for key, attr in (("total_loss_scalar", "_total_loss_scalar"),
                      ("globalstep_last_logged", "_globalstep_last_logged"),
                      ("initial_global_step", "_initial_global_step"),
                      ("initial_num_input_tokens_seen", "_initial_num_input_tokens_seen"),
                      ("current_flos", "current_flos")):
        if key in loop:
            setattr(trainer, attr, loop[key])
    if "elapsed_s" in loop:
        return time.time() - float(loop["elapsed_s"])
    return None


class TrainerResume(Patch):
    name = "transformers_trainer_resume"
    requires = {"transformers": ">=5.0,<6"}
    why = "the HF Trainer continues from the step restored from memory after its engine was built"

    def __init__(self) -> None:
        super().__init__()
        self._resume: Callable[[Any], int | None] | None = None
        self._step_end: Callable[[Any, float], None] | None = None

    def set_resume(self, fn: Callable[[Any], int | None]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_resume() after apply()")
        self._resume = fn

    def set_step_end(self, fn: Callable[[Any, float], None] | None) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_step_end() after apply()")
        self._step_end = fn

    def _apply(self) -> None:
        from transformers import trainer as trainer_module

        cls = trainer_module.Trainer
        resume = self._resume
        if resume is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_resume()")
        step_end = self._step_end
        prepare, run_epoch, load_rng = cls._prepare_for_training, cls._run_epoch, cls._load_rng_state
        finalize, log_save = cls._finalize_training, cls._maybe_log_save_evaluate

        @functools.wraps(prepare)
        def _prepare_for_training(trainer: Any, max_steps: Any, train_dataloader: Any,
                                  resume_from_checkpoint: Any) -> Any:
            out = prepare(trainer, max_steps, train_dataloader, resume_from_checkpoint)
            setattr(trainer, STEP_ATTR, None)
            setattr(trainer, LOOP_ATTR, None)
            setattr(trainer, START_ATTR, None)
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
                loop = getattr(trainer, LOOP_ATTR, None)
                if loop:
                    setattr(trainer, LOOP_ATTR, None)
                    start = apply_loop_state(trainer, loop)
                    if start is not None:
                        setattr(trainer, START_ATTR, start)
            start = getattr(trainer, START_ATTR, None)
            if start is not None:
                kwargs["start_time"] = start  # the whole run's (later epochs too)
                log.info("Trainer resumes at step %d: epoch %d, %d batch(es) of it skipped", step, epoch_r,
                         kwargs["steps_trained_in_current_epoch"])
            return run_epoch(trainer, **kwargs)

        @functools.wraps(load_rng)
        def _load_rng_state(trainer: Any, checkpoint: Any) -> Any:
            if checkpoint == MEMORY:
                return None  # restored with the engine from memory; there is no RNG file to look for
            return load_rng(trainer, checkpoint)

        @functools.wraps(finalize)
        def _finalize_training(trainer: Any, trial: Any, num_train_samples: Any, start_time: Any) -> Any:
            start = getattr(trainer, START_ATTR, None)
            return finalize(trainer, trial, num_train_samples, start if start is not None else start_time)

        @functools.wraps(log_save)
        def _maybe_log_save_evaluate(trainer: Any, tr_loss: Any, grad_norm: Any, model: Any, trial: Any, epoch: Any,
                                     ignore_keys_for_eval: Any, start_time: Any, *args: Any, **kwargs: Any) -> Any:
            out = log_save(trainer, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, *args,
                           **kwargs)
            if step_end is not None:
                step_end(trainer, start_time)
            return out

        self._swap(cls, "_prepare_for_training", _prepare_for_training)
        self._swap(cls, "_finalize_training", _finalize_training)
        self._swap(cls, "_maybe_log_save_evaluate", _maybe_log_save_evaluate)
        self._swap(cls, "_run_epoch", _run_epoch)
        self._swap(cls, "_load_rng_state", _load_rng_state)


PATCH = TrainerResume()
apply = PATCH.apply
revert = PATCH.revert
