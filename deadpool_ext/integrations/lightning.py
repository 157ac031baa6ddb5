"""Lightning (``lightning.pytorch`` with ``DeepSpeedStrategy``): a restarted job continues from the step restored
from memory, and under deadpool-run a failed step is recovered in place and redone, with nothing changed in the
job's script (``patches/lightning_fit_loop.py``).

The engine is built (and the extension attached) by the hook on ``deepspeed.initialize`` inside the strategy's
``setup``. When the fit loop starts, :func:`resume_fit` restores the newest step every rank holds
(``engine.deadpool.resume()``, which also restores the RNG) and positions the loop there: Lightning's progress
counters as Lightning holds them after that step (``lightning_state.fit_loop_state``, loaded with
``fit_loop.load_state_dict`` like one of Lightning's own mid-epoch checkpoints), the sampler's epoch set by Lightning,
and the epoch's batches already used drawn and dropped, so the next batch is the one an uninterrupted run would
see. What the snapshot carries of Lightning itself (client state): its LR schedulers' state (Lightning takes
DeepSpeed's scheduler out of the engine and steps it itself, so the engine's own state does not hold it).

Hot-swap (in place): the lost peer's error unwinds the fit loop; :func:`recover_fit` swaps the communicators beneath
the engine, restores it in place (the same engine, optimizer, scheduler and LightningModule) and positions the loop
at the restored step; the loop runs again and redoes the interrupted step (all its micro-batches). The spare, a
fresh process running the same script, takes the restore path at its loop's start, collective for collective: the
restore first, then the loop's data set-up (a barrier and a length all-reduce), on every rank in that order.

What a job must provide: a train dataloader with a length (the position is computed from the batches of an
epoch), the same order for the same epoch (Lightning's ``DistributedSampler``, a seeded sampler), no validation
inside an epoch whose progress matters (validation counters restart at zero), and ``lightning.pytorch`` (the
separate ``pytorch_lightning`` distribution is not hooked).

Installed by ``python -m deadpool_ext.run`` / ``deadpool-run`` / ``import deadpool_ext.auto`` when the job imports
``lightning.pytorch``; on a machine without CUDA the same also lets Lightning's ``DeepSpeedStrategy`` run on
DeepSpeed's CPU accelerator (``patches/lightning_deepspeed_cpu.py``, logged).
"""
from __future__ import annotations

import base64
import logging
import warnings
from typing import Any

from ..config import ConfigError
from ..recovery.timeline import write_event
from .importhook import after_import
from .lightning_state import fit_loop_state
from .loaders import generators as _generators
from .transformers_trainer import _plain  # JSON-safe values of a scheduler's state

log = logging.getLogger("deadpool_ext")


class NotPositionableError(ConfigError):
    """The fit loop cannot be set to a restored step (a train dataloader without a length): the runner prints it
    as one line and exits with status 2."""


def _runtime(trainer: Any) -> Any:
    strategy = getattr(trainer, "strategy", None)
    return getattr(getattr(strategy, "model", None), "deadpool", None)


def _schedulers(trainer: Any) -> list[Any]:
    return [c.scheduler for c in (getattr(trainer, "lr_scheduler_configs", None) or [])
            if hasattr(c.scheduler, "state_dict")]


class _LoopRecord:
    """What the extension keeps on a fit loop: the shuffle state at the current epoch's start, the client state
    the last restore handed back, and the position to apply when the restored epoch starts."""

    def __init__(self) -> None:
        self.epoch_rng: list[str] = []
        self.restored: dict[str, Any] = {}
        self.pending: tuple[int, list[str], int] | None = None
        """(epoch, generator states at its start, batches of it to drop) for the next start of that epoch."""


def _record(loop: Any) -> _LoopRecord:
    rec = loop.__dict__.get("_deadpool")
    if rec is None:
        rec = loop.__dict__["_deadpool"] = _LoopRecord()
    return rec


