"""A campaign's journal: each finished trial, and each layout's fault-free baseline, appended as one JSON line, so a
long campaign runs in pieces (``deadpool chaos --journal FILE``): a later run skips the trials the file already
holds, reuses its baselines, and reports every trial in it.

Call order: ``Journal(path, mode)`` reads the file (a missing file is an empty journal); ``has(scenario)`` before
running a trial; ``baseline(layout, iters)`` before running a baseline, ``add_baseline`` after one; ``add_trial(row)``
after each trial (flushed and fsynced before the next starts); ``rows()`` for the report.

Format, one JSON object per line (JSON only: nothing read from the file can run code)::

    {"kind": "baseline", "mode": "host"|"bed", "layout": str, "iters": int, "metrics": {"1": loss, ...},
     "elapsed_s": float}
    {"kind": "trial", "mode": "host"|"bed", "key": str, "row": {...}}

``key`` is the trial's reproducing command (seed, index, layouts, fault filter: the scenario itself). A trial may
appear more than once: ``replay_failed`` runs a trial whose latest row failed again (after a fix), its new row
supersedes the old one in the report, and the superseded rows are kept and listed (``replaced``). A line that is
not such an object stops the campaign with the file and line named; a torn last line (a campaign killed while
writing it) is dropped with a warning and rewritten by the next trial.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

MODES = ("host", "bed")


class JournalError(ValueError):
    """The journal file is not one this module wrote (named with its line)."""


def _check_metrics(raw: object, where: str) -> dict[int, float]:
    if not isinstance(raw, dict) or not raw:
        raise JournalError(f"{where}: 'metrics' must be a non-empty object of step -> loss")
    out: dict[int, float] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isdigit()) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not math.isfinite(v):
            raise JournalError(f"{where}: 'metrics' entry {k!r}: {v!r} is not step (digits) -> finite loss")
        out[int(k)] = float(v)
    return out


def _check(rec: object, where: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise JournalError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    kind, mode = rec.get("kind"), rec.get("mode")
    if mode not in MODES:
        raise JournalError(f"{where}: 'mode' must be one of {list(MODES)}, got {mode!r}")
    if kind == "baseline":
        if not isinstance(rec.get("layout"), str) or isinstance(rec.get("iters"), bool) \
                or not isinstance(rec.get("iters"), int):
            raise JournalError(f"{where}: a baseline needs 'layout' (string) and 'iters' (integer)")
        rec["metrics"] = _check_metrics(rec.get("metrics"), where)
        return rec
    if kind == "trial":
        row = rec.get("row")
        if not isinstance(rec.get("key"), str) or not isinstance(row, dict) \
                or not isinstance(row.get("scenario"), dict) or not isinstance(row.get("verdict"), dict):
            raise JournalError(f"{where}: a trial needs 'key' (string) and 'row' with 'scenario' and 'verdict'")
        return rec
    raise JournalError(f"{where}: 'kind' must be 'baseline' or 'trial', got {kind!r}")


class Journal:
    def __init__(self, path: str, mode: str, log: Callable[[str], None] = print) -> None:
        if mode not in MODES:
            raise ValueError(f"journal mode must be one of {list(MODES)}, got {mode!r}")
        self.path, self.mode, self.log = path, mode, log
        self.records: list[dict[str, Any]] = []
        if os.path.exists(path):
            self._read()

    def _read(self) -> None:
        with open(self.path, "rb") as fh:
            lines = fh.read().split(b"\n")
        complete, last = lines[:-1], lines[-1]
        if last.strip():   # no newline after it: written when the campaign was killed
            self.log(f"[chaos] journal {self.path}: its last line is torn (a campaign stopped while writing it): "
                     "dropped, that trial runs again")
            with open(self.path, "r+b") as fh:
                fh.truncate(sum(len(x) + 1 for x in complete))
        for n, line in enumerate(complete, 1):
            if not line.strip():
                continue
            where = f"{self.path}:{n}"
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise JournalError(f"{where}: not JSON ({exc})") from None
            self.records.append(_check(rec, where))

    def _mine(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind and r["mode"] == self.mode]

    def has(self, key: str) -> bool:
        return any(r["key"] == key for r in self._mine("trial"))

    def _latest(self) -> dict[str, dict[str, Any]]:
        latest: dict[str, dict[str, Any]] = {}   # in order of first appearance, the last row of each trial
        for r in self._mine("trial"):
            latest[r["key"]] = r["row"]
        return latest

    def failed(self, key: str) -> bool:
        """Whether the trial's latest row failed (``--replay-failed`` runs it again)."""
        row = self._latest().get(key)
        return row is not None and row["verdict"].get("status") == "failed"

    def rows(self) -> list[dict[str, Any]]:
        """One row per trial: its latest (a replay supersedes the row it replays)."""
        return list(self._latest().values())

    def replaced(self) -> list[dict[str, Any]]:
        """The rows a later replay of the same trial superseded (kept in the file and reported as such)."""
        trials = self._mine("trial")
        last = {r["key"]: i for i, r in enumerate(trials)}
        return [r["row"] for i, r in enumerate(trials) if last[r["key"]] != i]

    def baseline(self, layout: str, iters: int) -> dict[str, Any] | None:
        found = [r for r in self._mine("baseline") if r["layout"] == layout and r["iters"] == iters]
        return found[-1] if found else None

    def add_baseline(self, layout: str, iters: int, metrics: dict[int, float], elapsed_s: float) -> None:
        self._append({"kind": "baseline", "mode": self.mode, "layout": layout, "iters": iters,
                      "metrics": {str(k): v for k, v in sorted(metrics.items())}, "elapsed_s": elapsed_s})

    def add_trial(self, key: str, row: dict[str, Any]) -> None:
        self._append({"kind": "trial", "mode": self.mode, "key": key, "row": row})

    def _append(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, sort_keys=True)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        stored = json.loads(line)
        if stored["kind"] == "baseline":
            stored["metrics"] = _check_metrics(stored["metrics"], self.path)
        self.records.append(stored)


