"""The data position of the ``DataLoader`` s a script iterates itself: recorded with every snapshot, restored with it.

A hand-written DeepSpeed loop (``for batch in loader: loss = engine(batch); engine.backward(loss); engine.step()``)
keeps its data position in objects the extension never sees. With the patch
``deadpool_ext.patches.torch_dataloader_position`` every ``DataLoader`` iterator is made by
:meth:`LoaderPositions.iterate`, which records, per loader:

- how many iterators (epochs) were created on it, and how many batches the newest one has handed out;
- what its order was drawn from when that iterator was created: the global torch RNG (a ``RandomSampler``
  without ``generator=`` and the iterator's base seed draw from it), the loader's own ``torch.Generator`` s
  (``generator=``, the sampler's), and the sampler's epoch (``DistributedSampler.set_epoch``);
- whether it ran out (the next iterator is a new epoch).

That record rides in every snapshot (the runtime's client state, key :data:`KEY`). After a restore that the script
asked for (``engine.load_checkpoint`` or ``resume()``; never a survivor's in-place recovery, whose loaders are where
they are), the next iterator created on each loader is made as the uninterrupted run made it: the RNG and
generators set to their recorded start, the sampler's epoch set, the batches already used skipped, then the RNG put
back. Skipped batches are not loaded where the loader allows it (a map-style dataset, ``num_workers=0``: the
sampler's indices are drawn, no sample is fetched); otherwise they are drawn and dropped. Later iterators follow by
themselves: the restored RNG is where the uninterrupted run's was; a sampler epoch the script sets from its own
counter is shifted by the difference the first positioned iterator found.

Loaders are told apart by their dataset, in the order the script first iterates them (the same order in every run
of a deterministic script; DeepSpeed's own loader makes a new ``DataLoader`` per epoch over one dataset).

What cannot be positioned is said once, at the first snapshot (:meth:`LoaderPositions.unsure_lines`): a step
whose batches came from no ``DataLoader`` (an iterator of the script's own), a sampler whose randomness is not a
``torch.Generator`` or the global RNG.

Call order (main thread): ``iterate`` (from the patch, whenever the script calls ``iter(loader)``); ``position()``
at every snapshot; ``restore(pos)`` with the restored client state; ``apply_restored()`` once the script's
restore is complete; ``claim(by)``: a framework that positions its loader itself (``resilient_steps``, the HF
Trainer, Lightning) turns this off.
"""
from __future__ import annotations

import base64
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..recovery.timeline import write_event

log = logging.getLogger("deadpool_ext")

KEY = "deadpool_loaders"
"""The client-state key of the loaders' positions."""

MAX_LOADERS = 16
"""Loaders recorded per snapshot (the first iterated): the rest are not positioned (said at the first snapshot)."""

_KNOWN_SAMPLERS = ("SequentialSampler", "RandomSampler", "DistributedSampler", "SubsetRandomSampler",
                   "BatchSampler", "WeightedRandomSampler")
"""Samplers whose order is a function of a torch.Generator (or the global RNG) and their epoch."""


def generators(loader: Any) -> list[torch.Generator]:
    """Every torch.Generator the loader may shuffle with (DataLoader, its samplers, Accelerate's wrappers)."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    todo = [loader]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or len(seen) > 32:
            continue
        seen.add(id(obj))
        for name in ("generator", "synchronized_generator"):
            g = getattr(obj, name, None)
            if isinstance(g, torch.Generator):
                found.setdefault(id(g), g)
        for name in ("sampler", "batch_sampler", "base_dataloader"):
            todo.append(getattr(obj, name, None))
    return list(found.values())


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def _epoch_owner(loader: Any) -> Any:
    """The object whose ``set_epoch`` / ``epoch`` orders the loader's batches (its sampler, or the batch
    sampler's sampler), or None."""
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and isinstance(getattr(obj, "epoch", None), int):
            return obj
    return None


