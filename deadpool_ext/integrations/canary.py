"""The numerical canary after every restore, on a runtime (the decisions are ``recovery/canary.py``'s).

What it does, in the runtime's call order (every rank, main thread):

1. every step: the loss the framework's backward got (:meth:`CanaryWatch.observe_loss`; DeepSpeed's
   ``engine.backward`` is watched by :meth:`CanaryWatch.watch_engine`) and the gradient norm after the optimizer
   step are learned into :class:`~deadpool_ext.recovery.canary.Bounds`, read as numbers lazily (at a snapshot,
   whose client state carries them as JSON under ``recovery.canary.KEY``, or at a check);
2. after a restore (``ResilientRuntime._resume``: a restart, an in-place hot-swap, a rebuild, a rollback), the
   restored version's bounds are armed for ``canary.steps`` steps. After a restart's restore, snapshots and tier-3
   bases are held meanwhile, so a poisoned version never overwrites the older one a rollback needs. After a
   hot-swap they go on: the new placement's replicas come first (a second node lost inside the window would find
   no copy of the restored version on the replaced node's peers), so a failed check there falls back only where an
   older version is still in memory, and otherwise stops the job;
3. each checked step: every rank judges its own values, then all ranks agree (one all-reduce MAX on the snapshot
   side group): a failure anywhere raises :class:`CanaryRollback` out of the step on every rank;
4. the loop hands it to ``runtime.handle_failure`` (as any failure), which calls :meth:`CanaryWatch.roll_back`:
   the version is quarantined (every rank marks the copies it holds: ``snapshot/quarantine.py``; rank 0 marks the
   tier-3 base of that step: ``persist/layout.py``), one log line, a ``canary_rollback`` timeline event, and the
   runtime restores again: the newest version left, which is older. The crash-loop guard stops the job
   (exit status ``CANARY_EXIT``) after ``canary.max_rollbacks`` quarantined versions, or when nothing older is left.

A plain DeepSpeed loop whose failures no loop catches gets the :class:`CanaryRollback` out of ``engine.step()``:
the job stops there (its restart restores the older version: the failed one is quarantined first).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import CanaryConfig
from ..recovery import canary as rules
from ..recovery.timeline import write_event

if TYPE_CHECKING:
    from .base import ResilientRuntime

log = logging.getLogger("deadpool_ext")

__all__ = ["CanaryRollback", "CanaryStop", "CanaryWatch"]


class CanaryRollback(RuntimeError):
    """A restored version failed the canary on every rank's agreement; the loop hands it to ``handle_failure``."""

    def __init__(self, version: int, step: int, why: str) -> None:
        super().__init__(f"step {step} after the restore of step {version} failed the numerical canary: {why}")
        self.version, self.step, self.why = version, step, why


class CanaryStop(SystemExit):
    """The crash-loop guard: the process ends with ``CANARY_EXIT`` (the line was logged)."""

    def __init__(self, line: str) -> None:
        super().__init__(rules.CANARY_EXIT)
        self.line = line


