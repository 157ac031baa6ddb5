"""Rate control of the tier-3 background writer, so the foreground training step never stalls.

Two limits combine; the writer calls :meth:`Throttle.pace` after every chunk and sleeps as long as it says:

- a fixed cap (``persist.max_mb_s``), a token bucket: after ``n`` bytes the writer may not be ahead of
  ``n / cap`` seconds since it started;
- an adaptive rate (``persist.adaptive``), additive-increase / multiplicative-decrease on the foreground step
  time. The training thread reports every step (:meth:`observe_step`); steps taken while the writer is idle
  form the baseline (median of a sliding window), steps taken while it writes are compared with it. A step
  more than ``tolerance`` slower than the baseline halves the rate; a step within it raises the rate by a
  quarter, up to the cap. Why AIMD: on shared hosts (CPU contention, a shared NIC or disk) the writer cannot
  know the available bandwidth in advance, and halving quickly while probing slowly is the classic way to
  converge without oscillating into the foreground's share.

Pure logic with an injectable clock and sleep, unit-tested without threads (tests/unit/test_persist_throttle.py).
"""
from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable

MiB = 1 << 20


class Throttle:
    """Call order: training thread ``observe_step(dt)`` once per optimizer step (any time); writer thread
    ``begin()`` before a base, ``pace(nbytes)`` after each chunk, ``end()`` after it."""

    def __init__(self, max_mb_s: float = 0.0, adaptive: bool = True, *, tolerance: float = 0.10,
                 window: int = 16, min_mb_s: float = 4.0, start_mb_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cap = max_mb_s * MiB if max_mb_s > 0 else float("inf")
        self.adaptive = adaptive
        self.tolerance = tolerance
        self.min_rate = min(min_mb_s * MiB, self.cap)
        # Unknown bandwidth at first: start at the cap (or unlimited) and let the feedback cut it.
        self.rate = min(self.cap, start_mb_s * MiB) if start_mb_s else self.cap
        self._idle: collections.deque[float] = collections.deque(maxlen=window)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._writing = False
        self._touched = False
        self._t0 = 0.0
        self._sent = 0.0
        self._next = 0.0
        self.slow_steps = 0
        self.slept_s = 0.0

    # -- training thread ------------------------------------------------------------------------------
    @property
    def baseline(self) -> float | None:
        with self._lock:
            return statistics.median(self._idle) if len(self._idle) >= 3 else None

    def observe_step(self, dt: float) -> None:
        """A foreground step took ``dt`` seconds (measured by the caller, boundary to boundary)."""
        base = self.baseline
        with self._lock:
            # A base often takes less than one step: a step counts as "with the writer" if the writer was
            # active at any time during it, not only at the moment the step ends.
            overlapped = self._writing or self._touched
            self._touched = False
            if not overlapped:
                self._idle.append(dt)
                return
            if not self.adaptive or base is None:
                return
            if dt > base * (1.0 + self.tolerance):
                self.slow_steps += 1
                finite = self.rate if self.rate != float("inf") else self._measured_rate()
                self.rate = max(self.min_rate, finite / 2.0)
            elif self.rate != float("inf"):
                self.rate = min(self.cap, self.rate * 1.25)

    # -- writer thread --------------------------------------------------------------------------------
    def begin(self) -> None:
        with self._lock:
            self._writing = True
            self._touched = True
            self._t0 = self._clock()
            self._next = self._t0
            self._sent = 0.0

    def end(self) -> None:
        with self._lock:
            self._writing = False

    def _measured_rate(self) -> float:
        elapsed = max(self._clock() - self._t0, 1e-3)
        return max(self._sent / elapsed, self.min_rate)

    def pace(self, nbytes: int) -> float:
        """Account ``nbytes`` just written; sleep until the current rate allows more. Returns seconds slept.

        Each chunk books ``nbytes / rate`` seconds after the previous booking (a token bucket without burst),
        so a rate cut or raised mid-base applies from the next chunk on instead of being averaged over the
        whole base."""
        with self._lock:
            self._sent += nbytes
            rate = self.rate
            if rate == float("inf"):
                return 0.0
            now = self._clock()
            self._next = max(self._next, now - 0.05) + nbytes / rate
            wait = self._next - now
        if wait <= 0:
            return 0.0
        self._sleep(wait)
        self.slept_s += wait
        return wait

    def stats(self) -> dict[str, float | int | None]:
        return {"rate_mb_s": None if self.rate == float("inf") else self.rate / MiB, "slow_steps": self.slow_steps,
                "slept_s": self.slept_s, "baseline_step_s": self.baseline}
