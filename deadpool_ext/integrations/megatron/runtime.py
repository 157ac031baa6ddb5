"""The extension attached to one Megatron-Core training job: step hook, snapshots, resume, hot-swap.

Megatron-Core has no engine object to wrap, so the training loop calls the runtime explicitly.

Call order (every rank, main thread):

1. ``parallel.apply_cpu_shims()`` (CPU only), ``init_distributed()``, ``parallel.initialize(layout, seed)``.
2. ``MegatronRuntime(built, config, layout, coords, seed=..., global_batch=..., micro_batch=...)`` with freshly
   built model chunks and optimizer (collective when snapshots are on: the side process group for replication
   is created). Model chunks in virtual pipeline stages with tier-3 bases on are refused here, before that
   (``ConfigError``, one line naming the keys). ``runtime.num_micro`` is the micro-batches per iteration and
   data-parallel rank.
3. ``runtime.set_client_state(get, set)`` and ``runtime.set_rebuild(factory)``; ``factory()`` builds model
   and optimizer on the current parallel state and returns a new runtime (hot-swap calls it on the new world;
   after an elastic shrink or grow that world has another data-parallel size: the factory lays it out with
   ``layout.dp_resize`` / ``keep_global_batch`` and the restore reshards from memory, docs/elastic.md).
4. ``runtime.resume()`` once before the loop (collective): restores the newest version every rank holds in
   memory; returns the iteration to continue from.
5. Per iteration: forward/backward through Megatron's schedule, then ``runtime.step()`` instead of
   ``optimizer.step()``: waits for an in-flight snapshot copy before the optimizer overwrites the tensors it
   reads, steps optimizer and LR scheduler, advances the counters, schedules the next snapshot.
6. A failure inside the iteration: ``runtime = runtime.handle_failure(exc)`` (None: raise ``exc``) and continue
   the loop from ``runtime.progress.iteration`` (``integrations.base.ResilientLoop`` does it).
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
from ...rebuild.context import context
from ...rebuild.spare import Relabel, await_assignment, publish_fast_paths
from ...recovery.timeline import write_event
from ..base import ResilientRuntime
from . import parallel
from .layout import Coordinates, Layout, LayoutError, coordinates, dp_exchange_refusal, dp_resize, keep_global_batch
from .state import MegatronStateAdapter

log = logging.getLogger("deadpool_ext")


@dataclass(slots=True)
class Built:
    """What a model factory hands the runtime: the model chunks, optimizer and scheduler of the current parallel
    state (a hot-swap calls the factory again on the new world)."""

    chunks: list[Any]          # DDP-wrapped model chunks (one per rank without virtual pipeline)
    optimizer: Any             # megatron.core.optimizer.MegatronOptimizer
    scheduler: Any             # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    config: Any                # the TransformerConfig (carries the schedule hooks)


@dataclass(slots=True)
class Progress:
    iteration: int = 0
    consumed_samples: int = 0


DIST_OPTIMIZER = ("Megatron's distributed optimizer holds this rank's data-parallel shard of the optimizer state "
                  "(its rank in the data-parallel group, cached at build)")
"""Why a Megatron spare built ahead for one node takes only that node's ranks in place (``rebuild/spare.py``)."""


def relabel_offer(built: Built, layout: Layout, config: DeadpoolConfig) -> Relabel:
    """What a Megatron spare built ahead offers to take another node's ranks in place (``rebuild/spare.py``): the two
    nodes' ranks exchanged when they hold the same tensor- and pipeline-parallel coordinates (another data-parallel
    replica of the same model shards, ``layout.dp_exchange_refusal``), its groups renamed (``rebuild/regroup.py``)
    and Megatron's rank lists mapped (``parallel.relabel``); the runtime made after it takes the new coordinates."""
    dist_opt = any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in built.chunks)
    return Relabel(why_not=DIST_OPTIMIZER if dist_opt else None, apply=lambda rank: None, covers=("megatron",),
                   check_mapping=lambda mapping: dp_exchange_refusal(mapping, layout),
                   apply_mapping=parallel.relabel)


