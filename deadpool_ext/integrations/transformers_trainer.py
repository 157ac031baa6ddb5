"""Hugging Face ``Trainer``: a restarted job continues from the step restored from memory, through the Trainer's own
resume machinery (``patches/transformers_trainer_resume.py``), with nothing changed in the job's script.

The engine is built (and the extension attached) by the hook on ``deepspeed.initialize`` inside
``Trainer._prepare_for_training``; right after it, :func:`resume_trainer` restores the newest step every rank
holds (``engine.deadpool.resume()``, which also restores the RNG) and hands the step to the Trainer, which
then skips the epochs and batches an uninterrupted run had consumed. ``TrainerState.global_step`` follows;
``log_history`` and callbacks' own state are not restored (they start empty after a restart).

Installed by ``python -m deadpool_ext.run`` / ``deadpool-run`` / ``import deadpool_ext.auto`` when the job imports
``transformers.trainer``.
"""
from __future__ import annotations

import logging
from typing import Any

from .importhook import after_import

log = logging.getLogger("deadpool_ext")


def resume_trainer(trainer: Any) -> int | None:
    """Restore the engine the Trainer just built from memory; the step to continue from, or None."""
    runtime = getattr(getattr(trainer, "model_wrapped", None), "deadpool", None)
    if runtime is None:
        return None
    step = runtime.resume()
    if not step:
        return None
    log.info("HF Trainer: continuing from step %d restored from memory (TrainerState.global_step = %d; the "
             "Trainer skips the batches of the steps already done)", step, step)
    return int(step)


def install(*, lazy: bool = True) -> None:
    """Apply the Trainer patch once ``transformers.trainer`` is imported (now with ``lazy=False``)."""

    def now() -> None:
        from .. import patches  # type: ignore[attr-defined]

        p = patches.get("transformers_trainer_resume")
        if p.applied:
            return
        p.set_resume(resume_trainer)
        try:
            p.apply()
        except patches.UnsupportedVersionError as exc:
            log.warning("HF Trainer: %s; a restarted Trainer job starts from its own checkpoints only", exc)

    if lazy:
        after_import("transformers.trainer", now)
    else:
        now()