def _set_epoch(owner: Any, epoch: int) -> None:
    set_epoch = getattr(owner, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    else:
        owner.epoch = epoch


def _sampler_names(loader: Any) -> list[str]:
    out = []
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if obj is not None:
            out.append(type(obj).__name__)
    return out


@dataclass
class Position:
    """One loader's position (JSON: :meth:`as_json` / :meth:`from_json`)."""

    iters: int = 0
    """Iterators created on the loader (epochs started)."""
    drawn: int = 0
    """Batches the newest iterator handed out."""
    exhausted: bool = False
    """The newest iterator ran out: the next one is a new epoch."""
    rng: str | None = None
    """The global torch RNG (base64) right before the newest iterator was created."""
    gens: list[str] = field(default_factory=list)
    """The loader's own generators' states then."""
    epoch: int | None = None
    """The sampler's epoch then."""
    epoch_step: int = 1
    """How the sampler's epoch moved between the last two iterators (1 until a second one is seen)."""

    def as_json(self, gens_now: list[str]) -> dict[str, Any]:
        return {"iters": self.iters, "drawn": self.drawn, "exhausted": self.exhausted, "rng": self.rng,
                "gens": list(self.gens), "gens_now": gens_now, "epoch": self.epoch, "epoch_step": self.epoch_step}

    @staticmethod
    def from_json(value: Any) -> tuple[Position, list[str]]:
        """The position and the generators' states at the snapshot; ValueError naming the field."""
        if not isinstance(value, dict):
            raise ValueError(f"a loader position must be an object, got {type(value).__name__}")
        def ints(name: str, default: int | None = None) -> int:
            v = value.get(name, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"loader position {name!r} must be an int >= 0, got {v!r}")
            return v
        def strs(name: str) -> list[str]:
            v = value.get(name) or []
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise ValueError(f"loader position {name!r} must be a list of strings")
            return list(v)
        rng = value.get("rng")
        if rng is not None and not isinstance(rng, str):
            raise ValueError("loader position 'rng' must be a string or null")
        epoch = value.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise ValueError(f"loader position 'epoch' must be an int or null, got {epoch!r}")
        step = value.get("epoch_step", 1)
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"loader position 'epoch_step' must be an int, got {step!r}")
        pos = Position(iters=ints("iters"), drawn=ints("drawn"), exhausted=bool(value.get("exhausted")), rng=rng,
                       gens=strs("gens"), epoch=epoch, epoch_step=step)
        return pos, strs("gens_now")


def next_epoch(saved: Position, script_epoch: int | None) -> tuple[int | None, int]:
    """(the sampler epoch the first iterator after a restore gets, the shift applied to the epochs the script
    sets later) (pure). Mid-epoch: the recorded epoch; after an exhausted iterator: the next one, moved as the
    recorded epochs moved. The shift is what a script that counts epochs from 0 again needs added."""
    if saved.epoch is None:
        return None, 0
    epoch = saved.epoch + (saved.epoch_step if saved.exhausted else 0)
    return epoch, (epoch - script_epoch) if script_epoch is not None else 0


