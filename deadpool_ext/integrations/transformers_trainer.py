"""Hugging Face ``Trainer``: a restarted job continues from the step restored from memory, through the Trainer's own
resume machinery (``patches/transformers_trainer_resume.py``), and under deadpool-run a failed step is recovered
in place and redone (``patches/transformers_trainer_hot_swap.py``), with nothing changed in the job's script.

Hot-swap (in place): the lost peer's error unwinds the Trainer's loop; :func:`recover_trainer` swaps the
communicators beneath the engine and restores it in place (the same objects: engine, optimizer, scheduler), the
hook on ``deepspeed.initialize`` hands the kept engine to the re-entered loop (Accelerate's ``prepare`` wraps it
again), and :func:`resume_trainer` gives the loop the restored step: the Trainer skips the batches of the steps
done, like a restarted job, and redoes the interrupted step (all its micro-batches). The spare, a fresh process
running the same script, takes the restart path. What the snapshot carries of the Trainer itself (client state):
its own torch LR scheduler when DeepSpeed does not own the schedule, ``total_flos`` and ``num_input_tokens_seen``.
Survivors keep their ``log_history`` up to the restored step; the spare's starts empty.

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


IN_PLACE_ATTR = "_deadpool_in_place"
"""Set on a Trainer recovered in place: (restored step, log history up to it) for the re-entered loop."""


def _client_box(trainer: Any) -> dict[str, Any]:
    """The client state the last restore handed back, kept on the Trainer."""
    box: dict[str, Any] = trainer.__dict__.setdefault("_deadpool_client", {})
    return box


def _runtime(trainer: Any) -> Any:
    return getattr(getattr(trainer, "model_wrapped", None), "deadpool", None)


def _torch_scheduler(trainer: Any) -> Any:
    """The Trainer's own torch LR scheduler, when DeepSpeed does not own the schedule (no ``scheduler`` section:
    Accelerate wraps the Trainer's scheduler instead of passing it to DeepSpeed), else None."""
    sched = getattr(trainer, "lr_scheduler", None)
    inner = getattr(sched, "scheduler", sched)  # AcceleratedScheduler -> the torch scheduler
    if inner is None or type(sched).__name__ == "DeepSpeedSchedulerWrapper" or not hasattr(inner, "state_dict"):
        return None
    return inner


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_plain(x) for x in v)) or (
        isinstance(v, dict) and all(isinstance(k, str) and _plain(x) for k, x in v.items()))


def _trainer_state(trainer: Any) -> dict[str, Any]:
    """What the snapshot carries of the Trainer's own bookkeeping (JSON): its LR scheduler when DeepSpeed does
    not own it, and the TrainerState counters that are not derived from the step."""
    st = trainer.state
    out: dict[str, Any] = {"total_flos": float(getattr(st, "total_flos", 0.0) or 0.0),
                           "num_input_tokens_seen": int(getattr(st, "num_input_tokens_seen", 0) or 0)}
    sched = _torch_scheduler(trainer)
    if sched is not None:
        sd = {k: v for k, v in sched.state_dict().items() if _plain(v)}
        out["lr_scheduler"] = sd
    return {"hf_trainer": out}


def _set_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    saved = state.get("hf_trainer") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return
    st = trainer.state
    st.total_flos = float(saved.get("total_flos", 0.0))
    st.num_input_tokens_seen = int(saved.get("num_input_tokens_seen", 0))
    sched = _torch_scheduler(trainer)
    if sched is not None and isinstance(saved.get("lr_scheduler"), dict):
        sched.load_state_dict({**sched.state_dict(), **saved["lr_scheduler"]})


def resume_trainer(trainer: Any) -> int | None:
    """Restore the engine the Trainer just built from memory; the step to continue from, or None. After an
    in-place recovery (:func:`recover_trainer`) the engine is already restored: its step, without a restore."""
    runtime = _runtime(trainer)
    if runtime is None:
        return None
    pending = getattr(trainer, IN_PLACE_ATTR, None)
    restored = _client_box(trainer)

    def put(st: dict[str, Any]) -> None:
        restored.clear()
        restored.update(st)

    runtime.set_client_state(lambda: _trainer_state(trainer), put)
    if pending is not None:
        setattr(trainer, IN_PLACE_ATTR, None)
        step, history, trainer_state = pending
        trainer.state.log_history = history
        _set_trainer_state(trainer, trainer_state)
        log.info("HF Trainer: continuing in place from step %d (same engine, optimizer and scheduler; %d log "
                 "entries kept)", step, len(history))
        return int(step) or None
    step = runtime.resume()
    if not step:
        return None
    _set_trainer_state(trainer, restored)
    log.info("HF Trainer: continuing from step %d restored from memory (TrainerState.global_step = %d; the "
             "Trainer skips the batches of the steps already done)", step, step)
    return int(step)


def recover_trainer(trainer: Any, exc: BaseException) -> bool:
    """A failure inside the Trainer's loop: under deadpool-run with the in-place hot-swap, swap the communicators,
    restore the engine in place and have the loop re-entered at the restored step (True); otherwise False (the
    error propagates as without the extension)."""
    runtime = _runtime(trainer)
    if runtime is None or not getattr(runtime, "in_place", False) or not runtime.can_recover(exc):
        return False
    from .deepspeed_hook import reuse_engine

    engine = runtime.recover(exc)
    step = int(runtime.step_counter())
    restored = dict(_client_box(trainer))  # what the restore handed back (the setter registered by resume_trainer)
    history = [e for e in trainer.state.log_history if int(e.get("step", 0)) <= step]
    setattr(trainer, IN_PLACE_ATTR, (step, history, restored))
    reuse_engine(engine)
    log.info("HF Trainer: recovered in place at step %d; the training loop is re-entered there", step)
    return True


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
        swap = patches.get("transformers_trainer_hot_swap")
        if resume.applied:
            return
        resume.set_resume(resume_trainer)
        logs.set_extra(trainer_metrics)
        swap.set_recover(recover_trainer)
        try:
            patches.apply_all(["transformers_trainer_resume", "transformers_trainer_logs",
                               "transformers_trainer_hot_swap"])
        except patches.UnsupportedVersionError as exc:
            log.warning("HF Trainer: %s; a restarted Trainer job starts from its own checkpoints only, a failed step "
                        "is not hot-swapped, and its logs carry no deadpool metrics", exc)

    if lazy:
        after_import("transformers.trainer", now)
    else:
        now()
