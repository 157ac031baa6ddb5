"""Hugging Face ``Trainer``: a restarted job continues from the step restored from memory, through the Trainer's own
resume machinery (``patches/transformers_trainer_resume.py``), and under deadpool-run a failed step is recovered
in place and redone (``patches/transformers_trainer_hot_swap.py``), with nothing changed in the job's script.

Hot-swap (in place): the lost peer's error unwinds the Trainer's loop; :func:`recover_trainer` swaps the
communicators beneath the engine and restores it in place (the same objects: engine, optimizer, scheduler), the
hook on ``deepspeed.initialize`` hands the kept engine to the re-entered loop (Accelerate's ``prepare`` wraps it
again), and :func:`resume_trainer` gives the loop the restored step: the Trainer skips the batches of the steps
done, like a restarted job, and redoes the interrupted step (all its micro-batches). The spare, a fresh process
running the same script, takes the restart path.

The Trainer's own state rides in every snapshot, as it was at the *end* of the step (``snapshot/late.py``): the
snapshot is taken inside DeepSpeed's ``engine.step``, in the last micro-batch's backward, before the Trainer adds
that micro-batch's loss, counts its FLOPs, steps its LR scheduler and logs the step; so the Trainer posts its state
after ``_maybe_log_save_evaluate`` (:func:`trainer_step_end`, every rank) and the snapshot worker seals the version
with it. A step that fails before its post is never sealed: every rank restores the step before, whose state is
whole. The state (:class:`StepEnd`): every ``TrainerState`` field (``log_history``, ``global_step``, ``epoch``,
``total_flos``, ``num_input_tokens_seen``, best metric, callbacks' state), the loop's accumulators (this rank's
running loss since the last log and its FLOPs not yet summed, the loss sum behind ``train_loss``, the step last
logged, the run's first step) and the Trainer's own LR scheduler. After a restart or a hot-swap, whichever rank
was lost (rank 0 too: its snapshot comes from a peer's replica), ``trainer_state.json``'s ``log_history`` holds
every step once, and ``train_loss`` equals the uninterrupted run's bit for bit. ``total_flos`` equals the
uninterrupted run's too: it carries every step up to the restored one, and each step after it counts what the
uninterrupted run counted, because under ZeRO-3 the estimate counts the whole model
(``patches/transformers_trainer_flops.py``). HF's own estimate (``floating_point_ops``: 6 x tokens x
``num_parameters()``) counts only the parameters gathered at that moment under ZeRO-3, fewer in a process's first
step (DeepSpeed's prefetch; a plain run's step 1 counts about half), so a job that continued in a new process would
end below the uninterrupted run, and a plain torchrun run of the same script reports less than the job under the
extension.

``train_runtime`` (and the speed metrics from it) after a recovery: the training time of the steps that count,
i.e. the time up to the restored step in the attempt(s) before plus this attempt's time since it continued; the
time the failure cost (the work lost since the restored step, the restart or hot-swap) is not in it (the
recovery's own log lines and timeline give that). An uninterrupted run's value is its wall time, as in HF.

Header room: the history grows every logged step, and a slot's header is sized once per job, so the first snapshot
reserves room for the whole run from ``max_steps``, ``logging_steps`` and the evaluation schedule
(:func:`late_headroom`, at most 64 MiB); a history that still outgrows it keeps its newest entries and says so.

The engine is built (and the extension attached) by the hook on ``deepspeed.initialize`` inside
``Trainer._prepare_for_training``; right after it, :func:`resume_trainer` restores the newest step every rank
holds (``engine.deadpool.resume()``, which also restores the RNG) and hands the step to the Trainer, which
then skips the epochs and batches an uninterrupted run had consumed.

Installed by ``python -m deadpool_ext.run`` / ``deadpool-run`` / ``import deadpool_ext.auto`` when the job imports
``transformers.trainer``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from ..recovery.timeline import write_event
from .importhook import after_import

log = logging.getLogger("deadpool_ext")


IN_PLACE_ATTR = "_deadpool_in_place"
"""Set on a Trainer recovered in place: the restored step, for the re-entered loop."""
LATE_ATTR = "_deadpool_late"
"""The Trainer's step-end state the last restore handed back (None: the snapshot had none)."""
_NOTHING = object()

