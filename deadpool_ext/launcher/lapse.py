"""What a launcher does with its workers when its lease lapses (``launcher/leader.py`` calls these on the renewal
thread): pause them, continue them, or stop them for good."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .local import LocalNodes

log = logging.getLogger("deadpool_ext.launcher")


class LeaseLapse:
    """The lease's callbacks (``LeaderElection(on_pause=, on_resume=, on_lost=)``) over this host's processes."""

    def __init__(self, nodes: LocalNodes, args: Any, event: Callable[..., None]) -> None:
        self.nodes, self.args, self.event = nodes, args, event
        self._fence_once = threading.Lock()
        self._resumed_grace: float | None = None

    def pause(self, why: str) -> None:
        """The lease could not be renewed in time (renewal thread): stop this host's workers from training now
        (SIGSTOP), before the store could expire the lease and another launcher give their ranks to spares."""
        n = self.nodes.signal_all(signal.SIGSTOP)
        self.event(event="paused", host_rank=self.args.host_rank, reason=why, workers=n)
        print(f"deadpool-run: host {self.args.host_rank} cannot reach the store ({why}): its {n} worker(s) are "
              f"paused (SIGSTOP) until it answers again; after --store-outage-s {self.args.store_outage_s:g}s, or "
              f"if the store expired the lease meanwhile, they are stopped for good", file=sys.stderr, flush=True)

    def resume(self, paused_s: float) -> None:
        """A renewal got through and the lease is intact (e.g. etcd regained quorum): the workers go on; the
        coordinator gives every worker's heartbeat a grace period, since none could reach the store either
        (:meth:`take_resumed`, read at its next turn)."""
        self._resumed_grace = time.time() + self.args.detect_timeout_s + self.args.leader_ttl_s
        n = self.nodes.signal_all(signal.SIGCONT)
        self.event(event="resumed", host_rank=self.args.host_rank, paused_s=round(paused_s, 3), workers=n)
        log.warning("host %d: the store answers again after %.1fs; %d worker(s) resumed", self.args.host_rank,
                    paused_s, n)

    def take_resumed(self) -> float | None:
        """Until when heartbeats get their grace, once after each resume (None: no resume since the last call)."""
        grace, self._resumed_grace = self._resumed_grace, None
        return grace

    def self_fence(self, why: str) -> NoReturn:
        """Cut off from the store for longer than the lease allows (called on the lease's renewal thread, whatever
        the main loop is blocked in): another launcher is about to give this host's ranks to spares, so its
        workers are stopped now, before the store can expire the lease (no two processes ever train as one
        rank), their memory is dropped and the launcher leaves with code 3."""
        if not self._fence_once.acquire(blocking=False):  # the renewal thread and the main loop both saw it
            time.sleep(60)
            os._exit(3)
        self.nodes.kill_all()
        for node in self.nodes.local:
            self.nodes.drop_memory(node, wait=True)   # this launcher leaves at once
        msg = (f"host {self.args.host_rank} lost contact with the store: {why}. Its workers were stopped so that "
               f"spares can take their ranks; this launcher leaves (start it again to offer this host as spares)")
        try:
            self.event(event="self_fenced", host_rank=self.args.host_rank, reason=why)
        finally:
            print(f"deadpool-run: {msg}", file=sys.stderr, flush=True)
            os._exit(3)


__all__ = ["LeaseLapse"]
