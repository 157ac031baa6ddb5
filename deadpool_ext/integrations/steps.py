"""Resilient steps for a hand-written loop (your own DeepSpeed loop, an Accelerate loop): the data position travels
with every snapshot, and a step that fails because a peer was lost is recovered in place and redone. Two lines of
the loop change::

    from deadpool_ext.steps import resilient_steps

    for step in resilient_steps(engine, loader, max_steps=args.steps):
        with step as batch:                          # a lost peer in here: recovered, the batches come again
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()

``engine`` is what ``deepspeed.initialize`` (or Accelerate's ``prepare``) returned, with the extension attached
(``engine.deadpool``); without it the helper is a plain loop over ``loader`` (no restore, no recovery).

Call order: :func:`resilient_steps` once, before the loop, on every rank (collective: it calls
``engine.deadpool.resume()``, so the script must not call it as well); then iterate it. Each item is a
:class:`Step`: entering it gives the batch. Iteration ends once ``engine.global_steps`` reaches ``max_steps``.

What "the data position" is: the epoch and the number of batches of it handed out, recorded in every snapshot
(client state, chained with any the script registered), plus the state of every ``torch.Generator`` the loader
shuffles with, as it was at the start of that epoch. After any restore (a restart, or an in-place hot-swap) the
epoch is started again the same way (``set_epoch`` on the loader or its sampler, the generators set back), its
first batches are drawn and dropped, and the next batch handed out is the one an uninterrupted run would have seen.
What a loader must provide for that: the same order for the same epoch and generator state (``DistributedSampler``,
a ``DataLoader`` with a seeded ``generator=``, Accelerate's prepared loaders, torchdata's ``StatefulDataLoader``).
The StatefulDataLoader is positioned the same way, not through its own ``state_dict``: resumed mid-epoch with a
shuffling generator, torchdata 0.11 hands out a different order from the *next* epoch on (its generator is not
where an uninterrupted run's is), while setting the generator back at the epoch's start is exact across epochs.
A loader that shuffles with the global RNG (``shuffle=True`` without ``generator=``) is named in a warning: after
a restore its order differs from an uninterrupted run's.

In-place hot-swap (under deadpool-run): an exception inside the ``with`` block, or in the loader while it is
iterated, that the runtime can recover is handed to ``engine.deadpool.recover`` (communicators swapped, the state
restored into the same engine); the exception is swallowed and the iteration starts again at the restored
position, so the interrupted step (all its micro-batches) is redone. The spare runs the same script and takes the
restore path at :func:`resilient_steps`, collective for collective.
"""
from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..recovery.timeline import write_event
from .loaders import generators

log = logging.getLogger("deadpool_ext")

KEY = "deadpool_data"
"""The client-state key of the data position."""


class Step:
    """One batch of the loop; ``with step as batch:`` runs the step's work (see the module docstring)."""

    __slots__ = ("batch", "_owner")

    def __init__(self, owner: ResilientSteps, batch: Any) -> None:
        self.batch = batch
        self._owner = owner

    def __enter__(self) -> Any:
        return self.batch

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        return exc is not None and self._owner._recover(exc)


