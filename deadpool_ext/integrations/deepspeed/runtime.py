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

from ...config import DeadpoolConfig
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
        self.adapter = DeepSpeedStateAdapter(engine, self._client_state, self._restore_client_state)
        self.snapshots = None
        if config.enabled:
            from ...snapshot.manager import SnapshotManager

            self.snapshots = SnapshotManager(self.adapter, config)
        self.checkpoint_engine = DeadpoolCheckpointEngine(engine.global_rank, before_io=self._wait_for_copy)
        engine.checkpoint_engine = self.checkpoint_engine
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
        engine = self.engine
        original = engine.step
        runtime = self

        def step(*args: Any, **kwargs: Any) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary and runtime.snapshots is not None:
                runtime.snapshots.before_optimizer_step()
            out = original(*args, **kwargs)
            if boundary and runtime.snapshots is not None:
                runtime.snapshots.after_step()
            return out

        engine.step = step

    def _wait_for_copy(self) -> None:
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()

    # -- public -------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Restore from the memory tiers if this job has snapshots there; return the step to continue from."""
        if self.snapshots is None or not self.config.recovery.restore_on_start:
            return int(self.engine.global_steps)
        t0 = time.perf_counter()
        version = self.snapshots.restore_latest()
        if version is None:
            return int(self.engine.global_steps)
        log.info("resumed from in-memory snapshot of step %d in %.2f s", version, time.perf_counter() - t0)
        return version

    def stats(self) -> dict[str, Any]:
        return self.snapshots.stats() if self.snapshots is not None else {}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.snapshots is not None:
            self.snapshots.close()
