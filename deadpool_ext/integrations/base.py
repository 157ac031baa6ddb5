"""The one runtime contract every framework integration implements (DeepSpeed, Megatron-Core, and the coming
Hugging Face Trainer / Accelerate / Lightning ones).

A :class:`ResilientRuntime` is attached to one training job's model and optimizer. It owns what every
framework needs alike: the snapshot manager (tiers 1 and 2), client state, ``resume``, the one failure path
(``handle_failure``, which hands a failure to the process's recovery driver, ``rebuild/recover.py``),
statistics and ``close``. A framework supplies only what is its
own: the state adapter, its step hook, what to release before teardown, how to rebuild on a new world.

Call order (every rank, main thread; "collective" = every rank calls it at the same point):

1. ``__init__`` (subclass): build the :class:`~deadpool_ext.snapshot.state.RankStateAdapter`, then
   ``super().__init__(config, adapter, rank=...)``. Collective when snapshots are on (side process group).
2. ``set_client_state(get, set)``: a JSON-able dict captured with every snapshot, handed back on restore.
   ``set_rebuild(factory)``: ``factory()`` rebuilds the framework's objects on the current world and returns
   the handle the training loop holds (the engine, or the new runtime); hot-swap calls it on the new world.
3. ``resume(newer_than=None)`` once before the loop (collective): restores the newest version every rank can
   obtain from memory; returns the step to continue from. A spare that took a failed node's place joins the
   survivors first, in its own step (``join_survivors()``, which ``resume`` runs when the script has not).
4. Per optimizer step, from the subclass's step hook: ``_before_optimizer_step()`` before the optimizer
   overwrites the state in place, ``_after_optimizer_step()`` after it (schedules the next snapshot, fires the
   ``after_step`` hook point). Framework calls that a launcher's notice may stop run inside ``stoppable()``.
5. A failure inside a step: ``handle = runtime.handle_failure(exc)``; None: raise ``exc``; else redo the step
   with ``handle`` (:class:`ResilientLoop`, below, does this for a loop). The driver
   recovers when the launcher ended the generation (the cause), in the runtime's mode (in place, rebuild,
   resized), calling this runtime's named hooks (:class:`RuntimeHooks`; order in ``rebuild/recover.py``).
   After a rebuild this runtime is closed; the handle returned belongs to the new world.
6. ``stats()`` (waits, bounded, for the snapshot in flight), ``close()`` (idempotent; also at exit).

:class:`ResilientLoop` is that call order's loop, for every integration whose loop is the extension's (the demo
scripts, Megatron-Core) or a user's own::

    loop = ResilientLoop(engine, runtime=lambda e: e.deadpool, done=lambda e: e.global_steps >= iters,
                         step=train_one_step, after_swap=lambda e: e.train())
    for engine, out in loop:          # one item per completed step; engine is the current handle
        log_metrics(out)
    loop.swaps                        # how many hot-swaps happened

Subclasses implement :meth:`step_counter`, :meth:`_release`, :meth:`_rebuild` and :meth:`_runtime_of`;
they may extend :meth:`_close` and :meth:`_timeline_fields`.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

from ..cluster.topology import NodePlacement, node_placement
from ..config import DeadpoolConfig
from ..launcher import keys
from ..launcher.contract import WorkerEnv, worker_env
from ..memory.census import memory_census
from ..memory.heap import release_free_heap
from ..persist.sign import use_key_env
from ..rebuild import notice, progress
from ..rebuild import recover as protocol
from ..rebuild.cause import Mode, recovery_mode
from ..rebuild.context import context
from ..rebuild.recover import driver
from ..recovery.canary import KEY as CANARY_KEY
from ..recovery.timeline import write_event
from ..snapshot.manager import SnapshotManager
from ..snapshot.state import RankStateAdapter
from . import loaders as data_position
from .canary import CanaryRollback, CanaryWatch

log = logging.getLogger("deadpool_ext")

ClientGet = Callable[[], dict[str, Any]]
ClientSet = Callable[[dict[str, Any]], None]


def placement_for(config: DeadpoolConfig, env: WorkerEnv) -> NodePlacement:
    """Where this rank's node-local memory lives, from the launcher's variables and the config."""
    hs = env.hot_swap
    return node_placement(job_id=config.job_id or env.default_job_id(), host=env.node_name(),
                          launcher_node=hs.node if hs is not None else None, local_rank=env.local_rank,
                          local_world_size=env.local_world_size, simulate_nodes=config.local.simulate_nodes,
                          shm_root=(hs.shm_root if hs is not None and hs.shm_root else config.local.shm_root),
                          launcher_pid=env.launcher_pid)


RESUME_FIX = ("Fix: DeepSpeed's own `engine.load_checkpoint(dir)` (a newer version in memory comes back from it), "
              "or `start_step = engine.deadpool.resume()` right after deepspeed.initialize / "
              "accelerator.prepare, or loop with `for step in resilient_steps(engine, loader, max_steps=N)` "
              "(from deadpool_ext.steps import resilient_steps)")
"""The one change that makes a script restore from memory after a restart (said wherever it does not)."""


def never_restored_lines(step_name: str, unused_versions: list[int]) -> list[str]:
    """What a process that takes snapshots but never called ``resume()`` is told at its first snapshot (pure):
    that a restart would start from scratch, the one line that fixes it, and the snapshots of an earlier attempt
    of this job it left unused (``unused_versions``: what its own memory held then)."""
    lines = [f"deadpool_ext: this process takes snapshots but never restores from them (nothing called "
             f"resume() before the first {step_name}: no resilient_steps, HF Trainer or Lightning path): after a "
             f"restart it trains again from step 0. {RESUME_FIX}"]
    if unused_versions:
        lines.append(f"deadpool_ext: snapshots of {step_name} {max(unused_versions)} from an earlier attempt of this "
                     "job exist in memory and were not used: this run started again from step 0")
    return lines


class ResilientRuntime(ABC):
    """See the module docstring for the call order."""

    what_recovers: ClassVar[str] = "rebuilding communicators"
    """How the survivor's log line names the in-process rebuild."""
    swaps_in_place: ClassVar[bool] = False
    """The framework's objects survive a swap of the communicators beneath them (``rebuild/swap.py``): the
    subclass implements :meth:`_abandon_step` and :meth:`_handle`."""
    step_name: ClassVar[str] = "step"
    attached_total: ClassVar[int] = 0
    """Runtimes created in this process (any framework): ``python -m deadpool_ext.run`` checks it at exit."""
    restoring_total: ClassVar[int] = 0
    """Runtimes of this process that restore from memory at a restart (a restore path ran: ``resume()``, or a
    framework's own load routed to memory, which sets ``_resume_called``, with ``recovery.restore_on_start``):
    ``python -m deadpool_ext.run`` reads it to say what a torchrun restart will do."""

    def __init__(self, config: DeadpoolConfig, adapter: RankStateAdapter, *, rank: int) -> None:
        self.config = config
        use_key_env(config.key_env)  # every key this process reads from now on (tier 3, tier 2) comes from there
        ResilientRuntime.attached_total += 1
        self.adapter: RankStateAdapter | None = adapter
        self.rank = rank
        self._closed = False
        self._client_get: ClientGet | None = None
        self._client_set: ClientSet | None = None
        self._factory: Callable[[], Any] | None = None
        self._restored_version = 0
        self._catch_up: tuple[int, float] | None = None
        self._trim_at_catch_up = False
        self._spare_logged = False
        self._resume_called = False
        self._first_snapshot_seen = False
        self._hot_swap = context().membership is not None and config.hot_swap.enabled
        self.loaders = (data_position.process_tracker(self.settle_rng) if config.enabled
                        else data_position.LoaderPositions())
        """The data position of the script's own DataLoaders (``loaders.py``); a framework that positions its
        loader itself claims it (``loaders.claim``)."""
        self.canary = CanaryWatch(config.canary, rank)
        """The numerical canary after every restore (``integrations/canary.py``)."""
        self.loop_owner: str | None = None
        """The loop that catches a failed step and calls :meth:`handle_failure` itself (``resilient_steps``,
        :class:`ResilientLoop`, the HF Trainer's, Lightning's); None: a plain loop, whose failed step a framework
        integration redoes inside the framework's own calls (DeepSpeed: ``deepspeed/redo.py``)."""
        from ..rebuild import swap

        self._in_place = self._hot_swap and self.swaps_in_place and config.hot_swap.in_place and swap.active()
        if self._in_place:
            # An in-place recovery collects what the interrupted step left (gc.collect(), twice per recovery): what
            # exists when the extension attaches (the framework's modules, the model, the dataset) is collected once
            # and then kept out of the cyclic collector's walks (gc.freeze), so those collections walk only what
            # training made since. Objects frozen here are still freed by reference counting.
            gc.collect()
            gc.freeze()
        self.snapshots: SnapshotManager | None = (
            SnapshotManager(adapter, config, placement_for(config, worker_env())) if config.enabled else None)
        m = context().membership
        if m is not None and rank == 0:
            with contextlib.suppress(Exception):  # the launcher's flags, if given, win anyway
                if config.elastic.no_spare_policy is not None:
                    m.store.set_json(keys.JOB_POLICY, config.elastic.no_spare_policy)
                m.store.set_json(keys.JOB_STRAGGLER, keys.straggler_value(config.straggler))
        atexit.register(self.close)

    # -- what a framework supplies ------------------------------------------------------------------------
    @abstractmethod
    def step_counter(self) -> int:
        """The optimizer-step counter (the version a snapshot taken now carries)."""

    @abstractmethod
    def _release(self) -> None:
        """Drop the framework objects that hold the dead world's process groups (engine, model, optimizer,
        framework parallel state), before the teardown. Called once per recovery."""

    @abstractmethod
    def _rebuild(self, factory: Callable[[], Any]) -> Any:
        """Build the framework's objects on the new world (its process group is up): at least ``factory()``;
        returns the loop's handle."""

    @abstractmethod
    def _runtime_of(self, handle: Any) -> ResilientRuntime:
        """The runtime attached to a handle that :meth:`_rebuild` returned."""

    def _abandon_step(self) -> None:  # noqa: B027 - optional hook, a no-op unless a subclass overrides it
        """In-place hot-swap: drop what the interrupted step left half done (gathered parameters, gradient
        buckets, accumulated gradients), without any collective; the restore then overwrites the state."""

    def _restored_in_hot_swap(self) -> None:  # noqa: B027 - optional hook, a no-op unless a subclass overrides it
        """After a restore from memory in a generation after a failure, on every rank (collective if overridden):
        agree on what of the framework's own caches the survivors keep and the spare adopts."""

    def _handle(self) -> Any:
        """In-place hot-swap: the loop's handle, which stays the same object (the engine)."""
        raise NotImplementedError(f"{type(self).__name__} does not swap in place")

    def _release_partial(self) -> None:  # noqa: B027 - optional hook, a no-op unless a subclass overrides it
        """Drop what a rebuild built on a generation that failed while forming (before its teardown)."""

    def _resize_refusal(self, old: Any, new: Any) -> str | None:
        """Why this integration cannot continue on generation ``new`` (an ``Assignment`` of another world size
        than ``old``: elastic shrink or grow); None: it can (the default). Called on every rank, before anything
        is built on the new world."""
        return None

    def _timeline_fields(self) -> dict[str, Any]:
        """Extra fields of this rank's ``recover`` timeline events (e.g. Megatron's tp/pp/dp coordinates)."""
        return {}

    def _close(self) -> None:  # noqa: B027 - optional hook, a no-op unless a subclass overrides it
        """Release what the subclass holds at close (called once)."""

    # -- client state ---------------------------------------------------------------------------------
    def set_client_state(self, get: ClientGet, set: ClientSet) -> None:
        """Register callbacks whose JSON-able dict is captured with every snapshot and handed back on restore."""
        self._client_get, self._client_set = get, set

    def _client_state(self) -> dict[str, Any]:
        out = dict(self._client_get()) if self._client_get else {}
        pos = self.loaders.position()
        if pos is not None:
            out[data_position.KEY] = pos
        out.update(self._internal_client_state())
        out.update(self.canary.client_state())
        return out

    def _restore_client_state(self, state: dict[str, Any]) -> None:
        self.loaders.restore(state.get(data_position.KEY))
        self.canary.restored(state)
        internal = {*self._restore_internal_client_state(state), data_position.KEY, CANARY_KEY}
        if self._client_set:
            self._client_set({k: v for k, v in state.items() if k not in internal})

    def _internal_client_state(self) -> dict[str, Any]:
        """The subclass's own entries of the client state (keys of its own, never the script's)."""
        return {}

    def _restore_internal_client_state(self, state: dict[str, Any]) -> set[str]:
        """Take the subclass's own entries back from a restored client state; returns their keys."""
        return set()

    # -- the step -------------------------------------------------------------------------------------
    def stoppable(self) -> contextlib.AbstractContextManager[None]:
        """Context for the framework's own forward/backward and optimizer step: under deadpool-run, the
        launcher's notice of a new generation stops them (``rebuild.notice``); the hot-swap throws that
        step away. Outside deadpool-run (or with hot-swap off) it does nothing."""
        return notice.stoppable(True) if self._hot_swap else contextlib.nullcontext()

    def wait_for_copy(self) -> None:
        """Block until the in-flight snapshot copy is done (before anything writes the state in place)."""
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()

    def _before_optimizer_step(self) -> None:
        self.wait_for_copy()

    def _after_optimizer_step(self) -> None:
        if self.snapshots is not None:
            self._before_first_snapshot()
            self.snapshots.after_step()
        self._after_snapshot()

    def _after_snapshot(self) -> None:
        """After the step's snapshot was scheduled (and anything the subclass runs after it): the catch-up
        accounting of a recovery and the ``after_step`` hook point."""
        from .. import hooks

        step = self.step_counter()
        progress.note_step(step)
        if protocol.caught_up(self._catch_up, step, self.rank, self._restored_version):
            self._catch_up = None
            if self._trim_at_catch_up:
                self._trim_at_catch_up = False
                self._release_after_recovery("after catching up")
        self.canary.after_step(self, step)  # after a restore: the step checked (a failure raises CanaryRollback)
        hooks.fire(hooks.AFTER_STEP, step=step, rank=self.rank, state=self.adapter)

    @property
    def _resume_called(self) -> bool:
        """A restore path ran in this process (``resume()``, or a framework's load routed to memory)."""
        return self._resumed

    @_resume_called.setter
    def _resume_called(self, value: bool) -> None:
        if value and not getattr(self, "_resumed", False) and self.config.recovery.restore_on_start:
            ResilientRuntime.restoring_total += 1
        self._resumed = value

    def _before_first_snapshot(self) -> None:
        """Every step hook calls this right before ``snapshots.after_step()`` (cheap after the first)."""
        if not self._first_snapshot_seen:
            self._first_snapshot_seen = True
            self._say_if_never_restored()
            self._say_if_position_unsure()

    def _say_if_position_unsure(self) -> None:
        """At the first snapshot: what of the data position a restore could not put back (``loaders.py``), once for
        the job; not where the script keeps a client state of its own (its position, presumably)."""
        if self.rank != 0 or self.snapshots is None or self._client_get is not None:
            return
        lines = self.loaders.unsure_lines(steps_done=self.step_counter())
        for line in lines:
            log.warning("%s", line)
        if lines:
            write_event(event="position_unsure", rank=self.rank, lines=len(lines))

    def _say_if_never_restored(self) -> None:
        """At the first snapshot, before it is written: a process that never called :meth:`resume` would not
        restore after a restart either; say so once, with the fix, and name the snapshots of an earlier attempt
        this run left unused (its own slots, headers only: no collective)."""
        if (self._resume_called or not self.config.recovery.restore_on_start or self.snapshots is None
                or self.rank != 0):  # once for the job: every rank runs the same script
            return
        local: list[int] = []
        with contextlib.suppress(Exception):  # a diagnosis: never the reason a step fails
            report, _, _ = self.snapshots._scan(verify=False)
            local = sorted(report.local)
        for line in never_restored_lines(self.step_name, local):
            log.warning("%s", line)
        write_event(event="never_restores", rank=self.rank, unused_versions=local)

    # -- resume ---------------------------------------------------------------------------------------
    @property
    def resume_called(self) -> bool:
        """The script (or a framework for it) asked for a restore: :meth:`resume`, or a ``load_checkpoint`` served
        from memory."""
        return self._resume_called

    @property
    def restored_version(self) -> int:
        """The version the last restore from memory gave (0: none)."""
        return self._restored_version

    def resume(self, newer_than: int | None = None) -> int:
        """Restore from the memory tiers if this job has snapshots there; return the step to continue from.

        ``newer_than``: the step of a base already loaded from tier 3 (``--load``): memory is used only for a
        newer version, and a memory state no version of which every rank can rebuild falls back to that base
        (logged) instead of failing the job. The data position of the script's own loaders comes back with it
        (``loaders.py``)."""
        step = self._resume(newer_than)
        if self._restored_version:
            n = self.loaders.apply_restored()
            if n and self.rank == 0:
                log.info("data position: the next iterator of %d loader(s) continues where the restored step left "
                         "it", n)
        return step

    def _resume(self, newer_than: int | None = None) -> int:
        """The restore itself: :meth:`resume` for the script, and a recovery's restore (a survivor's loaders are
        where they are: no data position applied)."""
        self._resume_called = True
        self.join_survivors()  # a spare built solo: its own step first (a no-op otherwise)
        if self.snapshots is None or not (self.config.recovery.restore_on_start or context().in_hot_swap):
            return self.step_counter()
        t0 = time.perf_counter()
        extra = self._timeline_fields()
        version, self._spare_logged = protocol.restore_from_memory(self.snapshots, self.rank, self._spare_logged,
                                                                   newer_than=newer_than, **extra)
        self._restored_version = version or 0
        if version is None:
            return self.step_counter()
        if context().in_hot_swap:
            self._restored_in_hot_swap()
        from .. import hooks

        hooks.fire(hooks.AFTER_RESTORE, generation=context().generation, rank=self.rank, version=version,
                   state=self.adapter)
        self.canary.arm(self, version)
        log.info("resumed from in-memory snapshot of %s %d in %.2f s%s", self.step_name, version,
                 time.perf_counter() - t0, "".join(f", {k} {v}" for k, v in extra.items()))
        return version

    # -- hot-swap -------------------------------------------------------------------------------------
    @property
    def in_place(self) -> bool:
        """Whether a recovery keeps this runtime and its framework objects (the in-place swap applies)."""
        return self._in_place

    def join_survivors(self) -> None:
        """A spare that took a failed node's place, its engine built solo, joins the survivors' communicators and
        its snapshot placement is redone: collective for collective what the survivors' in-place recovery does
        before its restore (``Recovery.join_survivors``). :meth:`resume` runs it first; a no-op in any other
        process."""
        from ..rebuild import worker

        if worker.pending_live() is not None:
            driver().join_survivors(self._rewire_snapshots, self.config.hot_swap)

    def _rewire_snapshots(self) -> None:
        if self.snapshots is not None:
            self.snapshots.rewire(placement_for(self.config, worker_env()))

    def set_rebuild(self, factory: Callable[[], Any]) -> None:
        """``factory()`` rebuilds on the current world and returns the loop's handle (see the call order)."""
        self._factory = factory

    def recovery_mode(self, *, same_objects: bool = False) -> Mode:
        """How a failure would be recovered now (``rebuild/cause.py``): IN_PLACE, REBUILD, or RESTART_RESTORE (none
        in-process). ``same_objects``: the caller continues with the objects it holds (no rebuilt handle)."""
        return recovery_mode(hot_swap=self._hot_swap, in_place=self._in_place, has_factory=self._factory is not None,
                             same_objects=same_objects)

    def handle_failure(self, exc: BaseException, *, same_objects: bool = False) -> Any | None:
        """THE failure path of every training loop (``ResilientLoop``, ``resilient_steps``, the HF Trainer,
        Lightning, Megatron-Core): recover in-process when the failure's cause is a lost peer (the launcher ended
        the generation the step ran in; never decided by the exception's type: ``rebuild/cause.py``) and return the
        handle to continue with (the same engine after an in-place swap, the factory's after a rebuild; never
        None), or None: the caller raises ``exc`` unchanged. ``same_objects``: the caller cannot take new objects
        (Lightning, the HF Trainer, ``resilient_steps``): only an in-place swap applies. After a rebuild this
        runtime is closed; the handle belongs to the new world. A restored version that failed the numerical canary
        (:class:`CanaryRollback`) is rolled back here: the next older version restored, the same handle returned."""
        if isinstance(exc, CanaryRollback):
            self.canary.roll_back(self, exc)
            return self._handle()
        return driver().handle_failure(exc, RuntimeHooks(self), self.config.hot_swap,
                                       self.recovery_mode(same_objects=same_objects))

    def _release_after_recovery(self, when: str) -> None:
        """Collect what the interrupted step left and give the C heap's free memory back (``hot_swap.release_memory``).
        Done twice per in-place recovery: right after it, and once the redone step is complete, because part of the
        interrupted step (its autograd graph, held from C++) is freed only when the redone step runs."""
        gc.collect()
        if self.config.hot_swap.release_memory:
            release_free_heap()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s", when, memory_census())

    def _expect_catch_up(self, step: int, since: float) -> None:
        """Write the ``caught_up`` timeline event once ``step`` is completed again (after a recovery)."""
        self._catch_up = (step, since)

    # -- misc -----------------------------------------------------------------------------------------
    def settle_rng(self) -> None:
        """After a restore: set the restored RNG now rather than right before the framework's next forward (where
        the adapter sets it by default); for callers that draw from it before that forward exactly as the
        uninterrupted run did after the snapshot. A no-op for adapters without a deferred RNG."""
        settle = getattr(self.adapter, "settle_rng", None)
        if callable(settle):
            settle()

    def drain(self) -> None:
        """Wait (bounded) for the snapshot in flight; its failure is raised (a recoverable one, when a peer was
        lost during it). The loop calls this once its last step is done."""
        if self.snapshots is not None:
            with self.stoppable():
                self.snapshots.wait_idle()

    def mark_trained(self) -> None:
        """The loop's last step is done and its snapshot drained (:meth:`drain`): under deadpool-run, the launcher
        learns it (``trained/``), so that a node lost from here on (a closing barrier, a final save) does not fail
        a job whose work is done (``launcher/decide.py`` ``work_done``)."""
        m = context().membership
        if m is None or m.assignment is None:
            return
        step = self.step_counter()
        committed = self.snapshots.committed_version if self.snapshots is not None else None
        m.mark_trained(step, committed)
        write_event(event="trained", rank=self.rank, generation=m.generation, step=step, committed=committed)

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
        self._close()
        if self.snapshots is not None:
            self.snapshots.close()


