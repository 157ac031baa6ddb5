"""A hot-swap that a plain DeepSpeed loop survives unchanged: the interrupted step redone inside DeepSpeed's own calls.

A loop written as DeepSpeed's tutorials write it::

    for batch in loader:
        loss = engine(**batch).loss          # or engine(batch), if the model returns its loss
        engine.backward(loss)
        engine.step()

has no place where a lost peer could be caught and the step redone. Under ``deadpool-run`` with the in-place swap,
:class:`StepRedo` wraps ``engine.forward``, ``engine.backward`` and ``engine.step`` (and ``save_checkpoint``, a
collective too: a failure there redoes the steps after the restored version, then saves again):

- **recorded while training**: each micro-batch's forward inputs (references, not copies) and the torch RNG at its
  forward (what dropout draws from), how the loss handed to ``backward`` comes out of that forward's output (the
  output itself, an item or a key of it: ``.loss``), and the ``step`` calls; kept for every optimizer step newer than
  the newest committed snapshot (usually one, two while a snapshot commits);
- **on a failure inside one of the three calls**: the runtime's one failure path (``handle_failure``: recovered only
  when the launcher ended the generation, never by exception type) swaps the communicators and restores the engine
  in place to the committed version V; then every recorded micro-batch after V runs again through DeepSpeed's
  forward, backward and step on the restored state, each forward from its recorded RNG, up to the call that failed,
  which is then done and returns. The loop's next line sees what it would have seen (the same loss values, the
  engine at the same step); the spare, meanwhile, restores V through its script's ``load_checkpoint`` and trains the
  same micro-batches, collective for collective.

What is not redone, each said in one line when it happens: a loss the script computed from the forward's output
with code of its own (``criterion(engine(x), y)``: the extension cannot run that code again; return the loss from
the model's forward, or use ``resilient_steps``); a restored version older than the steps recorded.

Call order: ``StepRedo(engine, runtime, forward=..., backward=..., step=...)`` once at attach (the three are the
stoppable, snapshot-hooked calls beneath); the loop then calls the engine as always.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...recovery.timeline import write_event

log = logging.getLogger("deadpool_ext")

Accessor = tuple[str, Any]
"""How a loss comes out of a forward's output: ("self", None), ("item", i) or ("key", k); ("none", why): it does not."""


def loss_accessor(out: Any, loss: Any) -> Accessor:
    """How ``loss`` (what ``backward`` got) comes out of ``out`` (the forward's output), found by identity (pure)."""
    if loss is out:
        return ("self", None)
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if v is loss:
                return ("item", i)
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        for k, v in out.items():
            if v is loss:
                return ("key", k)
    for name in ("loss",):
        if getattr(out, name, None) is loss:
            return ("attr", name)
    return ("none", "computed from the forward's output by the script")


def apply_accessor(out: Any, how: Accessor) -> Any:
    kind, arg = how
    if kind == "self":
        return out
    if kind == "item":
        return out[arg]
    if kind == "key":
        return out[arg]
    if kind == "attr":
        return getattr(out, arg)
    raise ValueError(f"no loss accessor ({arg})")


