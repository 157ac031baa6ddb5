"""``deadpool-run --metrics-port PORT [--metrics-addr ADDR]``: the goodput ledger served to Prometheus.

The launcher serves ``/metrics`` (``prometheus_client``'s WSGI server, in a daemon thread, on its own registry) on
``--metrics-addr`` only: by default the address the launcher's stores listen on (``--host``: loopback on one host).
Each scrape reads what the job's timeline gained since the last one (:class:`TimelineTail`: whole lines only; a
line that is not a JSON object is skipped and counted) and computes the ledger of every event so far
(``recovery/ledger.py``, the same function ``deadpool timeline`` prints): there is no second accounting, and
nothing is computed between scrapes.

Without ``--timeline`` the launcher keeps one in a private directory for the metrics (``private_timeline``).
On many hosts each launcher serves its own host's timeline: the coordinator's (host 0's, normally) holds the
job's start, failures and assignments, so that is the one whose ledger is the job's (docs/operations.md).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..recovery.ledger import CAUSES, FAILURE_CAUSES, PACE, SNAPSHOT, TIERS, Ledger, ledger

log = logging.getLogger("deadpool_ext.launcher")

READ_LIMIT = 64 << 20
"""Most bytes of the timeline one scrape reads (the rest at the next): a scrape answers in bounded time."""
LINE_LIMIT = 1 << 20
"""A timeline line longer than this is skipped unparsed (no event is near it)."""
RECOVERY_CAUSES = tuple(dict.fromkeys([label for _, label in FAILURE_CAUSES] + ["other"]))
"""Every recovery cause label, each served from zero (so that ``increase()`` sees the first recovery)."""


class TimelineTail:
    """The events of a timeline file as it grows. A scrape may come while a process writes a line: only whole
    lines are taken, the rest waits. Every event is kept but ``snapshot`` ones (newest per rank, plus the
    first) and ``pace`` ones (the newest), so memory follows the job's failures, not its length."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.events: list[dict[str, Any]] = []
        self.snapshots: dict[Any, dict[str, Any]] = {}
        self.bad_lines = 0
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        """Every event so far (read under a lock: scrapes may come concurrently)."""
        with self._lock:
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(self.offset)
                    chunk = fh.read(READ_LIMIT)
            except FileNotFoundError:
                chunk = b""
            self.offset += len(chunk)
            data = self.partial + chunk
            *lines, self.partial = data.split(b"\n")
            if len(self.partial) > LINE_LIMIT:
                self.partial, self.bad_lines = b"", self.bad_lines + 1
            for line in lines:
                self._take(line)
            return self.events + list(self.snapshots.values())

    def _take(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            event = json.loads(line) if len(line) <= LINE_LIMIT else None
        except ValueError:
            event = None
        if not isinstance(event, dict) or not isinstance(event.get("time", 0), (int, float)):
            self.bad_lines += 1
            return
        if event.get("event") == SNAPSHOT:
            self.snapshots[event.get("rank")] = event
        elif event.get("event") == PACE:   # once per straggler window: only the newest counts
            self.snapshots[PACE] = event
        else:
            self.events.append(event)


def families(led: Ledger, job_id: str, bad_lines: int = 0) -> list[Any]:
    """The ledger as Prometheus metric families (pure; ``prometheus_client``'s metric objects)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

    def gauge(name: str, doc: str, value: float | None, unit: str = "") -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, unit=unit)
        if value is not None:
            g.add_metric([], float(value))
        return g

    out: list[Any] = [InfoMetricFamily("deadpool_job", "the job this launcher serves", value={"job_id": job_id}),
                      gauge("deadpool_goodput_ratio", "productive training seconds over wall seconds", led.goodput),
                      gauge("deadpool_wall_seconds", "seconds since the launcher's start (to the job's end)",
                            led.wall_s),
                      gauge("deadpool_productive_seconds", "wall seconds no failure, recovery, start-up or shutdown "
                                                           "took", led.productive_s),
                      gauge("deadpool_job_ended", "1 once the job finished or stopped", 1.0 if led.ended else 0.0),
                      gauge("deadpool_generation", "the job's generation (one more per recovery)", led.generation)]
    lost = GaugeMetricFamily("deadpool_lost_seconds", "wall seconds lost, by cause (deadpool timeline's phases)",
                             labels=["cause"])
    for cause in CAUSES:
        lost.add_metric([cause], led.lost_s.get(cause, 0.0))
    recoveries = CounterMetricFamily("deadpool_recoveries", "recoveries that caught up, by the failure's cause and "
                                                            "the tier the state came from", labels=["cause", "tier"])
    for cause in RECOVERY_CAUSES:
        for tier in TIERS:
            recoveries.add_metric([cause, tier], led.recoveries.get((cause, tier), 0))
    snap = led.snapshot
    out += [lost, recoveries,
            gauge("deadpool_snapshot_blocking_seconds", "the training thread's wait for the newest in-memory "
                                                        "snapshot (slowest rank)", snap.blocking_s),
            gauge("deadpool_snapshot_bytes", "bytes of the newest snapshot version, every rank's together",
                  snap.nbytes),
            gauge("deadpool_snapshot_commit_lag_seconds", "the newest snapshot's start to its global commit (slowest "
                                                          "rank)", snap.commit_lag_s),
            gauge("deadpool_snapshot_committed_version", "the newest version committed on every rank",
                  snap.committed),
            gauge("deadpool_spares_available", "spare nodes waiting to take a failed node's place",
                  led.spares_available),
            gauge("deadpool_step_seconds", "wall seconds per step over the last straggler window (the median "
                                           "node's)", led.pace.step_s),
            gauge("deadpool_slowest_node_ratio", "the slowest node's busy time per step (outside collectives) over "
                                                 "the other nodes' median, last window (the straggler rule's ratio)",
                  led.pace.slowest_ratio)]
    busy = GaugeMetricFamily("deadpool_busy_seconds", "seconds per step outside collectives over the last straggler "
                                                      "window: the median node's and the slowest node's",
                             labels=["which"])
    for which, value in (("median", led.pace.busy_median_s), ("slowest", led.pace.busy_max_s)):
        if value is not None:
            busy.add_metric([which], value)
    out.append(busy)
    for name, doc, value in (("deadpool_stragglers_named", "ranks named stragglers", led.stragglers_named),
                             ("deadpool_versions_quarantined", "versions the numerical canary quarantined",
                              led.versions_quarantined),
                             ("deadpool_timeline_bad_lines", "timeline lines that were not a JSON event (skipped)",
                              bad_lines)):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], value)
        out.append(c)
    return out


class LedgerCollector:
    """A ``prometheus_client`` collector: each scrape, the ledger of the timeline so far."""

    def __init__(self, tail: TimelineTail, job_id: str, clock: Callable[[], float] = time.time) -> None:
        self.tail, self.job_id, self.clock = tail, job_id, clock

    def collect(self) -> Iterator[Any]:
        events = self.tail.read()
        yield from families(ledger(events, self.clock()), self.job_id, self.tail.bad_lines)


class MetricsServer:
    """The ``/metrics`` endpoint: :meth:`start` before the workers start (a port taken is a start-up error),
    :meth:`close` when the launcher shuts down."""

    def __init__(self, addr: str, port: int, timeline: str, job_id: str) -> None:
        self.addr, self.port, self.timeline, self.job_id = addr, port, timeline, job_id
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen on ``addr:port`` (0: any free port); returns the port."""
        from prometheus_client import CollectorRegistry, start_wsgi_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(LedgerCollector(TimelineTail(self.timeline), self.job_id))
        try:
            self._server, self._thread = start_wsgi_server(self.port, addr=self.addr, registry=registry)
        except OSError as exc:
            raise OSError(f"--metrics-port {self.port}: cannot listen on {self.addr}:{self.port}: "
                          f"{exc.strerror or exc}") from None
        self.port = int(self._server.server_address[1])
        log.info("metrics: the goodput ledger at http://%s/metrics (--metrics-addr %s, --metrics-port %d), from the "
                 "timeline %s", _hostport(self.addr, self.port), self.addr, self.port, self.timeline)
        return self.port

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._server = None


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def private_timeline(job_id: str) -> tuple[str, Callable[[], None]]:
    """A timeline for the metrics when ``--timeline`` was not given: in a new 0700 directory; with the function
    that removes it when the launcher ends."""
    folder = tempfile.mkdtemp(prefix=f"deadpool-{job_id}-")
    return os.path.join(folder, "timeline.jsonl"), lambda: shutil.rmtree(folder, ignore_errors=True)


__all__ = ["LedgerCollector", "MetricsServer", "TimelineTail", "families", "private_timeline"]
