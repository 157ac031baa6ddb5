"""``torch.utils.data.DataLoader.__iter__`` hands each new iterator to a tracker first.

Why: a hand-written training loop iterates its own ``DataLoader``; the data position (which epoch, how many
batches of it were drawn, the generator states its shuffle started from) is in no object the extension can reach.
With the patch, every iterator a ``DataLoader`` creates is made by the tracker set with :meth:`set_tracker`
(``deadpool_ext/integrations/loaders.py``): it records the position with every snapshot and, after a restore,
creates the next iterator at the position an uninterrupted run was at. Without a tracker ``__iter__`` is torch's.

Call order: ``set_tracker(t)`` then ``apply()`` (the DeepSpeed runtime does both when it attaches to an engine);
``revert()`` restores torch's method. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .base import Patch


class Tracker(Protocol):
    def iterate(self, loader: Any, make: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
        """The iterator ``iter(loader)`` returns; ``make(loader)`` is torch's own ``__iter__``."""


class DataLoaderPosition(Patch):
    name = "torch_dataloader_position"
    requires = {"torch": ">=2.4,<2.14"}
    why = "a script's own DataLoader iterators are positioned after a restore"

    def __init__(self) -> None:
        super().__init__()
        self.tracker: Tracker | None = None

    def set_tracker(self, tracker: Tracker | None) -> None:
        self.tracker = tracker

    def _apply(self) -> None:
        from torch.utils.data import DataLoader

        original = DataLoader.__iter__
        patch = self

        @functools.wraps(original)
        def __iter__(loader: Any) -> Iterator[Any]:  # noqa: N807 - the patched method's own name
            tracker = patch.tracker
            if tracker is None:
                return original(loader)
            return tracker.iterate(loader, original)

        self._swap(DataLoader, "__iter__", __iter__)


PATCH = DataLoaderPosition()
apply = PATCH.apply
revert = PATCH.revert
