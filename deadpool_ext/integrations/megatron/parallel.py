"""Megatron-Core parallel state on a (re)formed world: shims, groups, model-parallel RNG.

Call order (every rank, main thread):

1. ``apply_cpu_shims()`` once per process on a machine without CUDA, before any Megatron model is built
   (explicit: the shims live in ``patches/`` and are never applied by an import).
2. ``initialize(layout, seed)`` after ``torch.distributed`` is up: ``initialize_model_parallel`` with the
   layout's TP/PP sizes, the tensor-parallel RNG tracker seeded, and a check that this rank's Megatron
   coordinates are the ones :func:`layout.coordinates` predicts (the spare-takes-the-same-coordinates
   property rests on it).
3. A hot-swap in place (the default) keeps all of it: every group Megatron made is swappable, its gloo twins
   included (:func:`_gloo_twins_swappable`), and gets the next generation's communicator beneath it.
   On a rebuild (``hot_swap.in_place: false``, an elastic resize), ``destroy()`` before the process groups are
   torn down: Megatron's module-level group handles (tensor, pipeline, data, context, expert, their gloo twins),
   its global memory buffer and the RNG tracker are cleared, so the next ``initialize`` builds everything on the
   new world and nothing keeps a handle of the dead one. The model and optimizer cache group handles too; they
   are rebuilt by the script's factory.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...rebuild.context import context
from .layout import Coordinates, Layout, coordinates

log = logging.getLogger("deadpool_ext")


def apply_cpu_shims() -> list[str]:
    """Apply the Megatron-Core CPU shims (``deadpool_ext.patches.MEGATRON_CORE_CPU``) when CUDA is absent; return
    their names."""
    if torch.cuda.is_available():
        return []
    try:
        from ... import patches  # type: ignore[attr-defined]  # patches/, mapped in at install (package_dir)
    except ImportError as exc:
        raise ImportError("deadpool_ext's Megatron-Core integration needs deadpool_ext.patches for CPU runs: install "
                          "the package (`pip install -e .` maps the repository's patches/ there)") from exc
    patches.apply_all(patches.MEGATRON_CORE_CPU)
    return list(patches.MEGATRON_CORE_CPU)


def initialize(layout: Layout, seed: int) -> Coordinates:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"layout is for {layout.world_size} ranks, the process group has {dist.get_world_size()}")
    context().spare.times.setdefault("engine_started_at", time.time())  # a spare's timeline: its engine build
    with _gloo_twins_swappable():
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    mine = Coordinates(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                       dp=ps.get_data_parallel_rank())
    expected = coordinates(dist.get_rank(), layout)
    if mine != expected:
        raise RuntimeError(f"Megatron placed rank {dist.get_rank()} at {mine}, deadpool_ext expects {expected}: "
                           "the rank order of this Megatron-Core version differs from tp-cp-ep-dp-pp")
    return mine


@contextlib.contextmanager
def _gloo_twins_swappable() -> Iterator[None]:
    """While Megatron builds its groups on a swappable default group (``rebuild/swap.py``): the gloo twins it asks
    for by name (``backend="gloo"``: the data-parallel ones the distributed optimizer's checkpointing uses) are
    made swappable gloo groups too, so an in-place swap replaces their communicator with the others' and no
    handle of the dead generation stays. Megatron calls ``torch.distributed.new_group`` through the module at
    each call; the substitution lasts for this one call of ``initialize_model_parallel``."""
    from ...rebuild import swap

    if not swap.active():
        yield
        return
    original = dist.new_group

    def new_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = swap.GLOO_BACKEND
        return original(*args, **kwargs)

    dist.new_group = new_group  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.new_group = original


def relabel(mapping: Mapping[int, int]) -> int:
    """A spare built for one node's ranks takes another's by exchanging them (``rebuild/regroup.py``, after its
    groups were renamed): Megatron's own lists of global ranks (``_*_RANKS``: the tensor-, pipeline-, data-, model-
    parallel and embedding groups' members, in their order) mapped too. Returns how many lists were mapped."""
    from megatron.core import parallel_state as ps

    def mapped(v: Any) -> Any:
        if isinstance(v, list):
            out = [mapped(x) for x in v]
            # a group's members in its rank order, ascending in Megatron's tp-cp-ep-dp-pp order: kept ascending (the
            # data-parallel group is mapped onto itself, its members in another order)
            return sorted(out) if all(isinstance(x, int) for x in v) and v == sorted(v) else out
        return mapping.get(v, v) if isinstance(v, int) else v

    n = 0
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and name.endswith("_RANKS") and isinstance(value, list):
            setattr(ps, name, mapped(value))
            n += 1
    return n


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    from megatron.core.tensor_parallel import random as mrandom

    # The tracker holds the old generation's per-TP-rank states; the next initialize() re-seeds it.
    mrandom.initialize_rng_tracker(force_reset=True)
