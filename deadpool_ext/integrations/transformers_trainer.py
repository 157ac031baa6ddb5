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


def trainer_metrics(trainer: Any) -> dict[str, float]:
    """``deadpool/<metric>`` for the Trainer's log entries (snapshot blocking, size, commit lag, memory)."""
    runtime = getattr(getattr(trainer, "model_wrapped", None), "deadpool", None)
    snapshots = getattr(runtime, "snapshots", None)
    if snapshots is None:
        return {}
    return {f"deadpool/{k}": round(v, 4) for k, v in snapshots.metrics(int(trainer.state.global_step)).items()}


def install(*, lazy: bool = True) -> None:
    """Apply the Trainer patches once ``transformers.trainer`` is imported (now with ``lazy=False``)."""

    def now() -> None:
        from .. import patches  # type: ignore[attr-defined]

        resume, logs = patches.get("transformers_trainer_resume"), patches.get("transformers_trainer_logs")
        if resume.applied:
            return
        resume.set_resume(resume_trainer)
        logs.set_extra(trainer_metrics)
        try:
            patches.apply_all(["transformers_trainer_resume", "transformers_trainer_logs"])
        except patches.UnsupportedVersionError as exc:
            log.warning("HF Trainer: %s; a restarted Trainer job starts from its own checkpoints only, and its logs "
                        "carry no deadpool metrics", exc)

    if lazy:
        after_import("transformers.trainer", now)
    else:
        now()
