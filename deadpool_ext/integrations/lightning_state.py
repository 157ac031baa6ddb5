"""Where Lightning's fit loop stands after a given optimizer step (pure: no Lightning, no torch).

A restore from memory gives a step ``S`` (the engine's ``global_steps``). Lightning keeps its own account of the
run in its loops' progress counters (batches ready/started/processed/completed, optimizer steps, zero_grad calls,
scheduler updates, epochs) and restarts from them the way it restarts from one of its checkpoints:
``fit_loop.load_state_dict(...)``. :func:`fit_loop_state` computes that state dict as Lightning itself holds it at
``on_train_batch_end`` of the batch whose optimizer step made ``global_step == S`` (the point a Lightning
checkpoint saved every N train steps captures), from three numbers: ``S``, the batches of an epoch and
``accumulate_grad_batches``. Lightning steps the optimizer every ``accumulate`` batches and at an epoch's last
batch, so an epoch holds ``ceil(batches / accumulate)`` steps.

The layout is Lightning 2.6's (``lightning.pytorch.loops``); the unit test compares it, step for step across
epoch boundaries, with the state dicts a real Lightning run reports (``tests/unit/test_lightning_state.py``), and
the patch that uses it is version-guarded (``patches/lightning_fit_loop.py``).

Scheduler progress counts the updates of ``step``-interval schedulers (frequency 1) and of ``epoch``-interval ones
at each epoch's end; it is bookkeeping only (Lightning decides when to step a scheduler from other counters).
Validation progress starts at zero (validation inside an epoch is counted again after a restore).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FitPosition:
    """Where step ``step`` ends: in epoch ``epoch``, after ``batches_used`` of its batches."""

    step: int
    epoch: int
    batches_used: int
    steps_in_epoch: int
    """Optimizer steps of this epoch done by then (1 .. steps per epoch)."""


def position(step: int, batches_per_epoch: int, accumulate: int) -> FitPosition:
    """The epoch and batch at whose end optimizer step ``step`` (>= 1) is done."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if batches_per_epoch < 1 or accumulate < 1:
        raise ValueError(f"batches_per_epoch and accumulate must be >= 1, got {batches_per_epoch}, {accumulate}")
    per_epoch = -(-batches_per_epoch // accumulate)
    epoch = (step - 1) // per_epoch
    j = step - epoch * per_epoch
    return FitPosition(step=step, epoch=epoch, batches_used=min(j * accumulate, batches_per_epoch), steps_in_epoch=j)


def _four(n: int, completed: int) -> dict[str, int]:
    return {"ready": n, "completed": completed, "started": n, "processed": n}


def _zeros4() -> dict[str, int]:
    return {"ready": 0, "completed": 0, "started": 0, "processed": 0}


def fit_loop_state(step: int, batches_per_epoch: int, accumulate: int, *, step_schedulers: int = 0,
                   epoch_schedulers: int = 0) -> tuple[dict[str, Any], FitPosition]:
    """``fit_loop.state_dict()`` at ``on_train_batch_end`` of the batch that completed optimizer step ``step``,
    and where that is. ``step_schedulers`` / ``epoch_schedulers``: how many LR scheduler configs of each interval
    the module has (their update counts)."""
    pos = position(step, batches_per_epoch, accumulate)
    e, b, j = pos.epoch, pos.batches_used, pos.steps_in_epoch
    total_batches = e * batches_per_epoch + b
    sched_total = step * step_schedulers + e * epoch_schedulers
    sched_current = j * step_schedulers
    epochs = {"ready": e + 1, "completed": e, "started": e + 1, "processed": e}
    state: dict[str, Any] = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": step - 1},
        "epoch_loop.batch_progress": {"total": _four(total_batches, total_batches - 1),
                                      "current": _four(b, b - 1), "is_last_batch": b == batches_per_epoch},
        "epoch_loop.scheduler_progress": {"total": {"ready": sched_total, "completed": sched_total},
                                          "current": {"ready": sched_current, "completed": sched_current}},
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": {"total": {"ready": step, "completed": step}, "current": {"ready": j, "completed": j}},
            "zero_grad": {"total": {"ready": step, "completed": step, "started": step},
                          "current": {"ready": j, "completed": j, "started": j}}}},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": {"total": {"ready": 0, "completed": 0},
                                                               "current": {"ready": 0, "completed": 0}},
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": {"total": _zeros4(), "current": _zeros4(), "is_last_batch": False},
        "epoch_progress": {"total": dict(epochs), "current": dict(epochs)},
    }
    return state, pos
