"""``torch.distributed.broadcast_object_list`` leaves the objects as they are while the caller says the process
groups are local (a hot-swap spare's solo set-up).

Why: a spare replacing a lost node builds its framework objects before it joins the survivors' communicators
(``deadpool_ext/rebuild/swap.py``, solo mode): each collective is computed locally "as if every rank had
contributed this rank's tensors". For ``broadcast_object_list`` that cannot be done at the tensor level: on a rank
that is not the source, torch receives the pickled size into an uninitialised tensor and then allocates that many
bytes (Lightning broadcasts its log directory this way while setting up). At the object level the solo rule is
exact: every rank holds the same object, so the list stays as the caller passed it (frameworks pass their own
value: ``obj = [value]; broadcast_object_list(obj, src)``).

Call order: ``set_local(fn)`` (``fn() -> bool``: the groups are solo now), then ``apply()`` (the runner does it
for jobs with swappable groups). Outside solo mode torch's function runs unchanged. This module imports no
``deadpool_ext``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .base import Patch


class SoloBroadcastObject(Patch):
    name = "torch_solo_broadcast_object"
    requires = {"torch": ">=2.4,<2.14"}
    why = "broadcast_object_list keeps the caller's objects while a hot-swap spare sets up locally"

    def __init__(self) -> None:
        super().__init__()
        self._local: Callable[[], bool] | None = None

    def set_local(self, fn: Callable[[], bool]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_local() after apply()")
        self._local = fn

    def _apply(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        local = self._local
        if local is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_local()")
        original = c10d.broadcast_object_list

        @functools.wraps(original)
        def broadcast_object_list(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
            if local():
                return None
            return original(object_list, *args, **kwargs)

        self._swap(c10d, "broadcast_object_list", broadcast_object_list)
        self._swap(dist, "broadcast_object_list", broadcast_object_list)


PATCH = SoloBroadcastObject()
apply = PATCH.apply
revert = PATCH.revert
