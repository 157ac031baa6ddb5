"""Tier 3: a base checkpoint every ``persist.interval`` steps, persisted in the background (TierCheck).

Call order (every rank, training thread):

1. ``Tier3Persister(engine, cfg, checkpoint_engine=...)`` after ``deepspeed.initialize``. Not collective.
   The DeepSpeed integration creates it when ``persist.url`` is set (``runtime.py``); the pretraining scripts
   when ``--save URL`` is given and the config has no ``deadpool`` section.
2. ``after_step()`` at every optimizer-step boundary. Every ``interval`` steps it is collective: all ranks
   agree whether the previous base is still being written (then this one is skipped on every rank: the
   foreground never waits for tier 3), then call ``engine.save_checkpoint(stage, tag, save_latest=False)``
   with the checkpoint engine in capture mode: DeepSpeed builds its usual state dicts and file names, the
   engine copies them into host memory, and the call returns. The writer thread does the rest
   (:mod:`deadpool_ext.persist.writer`); with a checkpoint key (``key=`` or ``$DEADPOOL_CHECKPOINT_KEY``,
   :mod:`deadpool_ext.persist.sign`) it signs every manifest and the commit record.
3. ``close()`` at the end: waits (bounded by ``timeout_s``) for the base in flight to be published.

The step time the adaptive throttle needs is measured here, boundary to boundary, excluding the capture itself.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ...config import PersistConfig
from ...persist.capture import StagingPool, tensor_bytes
from ...persist.layout import COMMIT, version_tag
from ...persist.sign import checkpoint_key, key_env
from ...persist.storage import open_storage
from ...persist.throttle import Throttle
from ...persist.writer import BaseJob, BaseWriter, CapturedFile
from ...rebuild.context import context
from .checkpoint_engine import DeadpoolCheckpointEngine

log = logging.getLogger("deadpool_ext")

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class Tier3Persister:
    def __init__(self, engine: Any, cfg: PersistConfig, *, checkpoint_engine: Any = None,
                 client_state: Callable[[], dict[str, Any]] | None = None, key: str | bytes | None = None) -> None:
        if not cfg.url:
            raise ValueError("Tier3Persister needs persist.url (or --save URL)")
        self.key = checkpoint_key(key)
        self.engine = engine
        self.cfg = cfg
        self.url = cfg.url
        if checkpoint_engine is None:
            checkpoint_engine = engine.checkpoint_engine
            if not isinstance(checkpoint_engine, DeadpoolCheckpointEngine):
                checkpoint_engine = DeadpoolCheckpointEngine(engine.global_rank, key=self.key)
                engine.checkpoint_engine = checkpoint_engine
        self.ckpt = checkpoint_engine
        self.client_state = client_state
        self.storage = open_storage(cfg.url)
        self.throttle = Throttle(cfg.max_mb_s, cfg.adaptive)
        self.writer = BaseWriter(self.storage, self.throttle, keep_last=cfg.keep_last, key=self.key)
        self.pool = StagingPool()
        self.stage = tempfile.mkdtemp(prefix=f"deadpool-tier3-stage-r{engine.global_rank}-")
        self._last_boundary: float | None = None
        self._closed = False
        self.captures: list[dict[str, Any]] = []
        self.skipped: list[int] = []
        self.waited: list[int] = []
        """Steps whose base waited for the previous one (``persist.when_busy=wait``)."""
        self.enabled_steps = True
        """Benchmarks flip this to take A/B blocks without and with tier 3 in one run."""
        if engine.global_rank == 0:
            log.info("tier 3: base every %s step(s) to %s (keep_last=%d, max_mb_s=%s, adaptive=%s, records %s)",
                     cfg.interval or "no", cfg.url, cfg.keep_last, cfg.max_mb_s or "none", cfg.adaptive,
                     "signed" if self.key is not None else f"unsigned: no {key_env()}")

    # -- training thread --------------------------------------------------------------------------
    def set_client_state(self, fn: Callable[[], dict[str, Any]] | None) -> None:
        """``fn()`` (called on every rank at each base; may be collective) -> DeepSpeed ``client_state``."""
        self.client_state = fn

    def after_step(self) -> bool:
        """Call at every optimizer-step boundary; returns True when a base was captured."""
        now = time.monotonic()
        if self._last_boundary is not None:
            self.throttle.observe_step(now - self._last_boundary)
        self._last_boundary = now
        step = int(self.engine.global_steps)
        if self._closed or not self.enabled_steps or self.cfg.interval <= 0 or step % self.cfg.interval:
            return False
        taken = self.save(step)
        self._last_boundary = time.monotonic()  # the capture is accounted separately, not as a slow step
        return taken

    def save(self, step: int) -> bool:
        """Collective. Capture base ``step`` and hand it to the writer; False if skipped on every rank."""
        if self._closed:
            raise RuntimeError("tier 3: save() after close()")
        t0 = time.perf_counter()
        busy = self._busy_anywhere()
        if busy and self.cfg.when_busy == "wait":
            self.waited.append(step)
            self.writer.wait_idle(self.cfg.timeout_s)
            busy = self._busy_anywhere()
            if self.engine.global_rank == 0:
                log.info("tier 3: base %s waited %.2f s for the previous base (persist.when_busy=wait)%s",
                         version_tag(step), time.perf_counter() - t0,
                         "; still busy after persist.timeout_s, skipping it" if busy else "")
        if busy:
            self.skipped.append(step)
            if self.engine.global_rank == 0:
                log.warning("tier 3: base %s skipped: the previous base is still being written (raise the interval "
                            "or persist.max_mb_s); training does not wait for tier 3", version_tag(step))
            return False
        job = self._capture(step, t0, deadline=time.time() + self.cfg.timeout_s)
        self.writer.submit(job)
        return True

    def drain_save(self, step: int, deadline: float) -> tuple[BaseJob, threading.Event] | None:
        """Collective (every rank, at a drain's step boundary: ``integrations/deepspeed/drain.py``): capture ``step``
        as :meth:`save` does and write it at once through a writer of its own, unthrottled (training has stopped),
        published by ``deadline`` or never. Returns the job and the event its end sets (``job.result``: the writer's
        record; on the coordinator ``published`` and ``verify_s`` once it read back verified); None when a base
        was still being written on some rank (it had the budget until now)."""
        if self._busy_anywhere():
            return None
        job = self._capture(step, time.perf_counter(), deadline=deadline)
        done = threading.Event()
        release = job.on_done
        writer = BaseWriter(self.storage, Throttle(0.0, False), keep_last=self.cfg.keep_last, key=self.key)

        def finished(j: BaseJob) -> None:
            if release is not None:
                release(j)
            done.set()  # the drain's writer thread is left waiting: its process ends next

        job.on_done = finished
        writer.submit(job)
        return job, done

    def _capture(self, step: int, t0: float, *, deadline: float) -> BaseJob:
        """Collective: base ``step`` copied into host buffers through ``save_checkpoint`` (capture mode), as a job for
        a writer (not submitted)."""
        tag = version_tag(step)
        if self.engine.global_rank == 0 and self.storage.exists(tag):
            # A base of this step from an earlier attempt (e.g. a run resumed from an older base): make it
            # invisible before anyone writes into it. DeepSpeed's first barrier orders this before all writes.
            self.storage.remove(f"{tag}/{COMMIT}")
            self.storage.remove_tree(tag)
        client = self.client_state() if self.client_state is not None else {}
        files: list[CapturedFile] = []
        taken: list[torch.Tensor] = []

        def sink(state: Any, path: str) -> None:
            files.append(CapturedFile(os.path.basename(path), self.pool.copy(state, taken), tensor_bytes(state)))

        self.ckpt.begin_capture(sink)
        try:
            self.engine.save_checkpoint(self.stage, tag=tag, client_state=client, save_latest=False)
        finally:
            self.ckpt.end_capture()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the staging copies were issued non-blocking
        capture_s = time.perf_counter() - t0
        root_files = {}
        if self.engine.global_rank == 0:
            for name in RECOVERY_SCRIPTS:
                p = os.path.join(self.stage, name)
                if os.path.exists(p):
                    with open(p, "rb") as fh:
                        root_files[name] = fh.read()
        job = BaseJob(version=step, tag=tag, rank=self.engine.global_rank,
                      world_size=torch.distributed.get_world_size(), coordinator=self.engine.global_rank == 0,
                      files=files, layout=self._layout(), root_files=root_files, deadline=deadline,
                      on_done=lambda done: self._done(done, taken))
        self.captures.append({"version": step, "capture_s": capture_s, "bytes": job.estimate})
        return job

    def _done(self, job: BaseJob, taken: Any) -> None:
        """The writer thread, a base written or abandoned: its host buffers back to the pool; on the coordinating
        rank a base published (and read back verified) is the step the job's heartbeats say is safe on tier 3."""
        self.pool.release(taken)
        if job.coordinator and job.result.get("published") and job.result.get("ok", True):
            progress = context().progress
            progress.tier3 = max(job.version, progress.tier3 or 0)

    def _busy_anywhere(self) -> bool:
        """Collective: is the previous base still being written on any rank?"""
        busy = torch.tensor([1.0 if self.writer.busy else 0.0], device=self.engine.device)
        torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
        return bool(busy.item() > 0)

    def _layout(self) -> dict[str, Any]:
        e = self.engine
        return {"world_size": torch.distributed.get_world_size(), "dp_world_size": int(e.dp_world_size),
                "zero_stage": int(e.zero_optimization_stage()), "global_steps": int(e.global_steps),
                "global_samples": int(e.global_samples)}

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded by ``timeout_s``, default ``persist.timeout_s``) for the base in flight; True when nothing was
        left unwritten. A drained process passes 0: its budget is spent, an unfinished base stays unpublished."""
        if self._closed:
            return True
        self._closed = True
        wait_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        drained = self.writer.close(wait_s)
        if not drained:
            log.error("tier 3: the last base was not written within %s s; it stays unpublished", wait_s)
        shutil.rmtree(self.stage, ignore_errors=True)
        return drained

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "captures": self.captures, "skipped": self.skipped, "waited": self.waited,
                "bases": self.writer.history,
                "throttle": self.throttle.stats(), "staging_bytes": self.pool.allocated_bytes}


def persister_of(engine: Any) -> Tier3Persister | None:
    """The persister attached to ``engine`` (by the DeepSpeed integration or standalone), if any."""
    runtime = getattr(engine, "deadpool", None)
    p = getattr(runtime, "persist", None) if runtime is not None else None
    return p if p is not None else getattr(engine, "deadpool_tier3", None)