class CanaryWatch:
    """One runtime's canary: bounds learned, the check armed after a restore, the rollback."""

    def __init__(self, config: CanaryConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.bounds = rules.Bounds()
        self._losses: list[Any] = []  # this step's micro-batch losses (detached tensors or numbers)
        self._pending: list[tuple[Any, Any]] = []  # (loss, grad norm) of steps not read as numbers yet
        self.grad_norm: Callable[[], Any] | None = None
        self.armed: tuple[int, int, rules.Bounds] | None = None
        """(restored version, steps still to check, its bounds) while checking."""
        self.checked = 0
        self._held = False
        self.device: Any = None
        """Where the agreement's flag lives (the engine's device; None: nothing watched, no agreement)."""
        self._first_failed = 0
        self.quarantined: tuple[int, ...] = ()

    # -- what the framework hands in -----------------------------------------------------------------
    def watch_engine(self, engine: Any) -> None:
        """DeepSpeed: the loss handed to ``engine.backward`` and ``engine.get_global_grad_norm()`` after a step."""
        if not self.config.enabled:
            return
        backward = engine.backward

        def watched(loss: Any, *args: Any, **kwargs: Any) -> Any:
            self.observe_loss(loss)
            return backward(loss, *args, **kwargs)

        engine.backward = watched
        self.grad_norm = getattr(engine, "get_global_grad_norm", None)
        self.device = engine.device

    def observe_loss(self, loss: Any) -> None:
        """A micro-batch's loss (a tensor or a number); a step's loss is the mean of its micro-batches'."""
        if self.config.enabled:
            detach = getattr(loss, "detach", None)
            self._losses.append(detach() if callable(detach) else loss)

    # -- every step ----------------------------------------------------------------------------------
    def holds(self) -> bool:
        """Snapshots and tier-3 bases are held: the version restored at a restart is being checked."""
        return self.armed is not None and self._held

    def after_step(self, runtime: ResilientRuntime, step: int) -> None:
        """After each optimizer step and its snapshot hook: learn the step's values, or check them (collective on
        every rank while armed; raises :class:`CanaryRollback` on every rank when any rank's check failed)."""
        if not self.config.enabled:
            return
        losses, self._losses = self._losses, []
        norm = self.grad_norm() if self.grad_norm is not None else None
        loss = _mean(losses)
        if self.armed is None:
            self._pending = [*self._pending, (loss, norm)][-self.config.window:]
            return
        version, left, bounds = self.armed
        loss_f, norm_f = _number(loss), _number(norm)
        verdict = rules.judge(bounds, loss_f, norm_f, self.config.factor)
        why = self._agree(runtime, verdict)
        self.checked += 1
        if why is not None:
            self.armed = None
            if self._held:
                self._hold(runtime, False)
            write_event(event="canary_failed", rank=self.rank, version=version, step=step, why=why)
            raise CanaryRollback(version, step, why)
        self.bounds = rules.learn(self.bounds, loss_f, norm_f, self.config.window)
        if left > 1:
            self.armed = (version, left - 1, bounds)
            return
        self.armed = None
        if self._held:
            self._hold(runtime, False)
        if self.rank == 0:
            log.info("numerical canary: the %d step(s) after the restore of step %d are within %g x their recent "
                     "values; snapshots go on", self.config.steps, version, self.config.factor)
        write_event(event="canary_passed", rank=self.rank, version=version, step=step)

    def _agree(self, runtime: ResilientRuntime, verdict: rules.Verdict) -> str | None:
        """Every rank's verdict, agreed (one all-reduce MIN on the training's default group, on the engine's device:
        never the snapshot side group, whose collectives the writer thread issues meanwhile): None when every rank
        passed, else why (the lowest failing rank's own reason there, its rank elsewhere)."""
        import torch.distributed as dist

        self._first_failed = 0
        if self.device is None or not dist.is_initialized():  # nothing watched (on every rank alike): local only
            return None if verdict.ok else verdict.why
        import torch

        world = dist.get_world_size()
        flag = torch.tensor([world if verdict.ok else self.rank], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag.item())
        if first >= world:
            return None
        self._first_failed = first
        return f"rank {self.rank}: {verdict.why}" if first == self.rank else f"rank {first}'s check failed"

    # -- what travels with each snapshot -------------------------------------------------------------
    def client_state(self) -> dict[str, Any]:
        """The bounds as of the newest step learned (JSON), for the snapshot's client state."""
        if not self.config.enabled:
            return {}
        for loss, norm in self._pending:
            self.bounds = rules.learn(self.bounds, _number(loss), _number(norm), self.config.window)
        self._pending = []
        return {rules.KEY: self.bounds.to_json()}

    def restored(self, state: dict[str, Any]) -> None:
        """A restore put a version's client state back: its bounds are this run's from now on."""
        self.bounds = rules.Bounds.from_json(state.get(rules.KEY)) or rules.Bounds()
        self._pending, self._losses = [], []

    # -- after a restore -----------------------------------------------------------------------------
    def arm(self, runtime: ResilientRuntime, version: int) -> None:
        """Check the ``canary.steps`` steps after the restore of ``version``; hold snapshots and tier 3 meanwhile."""
        if not self.config.enabled:
            return
        snapshots = runtime.snapshots
        if snapshots is not None and not self.quarantined:
            from ..snapshot.quarantine import read_record

            self.quarantined = read_record(snapshots.store.dir, snapshots.job_id, self.rank)
        from ..rebuild.context import context

        self.armed = (version, self.config.steps, self.bounds)
        self._held = not context().in_hot_swap  # a hot-swap's new placement gets its replicas at once
        if self._held:
            self._hold(runtime, True)
        write_event(event="canary_armed", rank=self.rank, version=version, steps=self.config.steps,
                    recent_losses=len(self.bounds.losses), recent_grad_norms=len(self.bounds.grad_norms))

    def _hold(self, runtime: ResilientRuntime, hold: bool) -> None:
        if runtime.snapshots is not None:
            runtime.snapshots.active = not hold
        persist = getattr(runtime, "persist", None)  # a runtime's tier-3 persister, where it has one
        if persist is not None and hasattr(persist, "enabled_steps"):
            persist.enabled_steps = not hold

    def roll_back(self, runtime: ResilientRuntime, exc: CanaryRollback) -> int:
        """Quarantine the failed version in every tier this rank holds, then restore the newest version left (every
        rank at once: the verdict was agreed); returns that version. Raises :class:`CanaryStop` when the crash-loop
        guard or a missing older version stops the job."""
        snapshots = runtime.snapshots
        assert snapshots is not None, "a canary failure needs a restore from memory before it"
        decision = rules.after_failure(exc.version, self.quarantined, self.config.max_rollbacks, exc.why, exc.step)
        self.quarantined = tuple(sorted({*self.quarantined, exc.version}))
        marked = self._quarantine(runtime, exc.version)
        if isinstance(decision, rules.Stop):
            self._stop(runtime, exc, decision.line, marked)
        from ..snapshot.plan import RecoveryError

        try:
            version = runtime._resume()
        except RecoveryError:  # nothing every rank can obtain is left: the same on every rank
            version = exc.version
        if not runtime.restored_version or version >= exc.version:
            self._stop(runtime, exc, rules.no_older_line(exc.version, exc.step, exc.why), marked)
        if self.rank == self._first_failed:  # the line where the reason is known
            log.warning("numerical canary: step %d after the restore of step %d failed (%s); step %d quarantined in "
                        "every tier, step %d restored instead (%d of canary.max_rollbacks %d)", exc.step, exc.version,
                        exc.why, exc.version, version, len(self.quarantined), self.config.max_rollbacks)
        write_event(event="canary_rollback", rank=self.rank, version=exc.version, step=exc.step, why=exc.why,
                    restored_version=version, quarantined=list(self.quarantined), marked=len(marked))
        return version

    def _quarantine(self, runtime: ResilientRuntime, version: int) -> list[str]:
        snapshots = runtime.snapshots
        assert snapshots is not None
        from ..snapshot.quarantine import mark_bad, write_record

        # A snapshot taken after the restore (not held: a hot-swap) is sealed before the marks; one waiting for a
        # framework's post after its step (snapshot/late.py) never gets it: the step failed.
        if snapshots.late is not None:
            snapshots.late.drop()
        try:
            snapshots.wait_idle()
        except Exception as exc:  # that snapshot failed: nothing of it is sealed, nothing to mark
            log.debug("numerical canary: the snapshot in flight at the rollback failed: %s", exc)
        marked = mark_bad(snapshots.store.dir, snapshots.job_id, self.rank, version)
        write_record(snapshots.store.dir, snapshots.job_id, self.rank, self.quarantined)
        persist = getattr(runtime, "persist", None)
        storage = getattr(persist, "storage", None)
        if storage is not None and self.rank == 0:
            from ..persist.layout import quarantine_base

            marked += [f"tier 3 step {v}" for v in quarantine_base(storage, version, why="numerical canary")]
        return marked

    def _stop(self, runtime: ResilientRuntime, exc: CanaryRollback, line: str, marked: list[str]) -> None:
        from ..rebuild.context import context

        if self.rank == self._first_failed:
            log.error("%s", line)
        write_event(event="canary_stop", rank=self.rank, version=exc.version, step=exc.step, why=exc.why,
                    quarantined=list(self.quarantined), marked=len(marked), exit_status=rules.CANARY_EXIT)
        m = context().membership
        if m is not None:
            m.report_fatal(line)
        raise CanaryStop(line) from None


def _mean(values: list[Any]) -> Any:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total / len(values)


def _number(value: Any) -> float | None:
    """A loss or norm as a float (a tensor read here: one synchronisation per snapshot, not per step); None
    stays None."""
    if value is None:
        return None
    item = getattr(value, "item", None)
    try:
        out = float(item()) if callable(item) else float(value)
    except (TypeError, ValueError):
        return None
    return out
