"""The coordinator's judgement of heartbeats beyond their age: a stall of the store (every heartbeat stale at once,
the spares' too) and hangs by progress. A mixin of the Supervisor (``launcher/cli.py``); the rules themselves are
pure (``launcher/hangs.py``). Call order, each coordinator turn: heartbeats read (``seen_hb``, ``progress``), then
``_store_stall`` when a heartbeat is stale, then ``_stalled`` unless a grace period runs."""
from __future__ import annotations

import logging
from typing import Any

from . import keys, values
from .hangs import stalled, store_stalled
from .values import StoreReads

log = logging.getLogger("deadpool_ext.launcher")


class HeartbeatWatch(StoreReads):
    args: Any
    store: Any
    workers: list[Any]
    spare_nodes: list[str]
    dead_spares: set[str]
    seen_hb: dict[str, float]
    spare_hb: dict[str, float]
    progress: dict[str, dict[str, Any]]
    _grace_until: float
    _stall_logged: bool
    _all_in_collective_logged: bool

    def _store_stall(self, active: set[str], now: float, any_hung: bool) -> None:
        """Every heartbeat stale at once, the live spares' too: the store took nobody's writes, which is no hang.
        Heartbeat detection waits (a grace as long as the detection timeout after the last such turn), for at most
        --store-outage-s from the oldest heartbeat; logged once per stall."""
        if not any_hung:   # the spares' heartbeats are read only when a worker looks hung (no store reads per turn)
            self._stall_logged = False
            return
        self._spare_beats(active)
        beats = {**{w: self.seen_hb[w] for w in active if w in self.seen_hb}, **self.spare_hb}
        if not store_stalled(beats, now, self.args.detect_timeout_s):
            self._stall_logged = False
            return
        if now - min(beats.values()) > self.args.store_outage_s:
            return
        self._grace_until = max(self._grace_until, now + self.args.detect_timeout_s)
        if not self._stall_logged:
            self._stall_logged = True
            log.warning("coordinator: every heartbeat is %.1fs old or more, the spares' too: the store took no "
                        "worker's writes (not a hang); heartbeat detection waits up to --store-outage-s %.0fs",
                        now - max(beats.values()), self.args.store_outage_s)

    def _spare_beats(self, active: set[str]) -> None:
        """The live spares' last heartbeat times (``spare_hb``): what tells a store stall from hung workers."""
        for w in self.workers:
            wid = w.worker_id
            if w.node not in self.spare_nodes or w.node in self.dead_spares or wid in active:
                self.spare_hb.pop(wid, None)
                continue
            beat = self.values.get(keys.heartbeat(wid), values.heartbeat)
            if beat is not None:
                self.spare_hb[wid] = float(beat["t"])

    def _stalled(self, active: set[str], now: float) -> dict[str, str]:
        """Hangs by progress (``launcher/hangs.py``), logged once when every rank is inside a collective."""
        failed, all_in_collective = stalled(self.progress, active, now, self.args.progress_timeout_s)
        if all_in_collective and not self._all_in_collective_logged:
            self._all_in_collective_logged = True
            log.warning("no rank finished a step for %.0fs and every rank is inside a collective: no rank can be "
                        "singled out; left to the collective timeout", self.args.progress_timeout_s)
        return failed

