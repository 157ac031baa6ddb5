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
   and continue the loop from ``runtime.progress.iteration``.
7. ``runtime.close()``.
"""
from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from ...chaos import at_step
from ...config import DeadpoolConfig
from ...rebuild.recover import in_hot_swap
from . import parallel
from .layout import Coordinates, Layout
from .model import Built
from .state import MegatronStateAdapter

log = logging.getLogger("deadpool_ext")


@dataclass(slots=True)
class Progress:
    iteration: int = 0
    consumed_samples: int = 0


class MegatronRuntime:
    def __init__(self, built: Built, config: DeadpoolConfig, layout: Layout, coords: Coordinates, *, seed: int,
                 global_batch: int) -> None:
        self.built = built
        self.config = config
        self.layout = layout
        self.coords = coords
        self.seed = seed
        self.global_batch = global_batch
        self.rank = dist.get_rank()
        self.progress = Progress()
        self._closed = False
        self._client_get: Callable[[], dict[str, Any]] | None = None
        self._client_set: Callable[[dict[str, Any]], None] | None = None
        self._factory: Callable[[], "MegatronRuntime"] | None = None
        self._restored_version = 0
        self._catch_up: tuple[int, float] | None = None
        self.adapter = MegatronStateAdapter(built.chunks, built.optimizer, built.scheduler, layout, coords,
                                            self.progress, self._client_state, self._restore_client_state)
        self.snapshots = None
        if config.enabled:
            from ...snapshot.manager import SnapshotManager

            self.snapshots = SnapshotManager(self.adapter, config)
        atexit.register(self.close)
        if self.rank == 0:
            log.info("deadpool_ext attached to Megatron-Core: tp=%d pp=%d dp=%d, snapshots %s", layout.tp, layout.pp,
                     layout.dp, f"every {config.snapshot.interval} step(s), replication factor "
                     f"{config.replication.factor}" if self.snapshots else "off")

    # -- client state -------------------------------------------------------------------------------
    def set_client_state(self, get: Callable[[], dict[str, Any]], set: Callable[[dict[str, Any]], None]) -> None:
        """JSON-able dict captured with every snapshot and handed back on restore."""
        self._client_get, self._client_set = get, set

    def _client_state(self) -> dict[str, Any]:
        return self._client_get() if self._client_get else {}

    def _restore_client_state(self, state: dict[str, Any]) -> None:
        if self._client_set:
            self._client_set(state)

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> tuple[bool, float | None]:
        """Optimizer + scheduler step with the snapshot hooks around it; returns (stepped, grad norm)."""
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()
        with self.stoppable():
            ok, grad_norm, _ = self.built.optimizer.step()
            if ok:
                self.built.scheduler.step(increment=self.global_batch)
        # Megatron-LM counts skipped (overflow) iterations too; so do we, so the data position stays aligned.
        self.progress.iteration += 1
        self.progress.consumed_samples += self.global_batch
        if self.snapshots is not None:
            self.snapshots.after_step()
        self._after_step_hook()
        return bool(ok), None if grad_norm is None else float(grad_norm)

    def stoppable(self) -> Any:
        """Context for Megatron's own forward/backward and optimizer step: under deadpool-run, the launcher's
        notice of a new generation stops them (``rebuild.interrupt``); the hot-swap throws that step away."""
        from ...distributed import membership
        from ...rebuild import interrupt

        return interrupt.stoppable(membership() is not None and self.config.hot_swap.enabled)

    def wait_for_copy(self) -> None:
        """Block until the in-flight snapshot copy is done (before anything else writes the state in place)."""
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()

    # -- resume -------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Restore from the memory tiers if this job has snapshots there; return the iteration to continue from."""
        if self.snapshots is None or not (self.config.recovery.restore_on_start or in_hot_swap()):
            return self.progress.iteration
        from ...rebuild.recover import restore_from_memory

        t0 = time.perf_counter()
        version, self._spare_logged = restore_from_memory(
            self.snapshots, self.rank, getattr(self, "_spare_logged", False),
            coords={"tp": self.coords.tp, "pp": self.coords.pp, "dp": self.coords.dp})
        self._restored_version = version or 0
        if version is None:
            return self.progress.iteration
        log.info("resumed from in-memory snapshot of iteration %d in %.2f s (tp %d, pp %d, dp %d)", version,
                 time.perf_counter() - t0, self.coords.tp, self.coords.pp, self.coords.dp)
        return version

    # -- hot-swap -----------------------------------------------------------------------------------
    def set_rebuild(self, factory: Callable[[], "MegatronRuntime"]) -> None:
        """``factory()`` builds model + optimizer on the current parallel state and returns a new runtime."""
        self._factory = factory

    def can_recover(self, exc: BaseException) -> bool:
        from ...distributed import membership

        return (membership() is not None and self.config.hot_swap.enabled and self._factory is not None
                and isinstance(exc, (RuntimeError, OSError)))

    def recover(self, exc: BaseException) -> "MegatronRuntime":
        """Survivor side of hot-swap; returns the runtime of the rebuilt model and optimizer.

        Order: stop snapshotting; drop the model and optimizer (they hold the dead world's group handles);
        ``parallel.destroy()`` (Megatron's groups, memory buffer, RNG tracker); destroy every process group;
        join the launcher's next generation (the spare has the failed rank's global rank, hence its TP/PP/DP
        coordinates); ``initialize_model_parallel`` with the same sizes; ``factory()``; ``resume()``."""
        from ...rebuild import recover

        hc = self.config.hot_swap
        begun = recover.begin(hc, exc, self.progress.iteration, "rebuilding parallel state")
        rank = self.rank
        if self.snapshots is not None:
            self.snapshots.quiesce()
        self._closed = True
        factory, layout, seed = self._factory, self.layout, self.seed
        self.built = None  # type: ignore[assignment]
        self.adapter = None  # type: ignore[assignment]
        parallel.destroy()

        def build(_a: Any) -> "MegatronRuntime":
            parallel.initialize(layout, seed)
            return factory()

        r = recover.rejoin(hc, begun, build=build, resume=lambda rt: rt.resume(), release=parallel.destroy)
        # Caught up once the iteration in flight when the failure hit (failed_step + 1) is done again.
        r.result._catch_up = (begun.failed_step + 1, r.restored_at)
        recover.finish(begun, r, old_rank=rank)
        return r.result

    def _after_step_hook(self) -> None:
        from ...rebuild.recover import caught_up

        if caught_up(self._catch_up, self.progress.iteration, self.rank, self._restored_version):
            self._catch_up = None
        at_step.after_step(self.progress.iteration, self.rank)

    # -- misc ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        if self.snapshots is None:
            return {}
        self.snapshots.wait_idle()
        return self.snapshots.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.snapshots is not None:
            self.snapshots.close()
