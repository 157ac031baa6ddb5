"""The extension attached to one DeepSpeed engine: config, checkpoint engine, step hooks, snapshots.

Call order (every rank) is the :class:`~deadpool_ext.integrations.base.ResilientRuntime` contract:

1. ``register(engine, config)`` right after ``deepspeed.initialize`` (collective when snapshots are on:
   it creates the side process group used for replication).
2. ``runtime.resume()`` once before the training loop (collective): restores the newest version every rank
   can restore from the memory tiers and returns the step to continue from (0 for a fresh start).
3. The training loop calls ``engine.step()`` as usual; the wrapped step waits for an in-flight snapshot copy
   just before the optimizer overwrites the tensors being copied, and schedules the next snapshot right after.
   A pipeline engine (``PipelineModule``) steps inside ``train_batch``: its ``_take_model_step`` is wrapped (under
   the in-place swap the step's snapshot waits for the call's end, when it has the loss: ``pipe_redo.py``).
4. Hot-swap: ``engine.deadpool.set_rebuild(build_engine)``; around a step,
   ``engine = engine.deadpool.handle_failure(exc)`` (the same engine in place, else the new one; None: raise).
5. ``runtime.close()`` at the end (or at interpreter exit): drains the background worker and tier 3.

What is DeepSpeed's own here: the state adapter (``state.py``), the wrapped ``engine.step`` (and
``forward``/``backward``, stoppable by the launcher's notice), the checkpoint engine and tier 3, an in-place
hot-swap's abandoned step (:func:`abandon_step`: the interrupted step's half-done state dropped, through DeepSpeed's
private attributes, version-guarded by :data:`SUPPORTED`), and the rebuild (drop the engine; the script's factory
calls ``deepspeed.initialize`` again; DeepSpeed's process-wide caches are reset by ``rebuild.py``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from packaging.version import Version

from ...config import DeadpoolConfig
from ...rebuild.context import context
from ..base import ResilientRuntime
from . import checkpoint_calls, trace
from .checkpoint_engine import DeadpoolCheckpointEngine
from .state import DeepSpeedStateAdapter

log = logging.getLogger("deadpool_ext")

SUPPORTED = (Version("0.16"), Version("0.20"))
"""The DeepSpeed versions whose private attributes the hot-swap touches (:func:`abandon_step` here, the caches
``rebuild.py`` resets), checked where they are touched: other versions are refused in one line, never half-done."""


DEFERRING = ("ResilientLoop", "resilient_steps")
"""The loops whose runtime defers a failure after a step's snapshot to the next call (:meth:`DeadpoolRuntime._defer`):
each calls ``drain()`` after its last step, inside its recovery scope, so no deferred failure is left unraised."""


class DeadpoolRuntime(ResilientRuntime):
    swaps_in_place = True
    def __init__(self, engine: Any, config: DeadpoolConfig) -> None:
        self.engine = engine
        self._deferred: Exception | None = None
        """A failure after a step's snapshot, raised at the framework's next call (:meth:`_defer`)."""
        adapter = DeepSpeedStateAdapter(engine, self._client_state, self._restore_client_state,
                                        derive_params=config.snapshot.derive_params)
        adapter.allow_batch_change = config.elastic.allow_batch_change
        self.zero_stage = adapter.zero_stage
        self.optimizer_wrapper = adapter.wrapper
        """DeepSpeed's class of the engine's optimizer wrapper (``wrappers.py``), also in :meth:`stats`."""
        super().__init__(config, adapter, rank=int(engine.global_rank))
        self.checkpoint_engine = DeadpoolCheckpointEngine(engine.global_rank, before_io=self.wait_for_copy)
        engine.checkpoint_engine = self.checkpoint_engine
        # Tier 3 hook (integrations/deepspeed/tier3.py): base checkpoints persisted in the background when
        # persist.url is set; driven from the step hook, drained in close().
        self.persist = None
        if config.enabled and config.persist.url:
            from .tier3 import Tier3Persister

            self.persist = Tier3Persister(engine, config.persist, checkpoint_engine=self.checkpoint_engine)
        self._wrap_step()
        # DeepSpeed's own resume pattern (load_checkpoint / save_checkpoint with a step in client_state) served
        # from memory when memory holds a newer version (checkpoint_calls.py).
        self.checkpoint_calls = checkpoint_calls.CheckpointCalls(engine, self)
        self.redo: Any = None
        if self._in_place:
            # A plain loop (no resilient_steps, ResilientLoop or framework loop) survives a lost peer unchanged: the
            # interrupted step is redone inside DeepSpeed's own calls (redo.py; a pipeline's train_batch: pipe_redo.py).
            if getattr(engine, "pipeline_parallelism", False):
                from .pipe_redo import BatchRedo

                self.redo = BatchRedo(engine, self)
            else:
                from .redo import StepRedo

                self.redo = StepRedo(engine, self, forward=engine.forward, backward=engine.backward, step=engine.step)
        self.canary.watch_engine(engine)  # the loss backward gets, the gradient norm after a step (canary.py)
        log.info("deadpool_ext attached to DeepSpeed engine: ZeRO stage %d, dp=%d, snapshots %s",
                 self.zero_stage, engine.dp_world_size,
                 f"every {config.snapshot.interval} step(s), replication factor {config.replication.factor}"
                 if self.snapshots else "off")

    # -- the step hook --------------------------------------------------------------------------------
    def _wrap_step(self) -> None:
        """``engine.step`` runs the snapshot hooks around DeepSpeed's step. Under deadpool-run, DeepSpeed's own
        forward, backward and step (never the hooks) may be stopped by the launcher's notice of a new
        generation (``rebuild.notice``): that step is thrown away by the hot-swap anyway."""
        engine = self.engine
        runtime = self
        if self.config.enabled:
            from ...preempt.worker import install

            install(self.config.preemption, self.rank)  # a SIGTERM drains the job (drain.py)
        drain = context().drain
        if getattr(engine, "pipeline_parallelism", False):
            self._wrap_pipeline_step()
            return

        def stoppable(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not runtime._hot_swap:
                return fn

            def call(*args: Any, **kwargs: Any) -> Any:
                with runtime.stoppable():
                    return fn(*args, **kwargs)
            return call

        forward = stoppable(engine.forward)

        def drained_forward(*args: Any, **kwargs: Any) -> Any:
            drain.exit_if_due()  # a drained process ends here, its script's bookkeeping of the step done
            runtime.raise_deferred()
            return forward(*args, **kwargs)

        engine.forward = drained_forward
        engine.backward = stoppable(engine.backward)
        deepspeed_step = stoppable(engine.step)

        def step(*args: Any, **kwargs: Any) -> Any:
            drain.exit_if_due()
            runtime.raise_deferred()
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                runtime._before_optimizer_step()
            out = deepspeed_step(*args, **kwargs)
            if boundary:
                runtime._after_optimizer_step()
            return out

        engine.step = step

    def _wrap_pipeline_step(self) -> None:
        """A ``PipelineEngine`` steps inside ``train_batch`` (its ``step`` raises): the optimizer step is its
        ``OptimizerStep`` instruction, which calls ``self._take_model_step``; that call gets the snapshot hooks.
        Every stage runs it once per batch, after its last backward."""
        engine = self.engine
        take_model_step = engine._take_model_step

        def step(*args: Any, **kwargs: Any) -> Any:
            context().drain.exit_if_due()  # a drained pipeline ends at its next optimizer step
            self.raise_deferred()
            self._before_optimizer_step()
            out = take_model_step(*args, **kwargs)
            if self.redo is not None:
                self.redo.step_taken()  # its snapshot once train_batch has the loss (pipe_redo.py)
            else:
                self._after_optimizer_step()
            return out

        engine._take_model_step = step

    def _after_optimizer_step(self) -> None:
        if self.snapshots is not None:
            self._before_first_snapshot()
            self.snapshots.after_step()
        try:
            if self.persist is not None:
                self.persist.after_step()  # tier 3 (collective every persist.interval steps)
            if context().drain.armed:
                from .drain import at_boundary

                at_boundary(self)  # a preemption's drain: persist this step when any rank was asked to (drain.py)
        except Exception as exc:
            self._defer(exc)
        self._report_to_monitor()
        self._after_snapshot()

    def _defer(self, exc: Exception) -> None:
        """A collective after the step's snapshot failed (a tier-3 base, a drain's agreement): the step is taken and
        its snapshot scheduled, so a restore may resume right after it. Under the in-place swap, in a loop that
        redoes a failed step itself and drains the runtime at its end (:data:`DEFERRING`), the failure is raised at
        the framework's next call (:meth:`raise_deferred`), so the script's own bookkeeping of this step (its
        metrics line, its counters) runs first, as after any step a restore can resume after. Otherwise now: a
        plain loop's redo (``redo.py``) knows a step call that failed after its update, and the Trainer's and
        Lightning's loops are re-entered at the restored step."""
        if not self._hot_swap or self.loop_owner not in DEFERRING:
            raise exc
        log.warning("step %d: a collective after its snapshot failed (%s: %s); the step is done, and the failure is "
                    "handled at the framework's next call", self.step_counter(), type(exc).__name__,
                    str(exc).splitlines()[0][:160] if str(exc) else "")
        self._deferred = exc

    def raise_deferred(self) -> None:
        """Raise the failure :meth:`_defer` kept (once), at the start of the framework's next call."""
        exc = self._deferred
        if exc is not None:
            self._deferred = None
            raise exc

    def drain(self) -> None:
        self.raise_deferred()  # the loop's last step: its failure is raised inside the loop's recovery scope
        super().drain()

    def _report_to_monitor(self) -> None:
        """Snapshot metrics through DeepSpeed's monitor (its ``tensorboard`` / ``wandb`` / ``csv_monitor`` /
        ``comet`` config sections; rank 0 writes), as ``Deadpool/<metric>`` against ``global_samples`` like
        DeepSpeed's own ``Train/Samples/*`` events."""
        monitor = getattr(self.engine, "monitor", None)
        if self.snapshots is None or monitor is None or not getattr(monitor, "enabled", False):
            return
        step = self.step_counter()
        samples = int(getattr(self.engine, "global_samples", step))
        monitor.write_events([(f"Deadpool/{k}", v, samples) for k, v in self.snapshots.metrics(step).items()])

    def step_counter(self) -> int:
        return int(self.engine.global_steps)

    def _internal_client_state(self) -> dict[str, Any]:
        saved = self.checkpoint_calls.state() if hasattr(self, "checkpoint_calls") else None
        return {checkpoint_calls.KEY: saved} if saved is not None else {}

    def _restore_internal_client_state(self, state: dict[str, Any]) -> set[str]:
        if hasattr(self, "checkpoint_calls"):
            self.checkpoint_calls.restore(state.get(checkpoint_calls.KEY))
        return {checkpoint_calls.KEY}

    # -- hot-swap ---------------------------------------------------------------------------------------
    def _handle(self) -> Any:
        return self.engine

    def _abandon_step(self) -> None:
        self._deferred = None  # a recovery is under way: a failure kept for the next call is part of it
        abandon_step(self.engine)

    def _restored_in_hot_swap(self) -> None:
        if self.snapshots is not None:
            trace.agree(self.engine, self.snapshots.group, self.rank)  # ZeRO-3's trace kept, not recorded again

    def _release(self) -> None:
        self.engine = None  # the old engine holds the dead world's groups; drop it before teardown

    def _rebuild(self, factory: Callable[[], Any]) -> Any:
        from .rebuild import comm_ready_again

        comm_ready_again()  # a factory may ask deepspeed.comm before deepspeed.initialize (a PipelineModule does)
        return factory()  # builds the model and calls deadpool_ext.deepspeed.initialize on the new world

    def _runtime_of(self, handle: Any) -> ResilientRuntime:
        rt = handle.deadpool
        if not isinstance(rt, ResilientRuntime):
            raise RuntimeError("the rebuild factory returned an engine without deadpool_ext attached (its "
                               "config has no \"deadpool\" section?)")
        return rt

    def stats(self) -> dict[str, Any]:
        """The snapshot statistics and ``optimizer_wrapper``: which of DeepSpeed's wrappers was snapshotted."""
        out = super().stats()
        if out:
            out["optimizer_wrapper"] = self.optimizer_wrapper
        return out

    def _close(self) -> None:
        from ...preempt.worker import disarm

        disarm()  # training is over: a SIGTERM ends the process at once again
        if self.persist is not None:
            # tier 3: publish the base in flight (bounded); after a drain the budget is spent: no wait
            self.persist.close(0.0 if context().drain.outcome is not None else None)