class RuntimeHooks:
    """The recovery driver's named hooks for one runtime (``rebuild/recover.py`` ``RecoveryHooks``: their call
    order): each is this runtime's own step of a recovery, or the subclass hook behind it."""

    def __init__(self, runtime: ResilientRuntime) -> None:
        self.runtime = runtime
        self.rank = runtime.rank
        self.what_recovers = runtime.what_recovers

    def step_counter(self) -> int:
        return self.runtime.step_counter()

    def has_factory(self) -> bool:
        return self.runtime._factory is not None

    def stop_snapshots(self, timeout_s: float) -> None:
        if self.runtime.snapshots is not None:
            self.runtime.snapshots.stop_worker(timeout_s)

    def quiesce_snapshots(self) -> bool:
        snapshots = self.runtime.snapshots
        if snapshots is None:
            return False
        snapshots.quiesce()
        return (snapshots.committed_version or 0) > 0

    def abandon_step(self) -> None:
        self.runtime._abandon_step()

    def release(self) -> None:
        rt = self.runtime
        rt._closed = True
        rt.adapter = None
        rt._release()

    def release_partial(self) -> None:
        self.runtime._release_partial()

    def rebuild(self) -> Any:
        factory = self.runtime._factory
        if factory is None:
            raise RuntimeError("a rebuild needs set_rebuild(factory) first")
        return self.runtime._rebuild(factory)

    def rewire_snapshots(self) -> None:
        self.runtime._rewire_snapshots()

    def restore(self, handle: Any) -> int | None:
        # A survivor's loaders are where its loop left them; a rebuilt world's runtime is new: its script's
        # loaders continue in this process too.
        return (self.runtime if handle is None else self.runtime._runtime_of(handle))._resume()

    def resize_refusal(self, old: Any, new: Any) -> str | None:
        return self.runtime._resize_refusal(old, new)

    def recovered(self, handle: Any, mode: Mode, failed_step: int, restored_at: float) -> Any:
        # Caught up once the step that was in flight when the failure hit (failed_step + 1) is done again.
        if handle is None:  # in place: this runtime and its engine go on
            rt = self.runtime
            rt._expect_catch_up(failed_step + 1, restored_at)
            # What the interrupted step left in reference cycles (an exception's traceback holds its frames, and
            # with them activations and autograd graphs) is freed now, not at some later collection in training.
            rt._release_after_recovery("after the in-place recovery")
            rt._trim_at_catch_up = True
            return rt._handle()
        self.runtime._runtime_of(handle)._expect_catch_up(failed_step + 1, restored_at)
        return handle