class MegatronRuntime(ResilientRuntime):
    what_recovers = "rebuilding parallel state"
    step_name = "iteration"
    swaps_in_place = True

    def __init__(self, built: Built, config: DeadpoolConfig, layout: Layout, coords: Coordinates | None = None, *,
                 seed: int, global_batch: int, micro_batch: int, tier3: str | None = None) -> None:
        """``coords``: this rank's (checked; None: computed from the rank). ``tier3``: the flag that turns the job's
        tier-3 bases on (e.g. ``--save``), if not ``persist.url``."""
        from .checkpoint import refuse_virtual_pipeline

        # Before anything is built or any collective runs: a base holds one model chunk per rank.
        refuse_virtual_pipeline(built.chunks, tier3 or ("persist.url" if config.persist.url else None))
        # spares that saw no section before their script learn the job's fast paths (rank 0; rebuild/spare.py)
        if context().spare.built is None:
            publish_fast_paths(config, rank=dist.get_rank(), swaps_in_place=self.swaps_in_place,
                               framework="Megatron-Core")
        else:
            # a spare that built its model ahead of any failure waits here for its assignment, before the runtime
            # exists (rebuild/spare.py): the node it built for, or one holding another data-parallel replica of the
            # same shards (its groups renamed), joins in place; any other starts it again
            from ...launcher.contract import worker_env
            from ...snapshot.manager import prepare_node
            from ..base import placement_for

            await_assignment(relabel_offer(built, layout, config),
                             prepare=(lambda: prepare_node(config, placement_for(config, worker_env())))
                             if config.enabled else None)
        # the coordinates of the rank it holds now (a relabelled spare: another data-parallel replica's)
        mine = coordinates(dist.get_rank(), layout)
        if coords is not None and coords != mine and context().spare.times.get("relabelled_from") is None:
            raise LayoutError(f"rank {dist.get_rank()} is at {mine} in this layout, the script passed {coords}")
        coords = mine
        self.built: Built | None = built
        self.layout = layout
        self.coords = coords
        self.seed = seed
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        if global_batch % (micro_batch * layout.dp):
            raise LayoutError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x "
                              f"data-parallel size {layout.dp}")
        self.num_micro = global_batch // (micro_batch * layout.dp)
        self.progress = Progress()
        adapter = MegatronStateAdapter(built.chunks, built.optimizer, built.scheduler, layout, coords,
                                       self.progress, self._client_state, self._restore_client_state)
        adapter.global_batch = global_batch
        adapter.allow_batch_change = config.elastic.allow_batch_change
        self._why_no_layout = adapter.why_no_layout()
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
    def _abandon_step(self) -> None:
        """In place: the interrupted iteration's gradients (the DDP buffers, the optimizer's) are dropped, without
        any collective; the restore overwrites parameters, optimizer state and counters next."""
        if self.built is None:
            return
        for chunk in self.built.chunks:
            chunk.zero_grad_buffer()
        self.built.optimizer.zero_grad()

    def _handle(self) -> Any:
        return self

    def _release(self) -> None:
        """Drop the model and optimizer (they hold the dead world's group handles) and Megatron's parallel state
        (groups, memory buffer, RNG tracker). The spare has the failed rank's global rank, hence its TP/PP/DP
        coordinates: the rebuild re-initialises with the same sizes."""
        self.built = None
        parallel.destroy()

    def _release_partial(self) -> None:
        parallel.destroy()

    def _rebuild(self, factory: Callable[[], Any]) -> Any:
        # The same tp and pp; the data-parallel size is the new world's (another one after an elastic resize).
        parallel.initialize(Layout(world_size=dist.get_world_size(), tp=self.layout.tp, pp=self.layout.pp), self.seed)
        return factory()

    def _resize_refusal(self, old: Any, new: Any) -> str | None:
        """A resized generation is continued when it changes data parallelism only and the global batch can be
        kept (or may change); every rank decides the same from the two assignments."""
        stop = ("; the job stops. Start it with more --spare-nodes (a tensor- or pipeline-parallel group that loses "
                "a member always needs one), or relaunch with --load from tier 3")
        if self._why_no_layout:  # (the adapter is already released here)
            return f"Megatron-Core cannot continue on another data-parallel size: {self._why_no_layout}{stop}"
        try:
            layout = dp_resize(self.layout, old.ranks, new.ranks, new.world_size)
            num_micro, batch = keep_global_batch(self.global_batch, self.micro_batch, self.num_micro, layout.dp,
                                                 self.config.elastic.allow_batch_change)
        except LayoutError as exc:
            return f"Megatron-Core shrinks and grows along data parallelism only: {exc}{stop}"
        if self.rank == 0:
            log.info("elastic: Megatron-Core data parallelism %d -> %d (tp %d, pp %d kept): %d micro-batch(es) of %d "
                     "per rank and iteration, global batch %d%s", self.layout.dp, layout.dp, layout.tp, layout.pp,
                     num_micro, self.micro_batch, batch,
                     " (kept)" if batch == self.global_batch else f" (was {self.global_batch}: "
                     "deadpool.elastic.allow_batch_change is true)")
            write_event(event="dp_resized", generation=new.generation, dp=[self.layout.dp, layout.dp], tp=layout.tp,
                        pp=layout.pp, micro_batches=num_micro, micro_batch=self.micro_batch,
                        global_batch=[self.global_batch, batch])
        return None

    def _runtime_of(self, handle: Any) -> ResilientRuntime:
        assert isinstance(handle, MegatronRuntime), "the Megatron rebuild factory must return a MegatronRuntime"
        return handle