class _Tracked:
    """The iterator a script gets: torch's, counting what it hands out."""

    __slots__ = ("_it", "_pos", "_owner")

    def __init__(self, it: Iterator[Any], pos: Position, owner: LoaderPositions) -> None:
        self._it, self._pos, self._owner = it, pos, owner

    def __iter__(self) -> _Tracked:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self._pos.exhausted = True
            raise
        self._pos.drawn += 1
        self._owner.drawn_total += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class LoaderPositions:
    """See the module docstring."""

    def __init__(self, settle_rng: Callable[[], None] | None = None) -> None:
        self._settle_rng = settle_rng
        self._datasets: list[Any] = []  # first-iteration order; held, so that ids are never reused while tracked
        self._index: dict[int, int] = {}
        self._live: list[Position] = []
        self._loaders: list[Any] = []  # the newest DataLoader of each dataset (its generators at a snapshot)
        self._iters: list[tuple[_Tracked, Callable[[Any], Iterator[Any]]] | None] = []  # the newest iterator, its maker
        self._restored: list[tuple[Position, list[str]]] | None = None
        self._pending: dict[int, tuple[Position, list[str]]] = {}
        self._epoch_shift: dict[int, int] = {}
        self.claimed_by: str | None = None
        """A framework that positions its loader itself (then nothing is recorded or positioned)."""
        self.drawn_total = 0
        """Batches handed out by tracked iterators in this process."""

    # -- who owns the data position -----------------------------------------------------------------------
    def claim(self, by: str) -> None:
        self.claimed_by = by
        self._pending.clear()
        self._restored = None

    @property
    def active(self) -> bool:
        return self.claimed_by is None

    def set_settle(self, settle_rng: Callable[[], None] | None) -> None:
        self._settle_rng = settle_rng

    # -- iteration (the patch) -----------------------------------------------------------------------------
    def iterate(self, loader: Any, make: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
        if not self.active:
            return make(loader)
        key = id(loader.dataset)
        idx = self._index.get(key)
        if idx is None:
            if len(self._datasets) >= MAX_LOADERS:
                return make(loader)
            idx = len(self._datasets)
            self._index[key] = idx
            self._datasets.append(loader.dataset)
            self._live.append(Position())
            self._loaders.append(loader)
            self._iters.append(None)
        self._loaders[idx] = loader
        pending = self._pending.pop(idx, None)
        if pending is not None:
            it, pos = self._positioned(idx, loader, make, *pending)
        else:
            it, pos = self._fresh(idx, loader, make)
        self._live[idx] = pos
        tracked = _Tracked(it, pos, self)
        self._iters[idx] = (tracked, make)
        return tracked

    def _fresh(self, idx: int, loader: Any, make: Callable[[Any], Iterator[Any]]) -> tuple[Iterator[Any], Position]:
        before = self._live[idx]
        owner = _epoch_owner(loader)
        epoch = None
        if owner is not None:
            shift = self._epoch_shift.get(idx, 0)
            if shift:
                _set_epoch(owner, int(owner.epoch) + shift)
            epoch = int(owner.epoch)
        pos = Position(iters=before.iters + 1, rng=_encode(torch.get_rng_state()),
                       gens=[_encode(g.get_state()) for g in generators(loader)], epoch=epoch,
                       epoch_step=(epoch - before.epoch) if epoch is not None and before.epoch is not None
                       else before.epoch_step)
        return make(loader), pos

    def _positioned(self, idx: int, loader: Any, make: Callable[[Any], Iterator[Any]], saved: Position,
                    gens_now: list[str]) -> tuple[Iterator[Any], Position]:
        """The first iterator after a restore, as the uninterrupted run had it at the snapshot."""
        gens = generators(loader)
        owner = _epoch_owner(loader)
        epoch, shift = next_epoch(saved, int(owner.epoch) if owner is not None else None)
        if owner is not None and epoch is not None:
            self._epoch_shift[idx] = shift
            _set_epoch(owner, epoch)
        if saved.exhausted:
            # A new epoch, made right after the snapshot in the uninterrupted run: from the restored RNG (as it is
            # now) and the generators as they were at the snapshot.
            if len(gens_now) == len(gens):
                for g, s in zip(gens, gens_now):
                    g.set_state(_decode(s))
            pos = Position(iters=saved.iters + 1, rng=_encode(torch.get_rng_state()),
                           gens=[_encode(g.get_state()) for g in gens], epoch=epoch, epoch_step=saved.epoch_step)
            it = make(loader)
            self._say(idx, loader, saved, epoch, "a new epoch")
            return it, pos
        outer = torch.get_rng_state()
        try:
            if saved.rng is not None:
                torch.set_rng_state(_decode(saved.rng))
            if len(saved.gens) == len(gens):
                for g, s in zip(gens, saved.gens):
                    g.set_state(_decode(s))
            it = make(loader)
            how = _skip(it, loader, saved.drawn)
        finally:
            torch.set_rng_state(outer)  # draws after the snapshot start from the restored RNG, as they did
        pos = Position(iters=saved.iters, drawn=saved.drawn, rng=saved.rng, gens=list(saved.gens), epoch=epoch,
                       epoch_step=saved.epoch_step)
        self._say(idx, loader, saved, epoch, how)
        return it, pos

    def _say(self, idx: int, loader: Any, saved: Position, epoch: int | None, how: str) -> None:
        log.info("data position: loader %d (%s) continues at epoch %d%s, after %d batch(es) of it (%s)", idx,
                 type(loader.dataset).__name__, saved.iters - 1 + (1 if saved.exhausted else 0),
                 f" (sampler epoch {epoch})" if epoch is not None else "", 0 if saved.exhausted else saved.drawn, how)
        write_event(event="data_position", loader=idx, iters=saved.iters, drawn=0 if saved.exhausted else saved.drawn,
                    exhausted=saved.exhausted, how=how)

    # -- snapshot / restore ----------------------------------------------------------------------------
    def position(self) -> dict[str, Any] | None:
        """What a snapshot records (None: nothing iterated, or claimed by a framework)."""
        if not self.active or not self._live:
            return None
        return {"loaders": [p.as_json([_encode(g.get_state()) for g in generators(ld)])
                            for p, ld in zip(self._live, self._loaders)]}

    def restore(self, value: Any) -> None:
        """The position a restore handed back; applied by :meth:`apply_restored`. A malformed one is dropped with
        a warning (the loaders then start from their first batch)."""
        self._restored = None
        if value is None or not self.active:
            return
        try:
            loaders = value.get("loaders") if isinstance(value, dict) else None
            if not isinstance(loaders, list):
                raise ValueError("'loaders' must be a list")
            self._restored = [Position.from_json(v) for v in loaders[:MAX_LOADERS]]
        except ValueError as exc:
            log.warning("data position of the restored snapshot not usable (%s): the script's loaders start from "
                        "their first batch", exc)

    def apply_restored(self) -> int:
        """Position the next iterator of each loader (the script's own restore is complete); how many loaders."""
        restored, self._restored = self._restored, None
        if not restored or not self.active:
            return 0
        self._pending = dict(enumerate(restored))
        # The loaders' next iterators are made from the RNG as the restore left it (mid-epoch: around their own
        # draws), so the restored RNG is set now, not again at the next forward (the adapter's default, for
        # loaders it cannot see): a collate function's or dataset's draws before that forward count, as they did.
        if self._settle_rng is not None:
            self._settle_rng()
        self._reposition_unused()
        return len(restored)

    def _reposition_unused(self) -> None:
        """An iterator made before the restore and not drawn from yet (DeepSpeed's own loader: the pipeline engine's
        ``RepeatingLoader`` iterates it inside ``deepspeed.initialize``, before the script's ``load_checkpoint``) is
        positioned in place: the object the engine holds now hands out the uninterrupted run's next batches."""
        for idx in sorted(self._pending):
            held = self._iters[idx] if idx < len(self._iters) else None
            if held is None:
                continue
            tracked, make = held
            if tracked._pos is not self._live[idx] or tracked._pos.drawn or tracked._pos.exhausted:
                continue  # drawn from already (positioning it would repeat batches): the next iterator is positioned
            it, pos = self._positioned(idx, self._loaders[idx], make, *self._pending.pop(idx))
            tracked._it, tracked._pos = it, pos
            self._live[idx] = pos

    def unsure_lines(self, *, steps_done: int) -> list[str]:
        """What a restore could not put back as the uninterrupted run had it (said once, at the first snapshot):
        batches from no DataLoader, samplers whose randomness the extension cannot see (pure over the record)."""
        if not self.active:
            return []
        lines = []
        if steps_done and self.drawn_total == 0:
            lines.append("deadpool_ext: the batches of this job come from no torch DataLoader (an iterator or list of "
                         "the script's own): after a restore the extension cannot put its position back, so the "
                         "script's iterator starts where the script starts it. Fix: iterate a DataLoader, or loop "
                         "with `for step in resilient_steps(engine, loader, max_steps=N)` (deadpool_ext.steps)")
        for idx, loader in enumerate(self._loaders):
            unknown = [n for n in _sampler_names(loader) if n not in _KNOWN_SAMPLERS]
            if unknown:
                lines.append(f"deadpool_ext: loader {idx} ({type(loader.dataset).__name__}) orders its batches with "
                             f"{', '.join(unknown)}: after a restore the extension sets its torch generators, the "
                             "global RNG and its epoch as they were; randomness of its own (python's random, numpy) "
                             "is not put back. Fix: draw from a torch.Generator passed as generator=")
        return lines


def process_tracker(settle_rng: Callable[[], None] | None = None) -> LoaderPositions:
    """The process's loader tracker (held by the DataLoader patch, so a runtime rebuilt in this process keeps the
    loaders' history), its patch applied. Called before the framework builds its engine too (with no runtime yet:
    ``settle_rng`` None), so that the loaders an engine iterates while it is built (DeepSpeed's ``training_data=``)
    are tracked from their first iterator. Without the patch (an uninstalled checkout, another torch): a tracker
    that sees no loader, logged."""
    try:
        from .. import patches  # patches/, mapped in at install (package_dir)
    except ImportError as exc:
        log.info("data position of the script's own DataLoaders not tracked: %s", exc)
        return LoaderPositions(settle_rng)
    patch = patches.get("torch_dataloader_position")
    try:
        patch.check()
    except patches.UnsupportedVersionError as exc:
        log.info("data position of the script's own DataLoaders not tracked: %s", exc)
        return LoaderPositions(settle_rng)
    tracker = patch.tracker if isinstance(patch.tracker, LoaderPositions) else None
    if tracker is None:
        tracker = LoaderPositions(settle_rng)
        patch.set_tracker(tracker)
    if settle_rng is not None:
        tracker.set_settle(settle_rng)
    patch.apply()
    return tracker


def _skip(it: Iterator[Any], loader: Any, n: int) -> str:
    """Advance a fresh iterator past ``n`` batches; how: ``indices`` (the sampler's only, nothing fetched) or
    ``drawn`` (the batches loaded and dropped: workers, an iterable dataset)."""
    inner: Any = it
    if (getattr(loader, "num_workers", 1) == 0 and hasattr(inner, "_sampler_iter") and hasattr(inner, "_next_index")
            and not isinstance(loader.dataset, torch.utils.data.IterableDataset)):
        for _ in range(n):
            inner._next_index()
            inner._num_yielded += 1
        # The sampler's lazy draws (a RandomSampler's seed, its permutation) happen now, under the recorded RNG:
        # the next index is taken and put back in front.
        try:
            first = inner._next_index()
        except StopIteration:
            return "indices"
        inner._sampler_iter = itertools.chain([first], inner._sampler_iter)
        return "indices"
    for _ in range(n):
        next(it)
    return "drawn"