H = TypeVar("H")
R = TypeVar("R")


class ResilientLoop(Generic[H, R]):
    """Run steps until done; a failure the runtime recovers (the launcher ended the generation) is recovered
    in-process and the step redone on the new world. ``handle`` is whatever the loop holds between steps (a DeepSpeed
    engine, a Megatron runtime); ``runtime(h)`` its :class:`ResilientRuntime` (or None: no recovery); ``step(h)``
    runs one optimizer step and returns what the loop body needs. Any exception the runtime does not recover
    propagates unchanged."""

    def __init__(self, handle: H, *, runtime: Callable[[H], ResilientRuntime | None], done: Callable[[H], bool],
                 step: Callable[[H], R], after_swap: Callable[[H], None] | None = None) -> None:
        self.handle = handle
        self.swaps = 0
        self._runtime, self._done, self._step, self._after_swap = runtime, done, step, after_swap

    def __iter__(self) -> Iterator[tuple[H, R]]:
        first = self._runtime(self.handle)
        if first is not None:
            first.loop_owner = "ResilientLoop"
        while True:
            try:
                if self._done(self.handle):
                    # The last step's snapshot is drained here, inside the recovery scope: a peer lost while it
                    # was replicated or committed is a failure like any other (recovered, the step redone if
                    # the restored version is older), not an error at the end of a finished loop.
                    rt = self._runtime(self.handle)
                    if rt is not None:
                        rt.drain()
                        rt.mark_trained()
                    return
                out = self._step(self.handle)
            except Exception as exc:
                rt = self._runtime(self.handle)
                handle = rt.handle_failure(exc) if rt is not None else None
                if handle is None:
                    raise
                self.handle = handle
                rebuilt = self._runtime(handle)
                if rebuilt is not None:
                    rebuilt.loop_owner = "ResilientLoop"
                self.swaps += 1
                if self._after_swap is not None:
                    self._after_swap(self.handle)
                continue
            yield self.handle, out
