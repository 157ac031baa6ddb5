"""What a launcher does with its workers when its lease lapses (``launcher/leader.py`` calls these on the renewal
thread): pause them, continue them, or stop them for good. A mixin of :class:`deadpool_ext.launcher.cli.Supervisor`,
whose state it uses (``procs``, ``args``, ``event``, the coordinator's heartbeat records)."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ..memory.shm import job_shm_dir

log = logging.getLogger("deadpool_ext.launcher")


class LeaseLapse:
    procs: dict[str, subprocess.Popen[bytes]]
    args: Any
    job_id: str
    local_nodes: set[str]
    seen_hb: dict[str, float]
    progress: dict[str, dict[str, Any]]
    _grace_until: float
    _fence_once: threading.Lock
    event: Callable[..., None]   # the Supervisor's timeline record

    def _signal_workers(self, sig: int) -> int:
        n = 0
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    def _pause(self, why: str) -> None:
        """The lease could not be renewed in time (renewal thread): stop this host's workers from training now
        (SIGSTOP), before the store could expire the lease and another launcher give their ranks to spares."""
        n = self._signal_workers(signal.SIGSTOP)
        self.event(event="paused", host_rank=self.args.host_rank, reason=why, workers=n)
        print(f"deadpool-run: host {self.args.host_rank} cannot reach the store ({why}): its {n} worker(s) are "
              f"paused (SIGSTOP) until it answers again; after --store-outage-s {self.args.store_outage_s:g}s, or "
              f"if the store expired the lease meanwhile, they are stopped for good", file=sys.stderr, flush=True)

    def _resume(self, paused_s: float) -> None:
        """A renewal got through and the lease is intact (e.g. etcd regained quorum): the workers go on; the
        coordinator gives every worker's heartbeat a grace period, since none could reach the store either."""
        self.seen_hb.clear()
        self.progress.clear()
        self._grace_until = time.time() + self.args.detect_timeout_s + self.args.leader_ttl_s
        n = self._signal_workers(signal.SIGCONT)
        self.event(event="resumed", host_rank=self.args.host_rank, paused_s=round(paused_s, 3), workers=n)
        log.warning("host %d: the store answers again after %.1fs; %d worker(s) resumed", self.args.host_rank,
                    paused_s, n)

    def _self_fence(self, why: str) -> NoReturn:
        """Cut off from the store for longer than the lease allows (called on the lease's renewal thread, whatever
        the main loop is blocked in): another launcher is about to give this host's ranks to spares, so its
        workers are stopped now, before the store can expire the lease (no two processes ever train as one
        rank), their memory is dropped and the launcher leaves with code 3."""
        if not self._fence_once.acquire(blocking=False):  # the renewal thread and the main loop both saw it
            time.sleep(60)
            os._exit(3)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", p.pid)
        for node in self.local_nodes:
            shutil.rmtree(job_shm_dir(self.args.shm_root, self.job_id, node), ignore_errors=True)
        msg = (f"host {self.args.host_rank} lost contact with the store: {why}. Its workers were stopped so that "
               f"spares can take their ranks; this launcher leaves (start it again to offer this host as spares)")
        try:
            self.event(event="self_fenced", host_rank=self.args.host_rank, reason=why)
        finally:
            print(f"deadpool-run: {msg}", file=sys.stderr, flush=True)
            os._exit(3)