# -- an in-place hot-swap: the interrupted step abandoned --------------------------------------------------------------

_COORD = "_PartitionedParameterCoordinator__"   # name-mangled attributes of DeepSpeed's ZeRO-3 coordinator


def abandon_step(engine: Any) -> None:
    """In-place hot-swap, survivor: drop what the interrupted step left half done, so that the engine (whose
    tensors the restore then overwrites) is in the state of a freshly built one at a step boundary, the state
    the spare's engine is in. No collective (the communicators are dead). Version-guarded (:data:`SUPPORTED`).

    ZeRO-3: in-flight parameter all-gathers are forgotten (never waited: their peer is gone), parameters still
    gathered or half gathered are marked for release (the restore's prologue partitions all of them), the
    coordinator's complete trace is kept (``trace.py``: after the restore the spare adopts it, or every rank drops
    its own), one still being recorded is dropped. Every stage:
    gradient buckets emptied, accumulated gradients (``BF16_Optimizer``'s fp32 buffers too) and "already reduced"
    flags cleared, micro-step counters reset, as after DeepSpeed's own ``step``."""
    import deepspeed

    version = Version(deepspeed.__version__.split("+")[0])
    if not (SUPPORTED[0] <= version < SUPPORTED[1]):
        raise RuntimeError(f"deadpool_ext in-place hot-swap supports DeepSpeed {SUPPORTED[0]} to <{SUPPORTED[1]}, "
                           f"found {version}; set deadpool.hot_swap.in_place: false")
    opt: Any = getattr(engine, "optimizer", None)
    stage = int(engine.zero_optimization_stage())
    if stage == 3:
        _abandon_zero3(engine, opt)
    elif stage in (1, 2):
        for bucket in getattr(opt, "ipg_buckets", {}).values():
            bucket.clear()
        flags = getattr(opt, "params_already_reduced", None)
        if isinstance(flags, list):
            flags[:] = [False] * len(flags)
        if hasattr(opt, "reset_partition_gradient_structures"):
            opt.reset_partition_gradient_structures()
        if hasattr(opt, "averaged_gradients"):
            opt.averaged_gradients = {}
        if hasattr(opt, "previous_reduced_grads") and isinstance(opt.previous_reduced_grads, dict):
            opt.previous_reduced_grads.clear()
        large = getattr(opt, "extra_large_param_to_reduce", None)
        if isinstance(large, dict):
            large.clear()
        elif large is not None:
            opt.extra_large_param_to_reduce = None
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt.micro_step_id = INITIAL_MICRO_STEP_ID
    if hasattr(opt, "clear_hp_grads"):
        # BF16_Optimizer accumulates every backward into its fp32 gradient buffers, emptied only by its step: the
        # interrupted step's gradients would be added again to the redone step's (its zero_grad does this too).
        opt.clear_hp_grads()
    # Gradients dropped directly (ZeRO-3's zero_grad calls record_stream, which host tensors refuse).
    for p in engine.module.parameters():
        p.grad = None
        if hasattr(p, "grad_accum"):
            p.grad_accum = None
    if stage == 3:
        opt.micro_step_id = 0
        if hasattr(opt, "_epilogue_ran_this_backward"):
            opt._epilogue_ran_this_backward = False
    for name in ("_running_engine_backward",):
        if hasattr(engine, name):
            setattr(engine, name, False)
    if hasattr(engine, "_running_engine_backward_count"):
        engine._running_engine_backward_count = 0
    if hasattr(engine, "reset_activation_shape"):
        _abandon_pipeline(engine)


