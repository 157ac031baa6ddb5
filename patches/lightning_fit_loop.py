"""Lightning: a job restored from memory, or recovered in place after a lost peer, continues its fit loop at the
restored step, without the job's script knowing.

Why: Lightning's fit loop (``lightning.pytorch.loops``: data loader, epochs, gradient accumulation, progress
counters, schedulers, logging, callbacks) is Lightning's, not the script's; nothing outside it can catch a lost
peer's collective error and redo the step, and Lightning restarts mid-epoch only from its own checkpoints (and then
from the epoch's first batch, unless the loader is stateful). The patch wraps two methods:

- ``_FitLoop.run``: before the loop runs, ``resume(loop)`` (caller-supplied: restore the engine from memory, then
  position the loop); an exception that ``recover(loop, exc) -> bool`` handles (the communicators swapped, the
  engine restored in place, the loop positioned at the restored step) makes the loop run again. ``False`` (or an
  exception of ``recover``) re-raises the original error unchanged.
- ``_TrainingEpochLoop.on_run_start``: after Lightning's own (the epoch's iterator exists, no batch of it drawn
  yet), ``epoch_start(epoch_loop, data_fetcher)`` (caller-supplied: record the loader's shuffle state at the
  epoch's start, or, after a restore, set it back and draw and drop the batches already used, through
  ``data_fetcher.iterator``: Lightning counts those as fetched already).

Call order: ``set_hooks(resume, recover, epoch_start)``, then ``apply()`` (before ``Trainer.fit``). Tested with
lightning 2.6 (``lightning.pytorch``; the separate ``pytorch_lightning`` distribution is not patched). This module
imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")

class LightningFitLoop(Patch):
    name = "lightning_fit_loop"
    requires = {"lightning": ">=2.6,<2.7"}
    why = "a Lightning fit loop continues at a step restored from memory, and a failed step is recovered in place"

    def __init__(self) -> None:
        super().__init__()
        self._resume: Callable[[Any], None] | None = None
        self._recover: Callable[[Any, BaseException], bool] | None = None
        self._epoch_start: Callable[[Any, Any], None] | None = None

    def set_hooks(self, resume: Callable[[Any], None], recover: Callable[[Any, BaseException], bool],
                  epoch_start: Callable[[Any, Any], None]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_hooks() after apply()")
        self._resume, self._recover, self._epoch_start = resume, recover, epoch_start

    def _apply(self) -> None:
        from lightning.pytorch.loops import fit_loop, training_epoch_loop

        resume, recover, epoch_start = self._resume, self._recover, self._epoch_start
        if resume is None or recover is None or epoch_start is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_hooks()")
        run = fit_loop._FitLoop.run
        on_run_start = training_epoch_loop._TrainingEpochLoop.on_run_start

        @functools.wraps(run)
        def _run(loop: Any) -> Any:
            resume(loop)
            while True:
                try:
                    return run(loop)
                except Exception as exc:
                    if not recover(loop, exc):
                        raise
                log.info("Lightning: fit loop re-entered after an in-place recovery")

        @functools.wraps(on_run_start)
        def _on_run_start(epoch_loop: Any, data_fetcher: Any) -> Any:
            out = on_run_start(epoch_loop, data_fetcher)
            epoch_start(epoch_loop, data_fetcher)
            return out

        self._swap(fit_loop._FitLoop, "run", _run)
        self._swap(training_epoch_loop._TrainingEpochLoop, "on_run_start", _on_run_start)


PATCH = LightningFitLoop()
apply = PATCH.apply
revert = PATCH.revert