def _loader_generators(loop: Any) -> list[Any]:
    combined = getattr(loop, "_combined_loader", None)
    return [g for dl in (getattr(combined, "flattened", None) or []) for g in _generators(dl)]


def _rng_states(gens: list[Any]) -> list[str]:
    return [base64.b64encode(g.get_state().numpy().tobytes()).decode() for g in gens]


def _set_rng_states(gens: list[Any], states: list[str]) -> bool:
    if not states or len(states) != len(gens):
        return False
    import torch

    for g, s in zip(gens, states):
        g.set_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))
    return True


def lightning_state(loop: Any) -> dict[str, Any]:
    """What the snapshot carries of Lightning (JSON): the state of every LR scheduler Lightning steps, and the
    data position's shuffle state (the train loader's generators at the current epoch's start, and now)."""
    trainer = loop.trainer
    return {"lightning": {
        "lr_schedulers": [{k: v for k, v in s.state_dict().items() if _plain(v)} for s in _schedulers(trainer)],
        "data": {"epoch": int(trainer.current_epoch), "start": list(_record(loop).epoch_rng),
                 "now": _rng_states(_loader_generators(loop))}}}


def set_lightning_state(loop: Any, state: dict[str, Any]) -> None:
    """The LR schedulers' state from a restored client state (the data position: :func:`position_fit_loop`)."""
    trainer = loop.trainer
    saved = state.get("lightning") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return
    scheds, states = _schedulers(trainer), saved.get("lr_schedulers") or []
    if len(scheds) != len(states):
        log.warning("Lightning: the restored step carries %d LR scheduler state(s), the job has %d: schedulers "
                    "left as they are", len(states), len(scheds))
        return
    for s, st in zip(scheds, states):
        if isinstance(st, dict):
            s.load_state_dict({**s.state_dict(), **st})


def position_fit_loop(loop: Any, step: int, restored: dict[str, Any] | None = None, runtime: Any = None) -> None:
    """Set ``loop`` (a ``_FitLoop``) to continue after optimizer step ``step``: a new train dataloader iterator,
    Lightning's counters as after that step, the loader's shuffle state and the epoch's used batches applied when
    the epoch starts again (:func:`epoch_start`). ``restored``: the client state of that step; ``runtime``: the
    extension's runtime that restored it (its RNG)."""
    trainer = loop.trainer
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
    data = ((restored or {}).get("lightning") or {}).get("data") or {}
    loop._combined_loader = None  # setup_data builds the loader and its iterator again (collective, on every rank)
    loop.setup_data()
    batches = loop.max_batches
    if not isinstance(batches, int) or batches <= 0:
        raise NotPositionableError(
            f"Lightning: the train dataloader has no length ({batches!r} batches): the fit loop cannot be set to "
            f"the restored step {step}; give the dataloader a __len__")
    accumulate = int(trainer.accumulate_grad_batches)
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    state, pos = fit_loop_state(step, batches, accumulate,
                                step_schedulers=sum(1 for c in configs if c.interval == "step"),
                                epoch_schedulers=sum(1 for c in configs if c.interval == "epoch"))
    loop.load_state_dict(state)
    # Lightning warns that a mid-epoch restart of a loader without state repeats the epoch's first batches; here the
    # extension drops them itself (epoch_start), so that one warning is silenced (logged instead, below).
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
    # The snapshot was taken inside step S's optimizer step; Lightning steps its "step"-interval schedulers right
    # after it (before on_train_batch_end, where the loop now stands): that update is done here, by Lightning's own
    # rule (frequency, accumulation), and its progress counters set back to the state just loaded.
    loop.epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)
    loop.epoch_loop.scheduler_progress.load_state_dict(state["epoch_loop.scheduler_progress"])
    gens = _loader_generators(loop)
    if gens and data.get("epoch") != pos.epoch:
        log.warning("Lightning: the restored step %d carries no shuffle state of epoch %d: the loader's order "
                    "after the restore may differ from an uninterrupted run's", step, pos.epoch)
        data = {}
    rec = _record(loop)
    if pos.batches_used < batches:
        rec.pending = (pos.epoch, list(data.get("start") or []), pos.batches_used)
    else:
        # The step ended its epoch. Lightning takes the iterator setup_data created over for the next epoch, so it
        # is created again the way the uninterrupted run created it after the snapshot: from the restored global
        # RNG (a DataLoader iterator draws its base seed there) and the loader generators' state after this epoch.
        rec.pending = None
        if runtime is not None:
            runtime.settle_rng()
        _set_rng_states(gens, list(data.get("now") or []))
        iter(loop._data_fetcher)
    log.info("Lightning: fit loop set to step %d (epoch %d, %d of its %d batch(es) used, accumulation %d)",
             step, pos.epoch, pos.batches_used, batches, accumulate)