def _abandon_pipeline(engine: Any) -> None:
    """A ``PipelineEngine`` interrupted inside ``train_batch``: its point-to-point state made as a fresh engine's,
    which the spare's is, so that both sides of every stage boundary agree that the next activation is preceded by
    its shape (``reset_activation_shape``: DeepSpeed's own reset, and the first gradient send); the schedule's
    buffers released (they hold the interrupted step's activations and graph); the grad-boundary flag its
    reduction forces dropped; and the timers it left running stopped (``train_batch`` asserts its timer is not)."""
    engine.reset_activation_shape()
    engine.first_gradient_send = True
    engine._force_grad_boundary = False
    for held in engine.pipe_buffers.values():
        held[:] = [None] * len(held)
    for timer in getattr(getattr(engine, "timers", None), "timers", {}).values():
        if getattr(timer, "started_", False):
            timer.reset()


def _abandon_zero3(engine: Any, opt: Any) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    coord = opt.parameter_offload.get_param_coordinator()
    getattr(coord, _COORD + "inflight_param_registry").clear()
    for p in engine.module.parameters():
        p.ds_active_sub_modules.clear()
        if p.ds_status == ZeroParamStatus.INFLIGHT:
            p.ds_status = ZeroParamStatus.AVAILABLE  # its buffer is whole in size; partitioned by the restore
    if not coord.is_complete_trace():
        # a trace still being recorded is half a trace: dropped, so every rank records again (trace.agree)
        trace.drop(coord)
    setattr(coord, _COORD + "step_id", 0)
    setattr(coord, _COORD + "n_available_params", 0)
    for name in ("ongoing_fetch_events", "active_backward_submodules", "ongoing_fetch_leaf_module_events"):
        held = getattr(coord, _COORD + name, None)
        if held is not None:
            held.clear()
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        bucket.clear_params()
    flags = getattr(opt, "params_already_reduced", None)
    if isinstance(flags, dict):
        for k in flags:
            flags[k] = False
    if hasattr(opt, "previous_reduced_grads"):
        opt.previous_reduced_grads = None
    if hasattr(opt, "averaged_gradients") and isinstance(opt.averaged_gradients, dict):
        opt.averaged_gradients.clear()
