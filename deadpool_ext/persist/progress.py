"""A one-line progress indicator on stderr for long CLI work (verify, export); silent when not a terminal
unless forced, so logs and pipes stay clean."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, what: str, *, enabled: bool | None = None, min_interval_s: float = 0.2) -> None:
        self.what = what
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._t0 = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s and done < total:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self._t0, 1e-6) / 1e6
        sys.stderr.write(f"\r{self.what}: {done / 1e6:,.1f}/{total / 1e6:,.1f} MB ({pct:5.1f}%, {rate:,.0f} MB/s)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
