"""The extension attached to one Megatron-Core training job: step hook, snapshots, resume, hot-swap.

Megatron-Core has no engine object to wrap, so the training loop calls the runtime explicitly.

Call order (every rank, main thread):

1. ``parallel.apply_cpu_shims()`` (CPU only), ``init_distributed()``, ``parallel.initialize(layout, seed)``.
2. ``MegatronRuntime(built, config, layout, seed=..., global_batch=...)`` with freshly built model chunks and
   optimizer (collective when snapshots are on: the side process group for replication is created).
3. ``runtime.set_client_state(get, set)`` and ``runtime.set_rebuild(factory)``; ``factory()`` builds model
   and optimizer on the current parallel state and returns a new runtime (hot-swap calls it on the new world).
4. ``runtime.resume()`` once before the loop (collective): restores the newest version every rank holds in
   memory; returns the iteration to continue from.
5. Per iteration: forward/backward through Megatron's schedule, then ``runtime.step()`` instead of
   ``optimizer.step()``: waits for an in-flight snapshot copy before the optimizer overwrites the tensors it
   reads, steps optimizer and LR scheduler, advances the counters, schedules the next snapshot.
6. A collective error inside the iteration: ``if runtime.can_recover(exc): runtime = runtime.recover(exc)``
   and continue the loop from ``runtime.progress.iteration`` (``integrations.loop.ResilientLoop`` does it).
7. ``runtime.close()``.

Everything but the Megatron-specific parts (the adapter, the explicit step, releasing and re-initialising
parallel state) is the :class:`~deadpool_ext.integrations.base.ResilientRuntime` contract.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...config import DeadpoolConfig
from ..base import ResilientRuntime
from . import parallel
from .layout import Coordinates, Layout
from .model import Built
from .state import MegatronStateAdapter

log = logging.getLogger("deadpool_ext")


@dataclass(slots=True)
class Progress:
    iteration: int = 0
    consumed_samples: int = 0


class MegatronRuntime(ResilientRuntime):
    what_recovers = "rebuilding parallel state"
    step_name = "iteration"
    refuse_resize = ("Megatron-Core cannot reshard its state onto another world size yet (a data-parallel shrink is "
                     "not built); the job stops. Start it with more --spare-nodes (a tensor- or pipeline-parallel "
                     "group that loses a member always needs one), or relaunch with --load from tier 3")

    def __init__(self, built: Built, config: DeadpoolConfig, layout: Layout, coords: Coordinates, *, seed: int,
                 global_batch: int) -> None:
        self.built: Built | None = built
        self.layout = layout
        self.coords = coords
        self.seed = seed
        self.global_batch = global_batch
        self.progress = Progress()
        adapter = MegatronStateAdapter(built.chunks, built.optimizer, built.scheduler, layout, coords,
                                       self.progress, self._client_state, self._restore_client_state)
        super().__init__(config, adapter, rank=dist.get_rank())
        if self.rank == 0:
            log.info("deadpool_ext attached to Megatron-Core: tp=%d pp=%d dp=%d, snapshots %s", layout.tp, layout.pp,
                     layout.dp, f"every {config.snapshot.interval} step(s), replication factor "
                     f"{config.replication.factor}" if self.snapshots else "off")

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> tuple[bool, float | None]:
        """Optimizer + scheduler step with the snapshot hooks around it; returns (stepped, grad norm)."""
        assert self.built is not None, "step() on a runtime closed by a hot-swap: use the one recover() returned"
        self._before_optimizer_step()
        with self.stoppable():
            ok, grad_norm, _ = self.built.optimizer.step()
            if ok:
                self.built.scheduler.step(increment=self.global_batch)
        # Megatron-LM counts skipped (overflow) iterations too; so do we, so the data position stays aligned.
        self.progress.iteration += 1
        self.progress.consumed_samples += self.global_batch
        self._after_optimizer_step()
        return bool(ok), None if grad_norm is None else float(grad_norm)

    def step_counter(self) -> int:
        return self.progress.iteration

    def _timeline_fields(self) -> dict[str, Any]:
        return {"coords": {"tp": self.coords.tp, "pp": self.coords.pp, "dp": self.coords.dp}}

    # -- hot-swap -----------------------------------------------------------------------------------
    def _release(self) -> None:
        """Drop the model and optimizer (they hold the dead world's group handles) and Megatron's parallel state
        (groups, memory buffer, RNG tracker). The spare has the failed rank's global rank, hence its TP/PP/DP
        coordinates: the rebuild re-initialises with the same sizes."""
        self.built = None
        parallel.destroy()

    def _release_partial(self) -> None:
        parallel.destroy()

    def _rebuild(self, factory: Callable[[], Any]) -> Any:
        parallel.initialize(self.layout, self.seed)
        return factory()

    def _runtime_of(self, handle: Any) -> ResilientRuntime:
        assert isinstance(handle, MegatronRuntime), "the Megatron rebuild factory must return a MegatronRuntime"
        return handle
