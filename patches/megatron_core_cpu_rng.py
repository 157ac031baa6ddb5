"""Megatron-Core on a machine without CUDA: the tensor-parallel RNG tracker runs on CPU generators.

Why: ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` keeps one CUDA generator state per
stream of randomness (data-parallel, model-parallel, expert) and swaps it in and out of the CUDA default
generator around weight initialisation and dropout (``fork``). On a CPU build ``add`` and ``fork`` raise.
The shim keeps the same semantics on the CPU default generator: ``add(name, seed)`` stores the state of a
CPU generator seeded with ``seed``; ``fork(name)`` swaps that state into ``torch``'s default generator and
back. Seeds stay distinct per tensor-parallel rank, as on GPU, so sharded weights are initialised the same
way Megatron initialises them there (but not bit-identical to a GPU run: different generator).

The module functions ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (activation recompute) are redirected
to the CPU generator for the same reason.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .base import Patch
from .megatron_core_cpu_device import SUPPORTED_MEGATRON_CORE, SUPPORTED_TORCH


def _add(self: Any, name: str, seed: int) -> None:
    self._is_initialized = True
    # Same guards as Megatron's: a repeated seed or name is a bug in the caller.
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()


def _make_fork(default_name: str):
    @contextlib.contextmanager
    def _fork(self: Any, name: str = default_name) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current rng state {self._current_state_name} is not the forked state {name}")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer = self.states_[outer_name]
            torch.set_rng_state(outer)
            self._current_state_name = outer_name

    return _fork


def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class CpuRngTracker(Patch):
    name = "megatron_core_cpu_rng"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE, "torch": SUPPORTED_TORCH}
    why = "CudaRNGStatesTracker.add/fork and the CUDA rng-state helpers use CPU generators"

    def _check_environment(self) -> None:
        if torch.cuda.is_available():
            raise RuntimeError(f"patch {self.name}: CUDA is available; this shim is only for machines without it")

    def _apply(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        tracker = mrandom.CudaRNGStatesTracker
        self._swap(tracker, "add", _add)
        self._swap(tracker, "fork", _make_fork(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME))
        self._swap(mrandom, "_get_cuda_rng_state", _get_state)
        self._swap(mrandom, "_set_cuda_rng_state", _set_state)


PATCH = CpuRngTracker()
apply = PATCH.apply
revert = PATCH.revert