class _Scenario(Protocol):
    def reproduce(self) -> str: ...


class Pieces:
    """Which scenarios of a campaign run now, for both campaigns (single host and bed). Call order: iterate
    ``select(scenarios)`` as the campaign's loop, ``record(scenario, row)`` after each trial, ``finish()`` once."""

    def __init__(self, journal: Journal | None, stop_after_s: float | None, log: Callable[[str], None], tag: str,
                 clock: Callable[[], float] = time.time, replay_failed: bool = False) -> None:
        self.journal, self.stop_after_s, self.log, self.tag, self.clock = journal, stop_after_s, log, tag, clock
        self.replay_failed = replay_failed
        self.t0 = clock()
        self.pending = 0
        self.rows: list[dict[str, Any]] = []

    def select(self, scenarios: Iterable[_Scenario]) -> Iterator[Any]:
        """The scenarios not in the journal (and, with ``replay_failed``, those whose latest row failed), until the
        time budget is spent (the rest counted as pending)."""
        for sc in scenarios:
            key = sc.reproduce()
            if self.journal is not None and self.journal.has(key):
                if not (self.replay_failed and self.journal.failed(key)):
                    continue
                self.log(f"{self.tag} trial {getattr(sc, 'trial', key)}: replaying (its latest row failed)")
            if self.stop_after_s is not None and self.clock() - self.t0 > self.stop_after_s:
                self.pending += 1
                continue
            yield sc

    def record(self, sc: _Scenario, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.journal is not None:
            self.journal.add_trial(sc.reproduce(), row)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Every row to report (the journal's when there is one) and the counts for the summary."""
        if self.pending:
            self.log(f"{self.tag} time budget of {self.stop_after_s:.0f} s spent: {self.pending} trial(s) not "
                     "started (run the same command again to continue from the journal)")
        every = self.journal.rows() if self.journal is not None else self.rows
        return every, {"pending": self.pending, "ran_now": len(self.rows)}