TRAIN_ENTRY_BYTES = 512
"""Header room per expected training log entry: the Trainer's loss, grad_norm, learning_rate, epoch, step, token
counts and the extension's ``deadpool/*`` metrics take about 220 bytes of JSON."""
EVAL_ENTRY_BYTES = 2048
"""Per expected evaluation entry (its metrics are the job's own, so a wider margin)."""
FIXED_BYTES = 16 << 10
"""The TrainerState's scalars, callbacks' state, the loop's accumulators and an LR scheduler's state."""
PROGRESS_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "best_metric", "best_global_step",
                   "best_model_checkpoint")
"""The TrainerState fields a snapshot carries besides ``log_history`` and the callbacks' state: what the run has
done. The others (max_steps, logging/eval/save steps, batch size, process-zero flags) are this launch's own
configuration and stay as the Trainer set them (a restart may change max_steps)."""
MAX_HEADROOM = 64 << 20
"""Header room is capped here (a history of ~130,000 entries): beyond it the oldest entries are left out, said."""


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
    """Taken with the snapshot when no step-end state can be (``snapshot.background: false``): the Trainer's LR
    scheduler when DeepSpeed does not own it and the TrainerState counters that are not derived from the step."""
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


# -- the step-end state (pure parts first) ------------------------------------------------------------------