def _shuffles_with_global_rng(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None


class ResilientSteps:
    def __init__(self, engine: Any, loader: Any, *, max_steps: int) -> None:
        if not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"resilient_steps: max_steps must be an int >= 0, got {max_steps!r}")
        self.engine, self.loader, self.max_steps = engine, loader, max_steps
        self.runtime = getattr(engine, "deadpool", None)
        self.swaps = 0
        """How many in-place recoveries happened during the iteration."""
        self.epoch, self.taken = 0, 0
        self._epoch_rng: list[str] = []
        self._restored: dict[str, Any] | None = None
        self._rewind = False
        self.start_step = int(getattr(engine, "global_steps", 0))
        if _shuffles_with_global_rng(loader):
            log.warning("resilient_steps: the loader shuffles with the global RNG (shuffle=True without generator=): "
                        "after a restore its order differs from an uninterrupted run's; pass a seeded generator or "
                        "use a DistributedSampler")
        if self.runtime is not None:
            self.runtime.loaders.claim("resilient_steps")  # it positions its loader itself
            self.runtime.loop_owner = "resilient_steps"  # and redoes a failed step itself
            get, put = self.runtime._client_get, self.runtime._client_set  # chained: the script's own stays
            self.runtime.set_client_state(lambda: {**(get() if get else {}), KEY: self._position()},
                                          lambda st: self._restore_client(st, put))
            self.start_step = int(self.runtime.resume())
            self._apply_restored()

    # -- the data position -------------------------------------------------------------------------------
    def _position(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "taken": self.taken, "generators": list(self._epoch_rng)}

    def _restore_client(self, state: dict[str, Any], put: Any) -> None:
        self._restored = state.get(KEY) if isinstance(state, dict) else None
        if put is not None:
            put({k: v for k, v in state.items() if k != KEY})

    def _apply_restored(self) -> None:
        pos, self._restored = self._restored, None
        if not isinstance(pos, dict):
            if self.start_step:
                log.warning("resilient_steps: the restored step %d carries no data position (saved without "
                            "resilient_steps?): the loader starts from its first batch", self.start_step)
            self.epoch, self.taken, self._epoch_rng = 0, 0, []
            return
        self.epoch, self.taken = int(pos["epoch"]), int(pos["taken"])
        self._epoch_rng = [str(s) for s in pos.get("generators", [])]
        log.info("resilient_steps: data position of step %d: epoch %d, %d batch(es) of it already used",
                 int(self.engine.global_steps), self.epoch, self.taken)
        write_event(event="data_position", step=int(self.engine.global_steps), epoch=self.epoch, taken=self.taken)

    def _start_epoch(self) -> Iterator[Any]:
        """The loader's iterator for ``self.epoch``, positioned after ``self.taken`` batches."""
        for obj in (self.loader, getattr(self.loader, "sampler", None),
                    getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
                break
        gens = generators(self.loader)
        if self._epoch_rng and len(self._epoch_rng) == len(gens):
            for g, s in zip(gens, self._epoch_rng):
                g.set_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))
        else:
            self._epoch_rng = [base64.b64encode(g.get_state().numpy().tobytes()).decode() for g in gens]
        it = iter(self.loader)
        for _ in range(self.taken):
            next(it)
        return it

    # -- iteration -------------------------------------------------------------------------------------
    def _done(self) -> bool:
        return int(self.engine.global_steps) >= self.max_steps

    def __iter__(self) -> Iterator[Step]:
        yield from self._steps()
        while not self._ended():  # a peer lost while the last snapshot drained: recovered, the steps left redone
            yield from self._steps()

    def _ended(self) -> bool:
        """After the last step: its snapshot drained inside the recovery scope, then the launcher told that this
        rank's loop ended (``mark_trained``: a node lost from here on fails nothing). False: a failure meanwhile
        was recovered, and the restored step may be older."""
        rt = self.runtime
        if rt is None:
            return True
        try:
            rt.drain()
        except Exception as exc:
            if not self._recover(exc):
                raise
            return False
        rt.mark_trained()
        return True

    def _steps(self) -> Iterator[Step]:
        while not self._done():
            self._rewind = False
            try:
                it = self._start_epoch()
            except StopIteration:  # the restored position was the epoch's end
                self.epoch, self.taken, self._epoch_rng = self.epoch + 1, 0, []
                continue
            except Exception as exc:
                if not self._recover(exc):
                    raise
                continue
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    self.epoch, self.taken, self._epoch_rng = self.epoch + 1, 0, []
                    break
                except Exception as exc:
                    if not self._recover(exc):
                        raise
                    break
                self.taken += 1
                yield Step(self, batch)
                if self._rewind or self._done():
                    break

    def _recover(self, exc: BaseException) -> bool:
        rt = self.runtime
        if rt is None or rt.handle_failure(exc, same_objects=True) is None:
            return False
        self.swaps += 1
        self._apply_restored()
        self._rewind = True
        log.info("resilient_steps: recovered in place at step %d; the loop goes on from there", rt.step_counter())
        write_event(event="continued", framework="resilient_steps", how="in_place", step=int(rt.step_counter()))
        return True


def resilient_steps(engine: Any, loader: Any, *, max_steps: int) -> ResilientSteps:
    """See the module docstring."""
    return ResilientSteps(engine, loader, max_steps=max_steps)
