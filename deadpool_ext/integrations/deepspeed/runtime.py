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
import gc
import logging
import os
import time
from typing import Any, Callable

from ...config import DeadpoolConfig
from ...recovery.agree import RecoveryError
from ...snapshot.state import DeepSpeedStateAdapter
from .checkpoint_engine import DeadpoolCheckpointEngine

log = logging.getLogger("deadpool_ext")


def _backend() -> str:
    from ...distributed import default_backend

    return default_backend()


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
        self.adapter = DeepSpeedStateAdapter(engine, self._client_state, self._restore_client_state)
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
            if boundary:
                runtime._after_step_hook()
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
        try:
            version = self.snapshots.restore_latest()
        except RecoveryError as exc:
            from ...distributed import membership

            if membership() is not None:
                membership().report_fatal(str(exc))
            raise
        self._restored_version = version or 0
        gen = int(os.environ.get("DEADPOOL_GENERATION", "0"))
        if gen > 0 and os.environ.get("DEADPOOL_ROLE") == "spare" and not getattr(self, "_spare_logged", False):
            from ...recovery.timeline import write_event

            self._spare_logged = True
            write_event(event="recover", role="spare", generation=gen, rank=self.engine.global_rank, pid=os.getpid(),
                        restored_version=version, restore_s=time.perf_counter() - t0,
                        restored_from=self.snapshots.stats().get("restored_from"), restored_at=time.time())
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
        """Survivor side of hot-swap: tear down, join the next generation, rebuild the engine, restore.

        Returns the new engine. The process and everything outside the engine (data, metrics files) stay."""
        from ...distributed import membership
        from ...recovery.timeline import write_event
        from ...rebuild.worker import init_process_group, teardown

        m = membership()
        gen = m.assignment.generation
        failed_step = int(self.engine.global_steps)
        rank = self.engine.global_rank
        t_noticed = time.time()
        log.warning("generation %d: collective failed at step %d (%s: %s); rebuilding communicators in-process",
                    gen, failed_step, type(exc).__name__, " ".join(str(exc).split())[:600])
        # Last-resort bound on the whole recovery: if anything below blocks past every individual deadline,
        # print all threads' stacks and leave, so the launcher replaces this node instead of the job hanging.
        import faulthandler

        hc = self.config.hot_swap
        faulthandler.dump_traceback_later(hc.teardown_timeout_s + hc.assignment_timeout_s +
                                          hc.collective_timeout_s + 120, exit=True)
        m.report_failure(gen, repr(exc))
        if self.snapshots is not None:
            self.snapshots.quiesce()
        self._closed = True
        factory = self._factory
        self.engine = None
        teardown(self.config.hot_swap.teardown_timeout_s)
        gc.collect()
        min_gen = gen + 1
        while True:
            # A failure during recovery (a peer dying while we rebuild) sends us round again to the next
            # generation; every wait inside has a deadline, so this cannot spin silently.
            a = m.join(min_gen, timeout_s=self.config.hot_swap.assignment_timeout_s)
            t_assigned = time.time()
            try:
                init_process_group(a, m.worker_id, _backend(), self.config.hot_swap.collective_timeout_s)
                t_pg = time.time()
                engine = factory()
                t_engine = time.time()
                version = engine.deadpool.resume()
                t_restored = time.time()
                break
            except RecoveryError:
                raise  # state is gone, not a transient failure: resume() already told the launcher
            except (RuntimeError, OSError) as again:
                log.warning("generation %d: recovery interrupted (%s); waiting for the next assignment",
                            a.generation, " ".join(str(again).split())[:300])
                m.report_failure(a.generation, repr(again))
                engine = None
                teardown(self.config.hot_swap.teardown_timeout_s)
                gc.collect()
                min_gen = a.generation + 1
        faulthandler.cancel_dump_traceback_later()
        # Caught up once the step that was in flight when the failure hit (failed_step + 1) is done again.
        engine.deadpool._catch_up = (failed_step + 1, t_restored)
        write_event(event="recover", role="survivor", generation=a.generation, old_rank=rank,
                    rank=a.ranks[m.worker_id], pid=os.getpid(), failed_step=failed_step, restored_version=version,
                    noticed_at=t_noticed, assigned_at=t_assigned, pg_ready_at=t_pg, engine_ready_at=t_engine,
                    restored_at=t_restored)
        return engine

    def _after_step_hook(self) -> None:
        if self.persist is not None:
            self.persist.after_step()  # tier 3 (collective every persist.interval steps)
        catch = self._catch_up
        if catch is not None and self.engine.global_steps >= catch[0]:
            from ...recovery.timeline import write_event

            write_event(event="caught_up", generation=int(os.environ.get("DEADPOOL_GENERATION", "0")),
                        rank=self.engine.global_rank, step=int(self.engine.global_steps),
                        recompute_s=time.time() - catch[1], recomputed_steps=catch[0] - self._restored_version)
            self._catch_up = None

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
