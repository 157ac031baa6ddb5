"""A hot-swap that a plain pipeline loop (``loss = engine.train_batch()``) survives unchanged.

The pipeline engine runs a whole optimizer step inside ``train_batch``: its micro-batches come from the engine's
data iterator (``_next_batch``: DeepSpeed's own loader from ``training_data=``, or the ``data_iter`` the loop passes),
its forward and backward are instructions of the schedule. Under ``deadpool-run`` with the in-place swap,
:class:`BatchRedo` wraps ``train_batch``, ``_next_batch`` and ``save_checkpoint``:

- **recorded while training**, per ``train_batch`` call: the micro-batches its stage drew (references; only the first
  and last stages draw), and the torch RNG at its start (what dropout draws from);
- **a step done with its loss**: a stage's snapshot of a step is taken when its ``train_batch`` call returns, not at
  its optimizer step: the last stage broadcasts the loss after every stage stepped, so a stage lost in between leaves
  the step uncommitted, and the step is redone whole (its loss is the call's return value);
- **on a failure inside a call** (a lost stage neighbour: a point-to-point send or receive fails): the runtime's one
  failure path recovers in place to the committed version V (the pipeline's communicators rebuilt, its point-to-point
  state made as a fresh engine's: ``runtime._abandon_pipeline``); then every recorded call after V runs again through
  DeepSpeed's ``train_batch``, each from its recorded RNG and with its recorded micro-batches served first, up to the
  failed call, which is done the same way (its undrawn micro-batches from the iterator as before) and returns its
  loss. The spare, meanwhile, restores V through the script's ``load_checkpoint`` (its loader positioned there) and
  runs the same calls, stage for stage.

Shared with the plain data-parallel loop's redo (``redo.py``): the guard, the refusal line and the skipped save.

Call order: ``BatchRedo(engine, runtime)`` once at attach; the loop calls ``train_batch`` as always.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .redo import Redo


@dataclass
class BatchRecord:
    """One ``train_batch`` call (``after``: the engine's step counter before it)."""

    after: int
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None = None
    batches: list[Any] = field(default_factory=list)
    """The micro-batches this stage drew, in order (none on a middle stage)."""
    done: bool = False
    """``train_batch`` returned (``out``: what it returned, the step's loss)."""
    out: Any = None


def batch_redo_plan(records: list[BatchRecord], restored: int, failed: BatchRecord | None = None) -> str | None:
    """Why the recorded calls (and ``failed``, the interrupted call) cannot bring a survivor restored to ``restored``
    back (pure); None: they can."""
    oldest = records[0] if records else failed
    if oldest is None:
        return "nothing was recorded"
    if oldest.after > restored:
        return (f"the restored step {restored} is older than the oldest step recorded ({oldest.after + 1}): "
                "snapshots too far apart (snapshot.interval) or a commit that lagged")
    if failed is not None and failed.after < restored and not failed.done:
        return (f"step {failed.after + 1} is restored, but its train_batch call was interrupted before it had the "
                "step's loss")
    return None


class BatchRedo(Redo):
    """See the module docstring."""

    def __init__(self, engine: Any, runtime: Any) -> None:
        super().__init__(engine, runtime)
        self.records: list[BatchRecord] = []
        self._train_batch = engine.train_batch
        self._draw = engine._next_batch
        self._replay: deque[Any] = deque()
        self._stepped = False
        self._failed: BatchRecord | None = None
        engine.train_batch = self._guarded(self._do_train_batch)
        engine._next_batch = self._next_batch

    def _next_batch(self) -> Any:
        """The engine's next micro-batch: a recorded one while a call is redone, else drawn (and recorded)."""
        if self._replay:
            batch = self._replay.popleft()
        else:
            batch = self._draw()
        if self.records:
            self.records[-1].batches.append(batch)
        return batch

    def _do_train_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any], redo: BatchRecord | None = None) -> Any:
        if redo is None:
            cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
                    else None)  # type: ignore[no-untyped-call]
            rec = BatchRecord(after=int(self.engine.global_steps), rng=torch.get_rng_state(), cuda_rng=cuda)
        else:
            rec = BatchRecord(after=redo.after, rng=redo.rng, cuda_rng=redo.cuda_rng)
            torch.set_rng_state(redo.rng)
            if redo.cuda_rng is not None:
                torch.cuda.set_rng_state_all(redo.cuda_rng)
            self._replay = deque(redo.batches)
        self.records.append(rec)
        self._trim()
        self._stepped = False
        try:
            out = self._train_batch(*args, **kwargs)
        finally:
            self._replay.clear()
        rec.out, rec.done = out, True
        if self._stepped:  # the step's snapshot (and tier 3, a drain) now that the call has the step's loss
            self._stepped = False
            self.runtime._after_optimizer_step()
        return out

    def step_taken(self) -> None:
        """The stage's optimizer step ran (``runtime._wrap_pipeline_step``). Its snapshot waits for the end of the
        call: a step counts as done once ``train_batch`` has its loss, which the last stage broadcasts after every
        stage stepped; a stage lost in between leaves the step uncommitted, so it is redone whole, loss and all."""
        self._stepped = True

    # -- the redo -------------------------------------------------------------------------------------------
    def _failed_part(self, do: Callable[..., Any], failed_at: int) -> tuple[BatchRecord | None, str | None]:
        self._failed = None
        if do == self._do_train_batch and self.records:
            self._failed = self.records.pop()  # the call that failed: done again after the redo, its draws first
        return self._failed, None

    def _began_at(self, do: Callable[..., Any], failed_at: int) -> int:
        return self._failed.after if self._failed is not None else failed_at

    def _plan(self, restored: int) -> str | None:
        return batch_redo_plan(self.records, restored, self._failed)

    def _redo_then(self, do: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], restored: int,
                   failed: BatchRecord | None) -> Any:
        """Every recorded call after ``restored`` again, then the failed call itself."""
        settle = getattr(self.runtime, "settle_rng", None)
        if callable(settle):
            settle()  # each call below sets its own recorded RNG
        records = [r for r in self.records if r.after >= restored]
        self.records = []
        micros = 0
        for rec in records:
            micros += len(rec.batches)
            self._do_train_batch((), {}, redo=rec)
        self._redone_say(micros, restored, "train_batch" if do == self._do_train_batch else "save_checkpoint")
        if self._save_skipped(do, restored):
            return None
        if failed is not None:
            if failed.after < restored:  # its step is restored everywhere: the call had its loss
                return failed.out
            return self._do_train_batch(args, kwargs, redo=failed)
        return do(args, kwargs)
