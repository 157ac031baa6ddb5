"""The extension attached to one DeepSpeed engine: config, checkpoint engine, step hooks, snapshots.

Call order (every rank):

1. ``register(engine, config)`` right after ``deepspeed.initialize`` (collective when snapshots are on:
   it creates the side process group used for replication).
2. ``runtime.resume()`` once before the training loop (collective): restores the newest version every rank
   can restore from the memory tiers and returns the step to continue from (0 for a fresh start).
3. The training loop calls ``engine.step()`` as usual; the wrapped step waits for an in-flight snapshot copy
   just before the optimizer overwrites the tensors being copied, and schedules the next snapshot right after.
4. ``runtime.close()`` at the end (or at interpreter exit): drains the background worker.
"""
from __future__ import annotations

import atexit
import logging
import time
from typing import Any, Callable

from ...chaos import at_step
from ...config import DeadpoolConfig
from ...rebuild.recover import in_hot_swap
from ...snapshot.state import DeepSpeedStateAdapter
from .checkpoint_engine import DeadpoolCheckpointEngine

log = logging.getLogger("deadpool_ext")


class DeadpoolRuntime:
    def __init__(self, engine: Any, config: DeadpoolConfig) -> None:
        self.engine = engine
        self.config = config
        self._closed = False
        self._client_get: Callable[[], dict[str, Any]] | None = None
        self._client_set: Callable[[dict[str, Any]], None] | None = None
        self._restored_version = 0
        self._catch_up: tuple[int, float] | None = None
        self._factory: Callable[[], Any] | None = None
        self.adapter = DeepSpeedStateAdapter(engine, self._client_state, self._restore_client_state,
                                             derive_params=config.snapshot.derive_params)
        self.snapshots = None
        if config.enabled:
            from ...snapshot.manager import SnapshotManager

            self.snapshots = SnapshotManager(self.adapter, config)
        self.checkpoint_engine = DeadpoolCheckpointEngine(engine.global_rank, before_io=self._wait_for_copy)
        engine.checkpoint_engine = self.checkpoint_engine
        # Tier 3 hook (deadpool_ext/persist/tier3.py): base checkpoints persisted in the background when
        # persist.url is set; driven from _after_step_hook, drained in close().
        self.persist = None
        if config.enabled and config.persist.url:
            from ...persist.tier3 import Tier3Persister

            self.persist = Tier3Persister(engine, config.persist, checkpoint_engine=self.checkpoint_engine)
        self._wrap_step()
        atexit.register(self.close)
        log.info("deadpool_ext attached to DeepSpeed engine: ZeRO stage %d, dp=%d, snapshots %s",
                 self.adapter.zero_stage, engine.dp_world_size,
                 f"every {config.snapshot.interval} step(s), replication factor {config.replication.factor}"
                 if self.snapshots else "off")

    # -- client state (e.g. the script's data position) -------------------------------------------
    def set_client_state(self, get: Callable[[], dict[str, Any]], set: Callable[[dict[str, Any]], None]) -> None:
        """Register callbacks whose JSON-able dict is captured with every snapshot and handed back on restore."""
        self._client_get, self._client_set = get, set

    def _client_state(self) -> dict[str, Any]:
        return self._client_get() if self._client_get else {}

    def _restore_client_state(self, state: dict[str, Any]) -> None:
        if self._client_set:
            self._client_set(state)

    # -- hooks --------------------------------------------------------------------------------------
    def _wrap_step(self) -> None:
        """``engine.step`` runs the snapshot hooks around DeepSpeed's step. Under deadpool-run, DeepSpeed's own
        forward, backward and step (never the hooks) may be stopped by the launcher's notice of a new
        generation (``rebuild.interrupt``): that step is thrown away by the hot-swap anyway."""
        from ...distributed import membership
        from ...rebuild import interrupt

        engine = self.engine
        original = engine.step
        runtime = self
        hot_swap = membership() is not None and self.config.hot_swap.enabled

        def stoppable(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not hot_swap:
                return fn

            def call(*args: Any, **kwargs: Any) -> Any:
                with interrupt.stoppable(True):
                    return fn(*args, **kwargs)
            return call

        engine.forward = stoppable(engine.forward)
        engine.backward = stoppable(engine.backward)
        deepspeed_step = stoppable(original)

        def step(*args: Any, **kwargs: Any) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary and runtime.snapshots is not None:
                runtime.snapshots.before_optimizer_step()
            out = deepspeed_step(*args, **kwargs)
            if boundary and runtime.snapshots is not None:
                runtime.snapshots.after_step()
            if boundary:
                runtime._after_step_hook()
            return out

        engine.step = step

    def _wait_for_copy(self) -> None:
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()

    # -- public -------------------------------------------------------------------------------------
    def resume(self, newer_than: int | None = None) -> int:
        """Restore from the memory tiers if this job has snapshots there; return the step to continue from.

        ``newer_than``: the step of a base already loaded from tier 3 (``--load``): memory is used only for a
        newer version, and a memory state no version of which every rank can rebuild falls back to that base
        (logged) instead of failing the job."""
        if self.snapshots is None or not (self.config.recovery.restore_on_start or in_hot_swap()):
            return int(self.engine.global_steps)
        from ...rebuild.recover import restore_from_memory

        t0 = time.perf_counter()
        version, self._spare_logged = restore_from_memory(self.snapshots, self.engine.global_rank,
                                                          getattr(self, "_spare_logged", False), newer_than=newer_than)
        self._restored_version = version or 0
        if version is None:
            return int(self.engine.global_steps)
        log.info("resumed from in-memory snapshot of step %d in %.2f s", version, time.perf_counter() - t0)
        return version

    # -- hot-swap -----------------------------------------------------------------------------------
    def set_rebuild(self, factory: Callable[[], Any]) -> None:
        """``factory()`` builds the model and calls ``deadpool_ext.deepspeed.initialize`` again; hot-swap calls it
        on the new world after the communicators are rebuilt."""
        self._factory = factory

    def can_recover(self, exc: BaseException) -> bool:
        from ...distributed import membership

        return (membership() is not None and self.config.hot_swap.enabled and self._factory is not None
                and isinstance(exc, (RuntimeError, OSError)))

    def recover(self, exc: BaseException) -> Any:
        """Survivor side of hot-swap: tear down, join the next generation, rebuild the engine, restore
        (``deadpool_ext/rebuild/recover.py``). Returns the new engine. The process and everything outside the
        engine (data, metrics files) stay."""
        from ...rebuild import recover

        hc = self.config.hot_swap
        begun = recover.begin(hc, exc, int(self.engine.global_steps))
        rank = self.engine.global_rank
        if self.snapshots is not None:
            self.snapshots.quiesce()
        self._closed = True
        factory = self._factory
        restore_follows = self.snapshots is not None and (self.snapshots.committed_version or 0) > 0
        self.engine = None  # the old engine holds the dead world's groups; drop it before teardown
        r = recover.rejoin(hc, begun, build=lambda a: recover.build_for_restore(factory, restore_follows),
                           resume=lambda engine: engine.deadpool.resume())
        # Caught up once the step that was in flight when the failure hit (failed_step + 1) is done again.
        r.result.deadpool._catch_up = (begun.failed_step + 1, r.restored_at)
        recover.finish(begun, r, old_rank=rank)
        return r.result

    def _after_step_hook(self) -> None:
        if self.persist is not None:
            self.persist.after_step()  # tier 3 (collective every persist.interval steps)
        from ...rebuild.recover import caught_up

        if caught_up(self._catch_up, int(self.engine.global_steps), self.engine.global_rank, self._restored_version):
            self._catch_up = None
        at_step.after_step(int(self.engine.global_steps), self.engine.global_rank)

    def stats(self) -> dict[str, Any]:
        """Snapshot statistics; waits (bounded) for the in-flight snapshot so the counts are final."""
        if self.snapshots is None:
            return {}
        self.snapshots.wait_idle()
        return self.snapshots.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.persist is not None:
            self.persist.close()  # tier 3: publish the base in flight (bounded)
        if self.snapshots is not None:
            self.snapshots.close()
