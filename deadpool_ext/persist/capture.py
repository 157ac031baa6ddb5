"""Host copies of what DeepSpeed hands to ``CheckpointEngine.save``, taken on the training thread.

``engine.save_checkpoint`` gives the checkpoint engine state dicts that *reference* live tensors (fp32 master
partitions, optimizer moments, ...). The next optimizer step overwrites them, so before ``save`` returns we copy
every tensor into host memory; the background writer serialises the copy later. Containers are rebuilt (a
``param_groups`` list changes every step with the LR), immutable leaves are shared, other leaves are deep-copied.

Staging buffers are reused from one base to the next (:class:`StagingPool`): a fresh allocation costs a page
fault per 4 KiB on first touch, which made the copy 5-10x slower than into already-touched memory on the
project's hosts (docs: cpu-facts.md). Only the training thread calls :meth:`StagingPool.copy`; the writer
thread returns buffers with :meth:`StagingPool.release` once a base is written.
"""
from __future__ import annotations

import copy
import threading
from collections import defaultdict
from typing import Any

import torch

_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


class StagingPool:
    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, tuple(t.shape))
        with self._lock:
            bucket = self._free.get(key)
            if bucket:
                return bucket.pop()
        self.allocated_bytes += t.numel() * t.element_size()
        # pin_memory makes device->host copies asynchronous-capable on GPU; on CPU it is a plain allocation.
        return torch.empty(t.shape, dtype=t.dtype, device="cpu",
                           pin_memory=t.is_cuda and torch.cuda.is_available())

    def copy(self, obj: Any, taken: list[torch.Tensor]) -> Any:
        """A copy of ``obj`` with every tensor in a staging buffer (appended to ``taken``)."""
        if isinstance(obj, _IMMUTABLE) or isinstance(obj, type):
            return obj  # before the container cases: torch.Size is a tuple and must stay a torch.Size
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.layout != torch.strided:
                return obj.detach().to("cpu", copy=True)
            buf = self._take(obj)
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            taken.append(buf)
            return buf
        if isinstance(obj, dict):
            out: Any  # a dict subclass (OrderedDict, ...) when it can be built empty
            try:
                out = type(obj)()
            except TypeError:
                out = {}
            for k, v in obj.items():
                out[k] = self.copy(v, taken)
            meta = getattr(obj, "_metadata", None)  # torch state_dicts carry per-module versions here
            if meta is not None:
                out._metadata = copy.deepcopy(meta)
            return out
        if isinstance(obj, list):
            return [self.copy(v, taken) for v in obj]
        if type(obj) is tuple:
            return tuple(self.copy(v, taken) for v in obj)
        try:
            return copy.deepcopy(obj)
        except Exception:  # noqa: BLE001 - an uncopyable leaf (a lock, a module) is saved as DeepSpeed would
            return obj

    def release(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                self._free[(t.dtype, tuple(t.shape))].append(t)
            tensors.clear()


def tensor_bytes(obj: Any) -> int:
    """Sum of tensor payload bytes in a nested structure (the size estimate a full-disk check uses)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