@dataclass
class Micro:
    """One micro-batch of a step as the loop ran it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None = None
    loss: Accessor | None = None
    """Set by its backward."""
    stepped: bool = False
    """Its ``engine.step()`` ran."""


@dataclass
class StepRecord:
    """The micro-batches of one optimizer step (``after``: the engine's step counter before it)."""

    after: int
    micros: list[Micro] = field(default_factory=list)


def step_call_done(before: int, failed_at: int, restored: int) -> bool:
    """An ``engine.step()`` that failed with the engine's step counter at ``failed_at`` (``before`` when the call
    began) needs no redo when its optimizer step ran (the counter moved: the failure came after it, in the step's
    snapshot exchange or persist) and that step is the one restored (pure)."""
    return failed_at > before and restored >= failed_at


def redo_plan(records: list[StepRecord], restored: int) -> str | None:
    """Why the recorded calls cannot bring a survivor restored to ``restored`` back to where it was (pure); None:
    they can (every step after ``restored`` recorded, each loss reachable)."""
    if not records:
        return "nothing was recorded"
    if records[0].after > restored:
        return (f"the restored step {restored} is older than the oldest step recorded ({records[0].after + 1}): "
                "snapshots too far apart (snapshot.interval) or a commit that lagged")
    for rec in records:
        if rec.after < restored:
            continue
        for m in rec.micros:
            if m.loss is not None and m.loss[0] == "none":
                return f"the loss of step {rec.after + 1} was {m.loss[1]}"
    return None


class Redo(ABC):
    """What both redo flavours share: the ``save_checkpoint`` wrapper, the guard around a wrapped call, the recovery
    by the runtime's one failure path, the refusal line and the skipped save. A subclass records its calls
    (``records``: one entry per optimizer step, ``.after`` the engine's step counter before it), says before the
    recovery what of the failed call to keep (:meth:`_failed_part`) and why a redo is impossible (:meth:`_plan`),
    and redoes (:meth:`_redo_then`)."""

    def __init__(self, engine: Any, runtime: Any) -> None:
        self.engine, self.runtime = engine, runtime
        self.records: list[Any] = []
        self._redone = 0
        self._failed_at = 0
        self._save = engine.save_checkpoint
        engine.save_checkpoint = self._guarded(self._do_save)

    def _trim(self) -> None:
        """Keep the steps newer than the newest committed version (the oldest a restore can give)."""
        snapshots = getattr(self.runtime, "snapshots", None)
        committed = getattr(snapshots, "committed_version", None) if snapshots is not None else None
        if committed:
            self.records = [r for r in self.records if r.after >= int(committed)]

    def _do_save(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``save_checkpoint`` (collective): a lost peer during it is recovered, the steps after the restored one
        redone, and the save made again."""
        return self._save(*args, **kwargs)

    # -- the guard ------------------------------------------------------------------------------------------
    def _guarded(self, do: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            pending: tuple[int, Any] | None = None
            while True:
                try:
                    if pending is not None:
                        return self._redo_then(do, args, kwargs, *pending)
                    return do(args, kwargs)
                except Exception as exc:
                    pending = self._recover(exc, do)
                    if pending is None:
                        raise
        return call

    def _recover(self, exc: Exception, do: Callable[..., Any]) -> tuple[int, Any] | None:
        """Recover in place (the runtime decides, by cause); the restored step and what of the failed call the redo
        needs, or None: not recovered (the caller raises ``exc``)."""
        rt = self.runtime
        if rt.loop_owner is not None or rt.recovery_mode(same_objects=True).name != "IN_PLACE":
            return None  # a loop that handles failures itself (resilient_steps, a framework's), or no in-place swap
        failed_at = int(self.engine.global_steps)
        self._failed_at = failed_at
        failed, why = self._failed_part(do, failed_at)
        if why is not None:
            self._refuse(why, failed_at)
            return None
        calls = getattr(rt, "checkpoint_calls", None)
        if calls is not None:  # a spare's load_checkpoint counts from the survivors' loop (before any save)
            calls.publish_live(self._began_at(do, failed_at))
        if rt.handle_failure(exc, same_objects=True) is None:
            return None
        restored = int(self.engine.global_steps)
        why = self._plan(restored)
        if why is not None:
            self._refuse(why, restored)
            return None
        return restored, failed

    def _began_at(self, do: Callable[..., Any], failed_at: int) -> int:
        """The engine's step counter when the failed call ``do`` began (the loop's counters were read then)."""
        return failed_at

    @abstractmethod
    def _failed_part(self, do: Callable[..., Any], failed_at: int) -> tuple[Any, str | None]:
        """Before the recovery: what of the failed call ``do`` the redo needs, and why no redo is possible."""

    @abstractmethod
    def _plan(self, restored: int) -> str | None:
        """After the restore of ``restored``: why the recorded calls cannot bring the survivor back (None: they can)."""

    @abstractmethod
    def _redo_then(self, do: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], restored: int,
                   failed: Any) -> Any:
        """Every recorded call after ``restored`` again, then the failed call; returns what that call returns."""

    def _refuse(self, why: str, step: int) -> None:
        log.error("a lost peer interrupted step %d, and the plain loop cannot be carried through it in place (%s). "
                  "Fix: return the loss from the model's forward (engine(batch) or its .loss), or loop with `for "
                  "step in resilient_steps(engine, loader, max_steps=N)` (deadpool_ext.steps)", step + 1, why)
        write_event(event="redo_refused", rank=int(self.engine.global_rank), step=step, why=why)

    def _redone_say(self, micros: int, restored: int, call: str) -> None:
        self._redone += 1
        log.info("in-place recovery: %d micro-batch(es) after step %d redone through DeepSpeed's own calls; the "
                 "loop's %s call goes on", micros, restored, call)
        write_event(event="continued", framework="deepspeed", how="redo_in_place", step=restored, micros=micros,
                    rank=int(self.engine.global_rank))

    def _save_skipped(self, do: Callable[..., Any], restored: int) -> bool:
        """After a redo: the interrupted call was a save of a step the spare restored (so it will not save now;
        made again here it would wait for a collective nobody joins): not made again, said."""
        if do != self._do_save or restored < self._failed_at:
            return False
        at = int(self.engine.global_steps)
        log.warning("save_checkpoint at step %d was interrupted by the lost peer and is not made again: step %d is "
                    "restored from memory on every rank and training goes on from it, so the script's next save "
                    "writes a newer one; if none follows (the loss came at the job's end), its newest complete save "
                    "is the one before", at, restored)
        write_event(event="save_skipped", rank=int(self.engine.global_rank), step=at)
        return True


class StepRedo(Redo):
    """See the module docstring."""

    def __init__(self, engine: Any, runtime: Any, *, forward: Callable[..., Any], backward: Callable[..., Any],
                 step: Callable[..., Any]) -> None:
        super().__init__(engine, runtime)
        self._forward, self._backward, self._step = forward, backward, step
        self.records: list[StepRecord] = []
        self._out: Any = None  # the newest forward's output (what the next backward's loss comes from)
        self._step_before = -1  # the engine's step counter when the newest step() call began
        engine.forward = self._guarded(self._do_forward)
        engine.backward = self._guarded(self._do_backward)
        engine.step = self._guarded(self._do_step)

    # -- recording ----------------------------------------------------------------------------------------
    def _current(self) -> StepRecord:
        after = int(self.engine.global_steps)
        if not self.records or self.records[-1].after != after:
            self.records.append(StepRecord(after=after))
            self._trim()
        return self.records[-1]

    def _do_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], redo: Micro | None = None) -> Any:
        if redo is None:
            cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
                    else None)  # type: ignore[no-untyped-call]
            micro = Micro(args=args, kwargs=kwargs, rng=torch.get_rng_state(), cuda_rng=cuda)
            self._current().micros.append(micro)
        else:
            micro = redo
            torch.set_rng_state(micro.rng)
            if micro.cuda_rng is not None:
                torch.cuda.set_rng_state_all(micro.cuda_rng)
        self._out = self._forward(*micro.args, **micro.kwargs)
        return self._out

    def _do_backward(self, args: tuple[Any, ...], kwargs: dict[str, Any], redo: Micro | None = None) -> Any:
        rec = self._current()
        micro = redo if redo is not None else (rec.micros[-1] if rec.micros else None)
        if redo is None and micro is not None and micro.loss is None and args:
            micro.loss = loss_accessor(self._out, args[0])
        if redo is not None:
            assert micro is not None and micro.loss is not None
            args = (apply_accessor(self._out, micro.loss), *args[1:])
        return self._backward(*args, **kwargs)

    def _do_step(self, args: tuple[Any, ...], kwargs: dict[str, Any], redo: Micro | None = None) -> Any:
        rec = self._current()
        micro = redo if redo is not None else (rec.micros[-1] if rec.micros else None)
        self._step_before = int(self.engine.global_steps)
        out = self._step(*args, **kwargs)
        if micro is not None:
            micro.stepped = True
        return out

    # -- the redo -------------------------------------------------------------------------------------------
    def _began_at(self, do: Callable[..., Any], failed_at: int) -> int:
        return self._step_before if do == self._do_step else failed_at  # a step() that failed after its update

    def _failed_part(self, do: Callable[..., Any], failed_at: int) -> tuple[Micro | None, str | None]:
        rec = self.records[-1] if self.records and self.records[-1].after == failed_at else None
        micro = rec.micros[-1] if rec is not None and rec.micros else None
        if micro is not None and do == self._do_forward:
            assert rec is not None
            rec.micros.pop()  # the failed forward is done again, from its recorded RNG, after the redo
        unreachable = [m.loss[1] for r in self.records for m in r.micros if m.loss is not None and m.loss[0] == "none"]
        return micro, (f"the loss was {unreachable[0]}" if unreachable else None)

    def _plan(self, restored: int) -> str | None:
        return redo_plan(self.records, restored)

    def _redo_then(self, do: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], restored: int,
                   failed: Micro | None) -> Any:
        """Every recorded call after ``restored`` again, then the failed call itself."""
        settle = getattr(self.runtime, "settle_rng", None)
        if callable(settle):
            settle()  # each forward below sets its own recorded RNG
        records = [r for r in self.records if r.after >= restored]
        self.records = []
        micros = 0
        for rec in records:
            for m in rec.micros:
                last_of_failed_call = m is failed
                self._do_forward(m.args, m.kwargs, redo=m)
                self._current().micros.append(m)
                micros += 1
                if last_of_failed_call and do == self._do_backward:
                    break  # the failed call is this micro-batch's backward: done below
                if m.loss is not None:
                    self._do_backward((), {}, redo=m)
                if last_of_failed_call and do == self._do_step:
                    break  # the failed call is this micro-batch's step: done below
                if m.stepped:
                    self._do_step((), {}, redo=m)
        self._redone_say(micros, restored, do.__name__.removeprefix("_do_"))
        if self._save_skipped(do, restored):
            return None
        if failed is not None and do == self._do_forward:
            self._current().micros.append(failed)
            return self._do_forward(args, kwargs, redo=failed)
        if failed is not None and do == self._do_backward:
            return self._do_backward(args, kwargs, redo=failed)
        if do == self._do_step and step_call_done(self._step_before, self._failed_at, restored):
            return None  # what DeepSpeed's step returns; made again it would step on no gradients
        return do(args, kwargs)