def epoch_start(epoch_loop: Any, data_fetcher: Any) -> None:
    """An epoch's iterator exists, none of its batches drawn: after a restore of this epoch, set the loader's
    shuffle state back and drop the batches already used; record the shuffle state at the epoch's start."""
    loop = epoch_loop.trainer.fit_loop
    rec = _record(loop)
    gens = _loader_generators(loop)
    skip = 0
    if rec.pending is not None and rec.pending[0] == int(epoch_loop.trainer.current_epoch):
        _, states, skip = rec.pending
        rec.pending = None
        _set_rng_states(gens, states)
    rec.epoch_rng = _rng_states(gens)
    for _ in range(skip):
        next(data_fetcher.iterator)  # not through the fetcher: Lightning counts them as fetched already


def resume_fit(loop: Any) -> None:
    """At the fit loop's start: restore the engine from memory (collective) and position the loop there."""
    runtime = _runtime(loop.trainer)
    if runtime is None:
        return
    rec = _record(loop)

    def put(st: dict[str, Any]) -> None:
        rec.restored.clear()
        rec.restored.update(st)

    runtime.loaders.claim("lightning")  # position_fit_loop positions the loader itself
    runtime.loop_owner = "lightning"  # and its fit loop runs again after an in-place recovery
    runtime.set_client_state(lambda: lightning_state(loop), put)
    step = int(runtime.resume() or 0)
    if not step:
        return
    set_lightning_state(loop, rec.restored)
    position_fit_loop(loop, step, rec.restored, runtime)
    log.info("Lightning: continuing from step %d restored from memory", step)
    write_event(event="continued", framework="lightning", how="restart", step=step)


def recover_fit(loop: Any, exc: BaseException) -> bool:
    """A failure inside the fit loop: under deadpool-run with the in-place hot-swap, swap the communicators,
    restore the engine in place and position the loop at the restored step (True); otherwise False (the error
    propagates as without the extension)."""
    runtime = _runtime(loop.trainer)
    if runtime is None or runtime.handle_failure(exc, same_objects=True) is None:
        return False
    step = int(runtime.step_counter())
    rec = _record(loop)
    set_lightning_state(loop, rec.restored)
    position_fit_loop(loop, step, rec.restored, runtime)
    log.info("Lightning: recovered in place at step %d; the fit loop runs again from there", step)
    write_event(event="continued", framework="lightning", how="in_place", step=step)
    return True


def install(*, lazy: bool = True) -> None:
    """Apply the Lightning patches once ``lightning.pytorch`` is imported (now with ``lazy=False``)."""

    def now() -> None:
        from .. import patches  # type: ignore[attr-defined]

        fit = patches.get("lightning_fit_loop")
        if fit.applied:
            return
        fit.set_hooks(resume_fit, recover_fit, epoch_start)
        names = ["lightning_fit_loop"]
        import torch

        if not torch.cuda.is_available():
            names.append("lightning_deepspeed_cpu")
        try:
            patches.apply_all(names)
        except patches.UnsupportedVersionError as exc:
            log.warning("Lightning: %s; a restarted Lightning job starts from its own checkpoints only and a "
                        "failed step is not hot-swapped", exc)

    if lazy:
        after_import("lightning.pytorch", now)
    else:
        now()