def expected_log_entries(max_steps: int, logging_steps: float, eval_every: float | None,
                         epochs: int = 1) -> tuple[int, int]:
    """(training entries, evaluation entries) a run of ``max_steps`` logs: one per ``logging_steps`` (and one at
    each epoch's end), one evaluation per ``eval_every`` steps (None: no evaluation)."""
    train = -(-max_steps // max(1, int(logging_steps))) + max(1, epochs) + 1
    evals = 0 if not eval_every else -(-max_steps // max(1, int(eval_every))) + max(1, epochs)
    return train, evals


def late_headroom(train_entries: int, eval_entries: int) -> int:
    """Header bytes to reserve for the Trainer's step-end state over the whole run (capped at MAX_HEADROOM)."""
    return min(MAX_HEADROOM, FIXED_BYTES + TRAIN_ENTRY_BYTES * train_entries + EVAL_ENTRY_BYTES * eval_entries)


def fit_history(sizes: list[int], room: int) -> int:
    """How many of the oldest log entries to leave out so that the rest (``sizes``: each entry's bytes, oldest
    first) fits in ``room`` bytes; 0 when all fit."""
    total, cut = sum(sizes), 0
    while total > room and cut < len(sizes):
        total -= sizes[cut]
        cut += 1
    return cut


class StepEnd:
    """What the Trainer posts after each step (``snapshot/late.py``), and what a restore gives back to it.

    The section: ``state`` (the TrainerState's progress, :data:`PROGRESS_FIELDS`, and its callbacks' state),
    ``log_history``, ``loop`` (the training loop's accumulators: this rank's
    running loss since the last log and its FLOPs not yet summed, the loss sum behind ``train_loss``, the step last
    logged, the first step of the run, the training time so far) and the Trainer's own LR scheduler's state when
    DeepSpeed does not own it. The history's entries' sizes are remembered, so a step costs the new entries only
    (plus the encoding of the section the worker writes)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self._sizes: list[tuple[int, int]] = []  # (id(entry), JSON bytes), aligned with log_history
        self.dropped_warned = False

    def _entry_sizes(self, history: list[Any]) -> list[int]:
        from ..snapshot.late import encode, encoded_nbytes

        sizes = self._sizes
        del sizes[len(history):]
        for i, entry in enumerate(history):
            if i < len(sizes) and sizes[i][0] == id(entry):
                continue
            del sizes[i:]
            sizes.append((id(entry), encoded_nbytes(encode({"e": entry})) + 1))
        return [n for _, n in sizes]

    def capture(self, trainer: Any, start_time: float) -> dict[str, Any]:
        from transformers.trainer_callback import ExportableState

        st = trainer.state
        fields = {name: getattr(st, name) for name in PROGRESS_FIELDS if hasattr(st, name)}
        callbacks: dict[str, Any] = {}
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                prev = callbacks.get(name)
                callbacks[name] = cb.state() if prev is None else [*(prev if isinstance(prev, list) else [prev]),
                                                                  cb.state()]
        fields["stateful_callbacks"] = callbacks
        tr_loss = getattr(trainer, "_tr_loss", None)
        # the running loss stays a tensor (a copy): the snapshot worker reads it, the training thread never
        # waits for the device here (HF itself reads it only at logging steps)
        loop = {"tr_loss": tr_loss.detach().clone() if tr_loss is not None else 0.0,
                "total_loss_scalar": float(getattr(trainer, "_total_loss_scalar", 0.0)),
                "globalstep_last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
                "initial_global_step": int(getattr(trainer, "_initial_global_step", 0)),
                "initial_num_input_tokens_seen": int(getattr(trainer, "_initial_num_input_tokens_seen", 0)),
                "current_flos": float(getattr(trainer, "current_flos", 0.0)),
                "elapsed_s": max(0.0, time.time() - float(start_time))}
        history = list(st.log_history)
        section: dict[str, Any] = {"state": fields, "loop": loop}
        sched = _torch_scheduler(trainer)
        if sched is not None:
            section["lr_scheduler"] = {k: v for k, v in sched.state_dict().items() if _plain(v)}
        sizes = self._entry_sizes(history)
        from ..snapshot.late import encode, encoded_nbytes

        # sized without reading the loss tensor (a float's JSON is at most 24 characters)
        sized = {**section, "loop": {**loop, "tr_loss": 0.0}}
        cut = fit_history(sizes, self.room - encoded_nbytes(encode(sized)) - 64 - 24)
        if cut:
            if not self.dropped_warned:
                self.dropped_warned = True
                log.warning("HF Trainer: log_history (%d entries, %d bytes) outgrew the snapshot header's room for "
                            "the Trainer's state (%d bytes, sized from max_steps / logging_steps at the first "
                            "snapshot): the oldest %d entries are left out of the snapshots from step %d on; after a "
                            "recovery trainer_state.json starts at step %s", len(history), sum(sizes), self.room, cut,
                            st.global_step, history[cut].get("step") if cut < len(history) else st.global_step)
            section["log_history_dropped"] = cut
        section["log_history"] = history[cut:]
        return section


def _arm(trainer: Any, runtime: Any) -> StepEnd | None:
    """Before the first snapshot and before a restore: the snapshots carry the Trainer's step-end state."""
    snaps = getattr(runtime, "snapshots", None)
    if snaps is None:
        return None
    existing: StepEnd | None = trainer.__dict__.get("_deadpool_step_end")
    if existing is not None and snaps.late is not None:
        return existing
    st, args = trainer.state, trainer.args
    strategy = str(getattr(args, "eval_strategy", "no")).split(".")[-1].lower()
    eval_every = (st.eval_steps if strategy == "steps" else (st.max_steps / max(1, st.num_train_epochs or 1))
                  if strategy == "epoch" else None)
    train, evals = expected_log_entries(int(st.max_steps), st.logging_steps or 1, eval_every,
                                        int(st.num_train_epochs or 1))
    room = late_headroom(train, evals)

    def restored(section: dict[str, Any] | None) -> None:
        trainer.__dict__[LATE_ATTR] = section

    if not snaps.arm_late(restored, room):
        log.warning("HF Trainer: snapshot.background is false, so the snapshots carry the Trainer's state as of the "
                    "optimizer step: after a recovery log_history starts at the restored step and train_loss covers "
                    "the steps after it")
        return None
    step_end = trainer.__dict__["_deadpool_step_end"] = StepEnd(room)
    return step_end


def trainer_step_end(trainer: Any, start_time: float) -> None:
    """After ``_maybe_log_save_evaluate`` (every rank): post the Trainer's state to the snapshot of this step."""
    runtime = _runtime(trainer)
    step_end: StepEnd | None = trainer.__dict__.get("_deadpool_step_end")
    late = getattr(getattr(runtime, "snapshots", None), "late", None)
    if step_end is None or late is None:
        return
    version = int(trainer.state.global_step)
    current = late.current
    if current is None or current.version != version or current.outcome != "pending":
        return  # no snapshot of this step waits (interval, or posted at the epoch's end already)
    late.post(version, step_end.capture(trainer, start_time))


def _apply_step_end(trainer: Any, section: dict[str, Any], step: int) -> int:
    """The restored Trainer as the uninterrupted run's was at the end of ``step``: TrainerState, log history, LR
    scheduler; the loop's accumulators wait for the resumed epoch (the patch applies them). Returns the number of
    log entries kept."""
    from ..patches import transformers_trainer_resume as resume_patch  # type: ignore[import-not-found]

    state = section.get("state") or {}
    st = trainer.state
    for key, value in state.items():
        if key in (*PROGRESS_FIELDS, "stateful_callbacks"):
            setattr(st, key, value)
    st.global_step = int(step)
    st.log_history = list(section.get("log_history") or [])
    if section.get("log_history_dropped"):
        log.warning("HF Trainer: the restored log_history lacks the %d oldest entries (they outgrew the snapshot "
                    "header's room for the Trainer's state)", section["log_history_dropped"])
    with contextlib.suppress(AttributeError):
        trainer._load_callback_state()  # the Trainer's own rule (restore_callback_states_from_checkpoint)
    sched = _torch_scheduler(trainer)
    if sched is not None and isinstance(section.get("lr_scheduler"), dict):
        sched.load_state_dict({**sched.state_dict(), **section["lr_scheduler"]})
    setattr(trainer, resume_patch.LOOP_ATTR, dict(section.get("loop") or {}))
    return len(st.log_history)


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

    step_end = _arm(trainer, runtime)
    runtime.loaders.claim("hf_trainer")  # the Trainer skips the batches done itself
    runtime.loop_owner = "hf_trainer"  # and its loop is re-entered after an in-place recovery
    runtime.set_client_state((lambda: {}) if step_end is not None else (lambda: _trainer_state(trainer)), put)
    if pending is not None:
        setattr(trainer, IN_PLACE_ATTR, None)
        step = int(pending)
        how = "continuing in place from step %d (same engine, optimizer and scheduler)"
    else:
        trainer.__dict__[LATE_ATTR] = _NOTHING
        step = int(runtime.resume() or 0)
        if not step:
            return None
        how = "continuing from step %d restored from memory"
    section = trainer.__dict__.get(LATE_ATTR, _NOTHING)
    whole = isinstance(section, dict) and int((section.get("state") or {}).get("global_step", -1)) == step
    write_event(event="continued", framework="hf_trainer", how="in_place" if pending is not None else "restart",
                step=step, trainer_state="as_uninterrupted" if whole else "without_step_end")
    if whole:
        assert isinstance(section, dict)
        kept = _apply_step_end(trainer, section, step)
        log.info("HF Trainer: " + how + "; the Trainer's state as the uninterrupted run had it at that step "
                 "(log_history %d entries, total_flos, the loss sum behind train_loss)", step, kept)
    else:
        _set_trainer_state(trainer, restored)
        if step_end is not None:
            log.warning("HF Trainer: the snapshot of step %d carries no Trainer state of that step: log_history "
                        "starts empty and train_loss covers the steps after it", step)
        log.info("HF Trainer: " + how, step)
    if pending is None:
        log.info("HF Trainer: TrainerState.global_step = %d; the Trainer skips the batches of the steps already "
                 "done", step)
    return step or None


def recover_trainer(trainer: Any, exc: BaseException) -> bool:
    """A failure inside the Trainer's loop: under deadpool-run with the in-place hot-swap, swap the communicators,
    restore the engine in place and have the loop re-entered at the restored step (True); otherwise False (the
    error propagates as without the extension)."""
    runtime = _runtime(trainer)
    if runtime is None:
        return False
    from .deepspeed_hook import reuse_engine

    before = trainer.__dict__.get(LATE_ATTR, _NOTHING)
    trainer.__dict__[LATE_ATTR] = _NOTHING
    # The restore hands the Trainer's state of the restored step back (LATE_ATTR).
    engine = runtime.handle_failure(exc, same_objects=True)
    if engine is None:
        trainer.__dict__[LATE_ATTR] = before
        return False
    step = int(runtime.step_counter())
    setattr(trainer, IN_PLACE_ATTR, step)
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
        resume.set_step_end(trainer_step_end)
        logs.set_extra(trainer_metrics)
        swap.set_recover(recover_trainer)
        try:
            patches.apply_all(["transformers_trainer_resume", "transformers_trainer_logs",
                               "transformers_trainer_hot_swap", "transformers_trainer_flops"])
        except patches.UnsupportedVersionError as exc:
            log.warning("HF Trainer: %s; a restarted Trainer job starts from its own checkpoints only, a failed step "
                        "is not hot-swapped, its logs carry no deadpool metrics, and under ZeRO-3 its total_flos "
                        "counts only the parameters gathered when the Trainer asks", exc)

    if lazy:
        after_import("transformers.trainer", now)
    else:
        now()
