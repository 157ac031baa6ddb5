"""Applying one planned action to a running job, from outside it (real signals, real bytes flipped in the files
the job keeps). Builds on :mod:`deadpool_ext.testing.faults` (``corrupt_file``) and ``testing.launch``
(``wait_for_step``, ``kill_tree``).

Timing inside a step (the ``slot_write`` / ``replica_write`` triggers) is done by watching the 8-byte MAGIC at
the start of the shared-memory files: a writer zeroes it before the first byte of a new version and writes it
last (``snapshot/slots.py``, ``replicate/peer.py``), so a zero MAGIC in a file that held a version means a copy
or a transfer is in progress. The injector polls it every ~0.5 ms and fires on the first zero; whether the kill
landed inside the window is checked afterwards (``hit``) and reported, because on a loaded host the window can
close before the signal arrives.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..snapshot import format as fmt
from ..snapshot.slots import data_offset
from ..testing.faults import corrupt_file
from ..testing.launch import kill_tree, read_metrics, wait_for_step
from .catalogue import Action

POLL_S = 0.0005


@dataclass(kw_only=True)
class JobPaths:
    """Where a running job keeps what the injector touches."""

    shm_root: str
    job_id: str
    metrics: str
    timeline: str
    save_dir: str | None = None
    restore_gate: str | None = None
    """Created once a tier-1/2 corruption is done (the job's restore waits for it: chaos/at_step.py)."""


@dataclass(kw_only=True)
class Injected:
    """What one action did (JSON-able, goes into the trial record)."""

    action: str
    fired: bool = False
    at: float | None = None
    pids: list[int] = field(default_factory=list)
    hit: bool | None = None
    corrupted: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    landed_after: int | None = None
    """A step-triggered signal: the newest step the job had logged when the signal was sent."""
    as_planned: bool | None = None
    """A step-triggered signal: whether it landed where the plan says (:func:`off_plan`); None: not timed by step."""


LANDING_SLACK = 1
"""A signal planned "after step S" lands as planned while the job has logged at most step S + 1: the ranks log their
steps a moment apart, and the next step may be done on the rank that logs while the victim's is still running."""


def off_plan(planned: int, landed: int | None) -> str | None:
    """Why a signal planned "after step ``planned``" did not land there, or None when it did (pure). ``landed``: the
    newest step the job had logged when the signal was sent (None: unknown). An injector outside the job polls its
    metrics, so on a loaded host with fast steps the signal can land several steps late: such a trial tested another
    moment than its plan's and is reported as not injected as planned."""
    if landed is None or landed <= planned + LANDING_SLACK:
        return None
    return f"not injected as planned: planned after step {planned}, landed after step {landed}"


def _magic(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(8)
    except OSError:
        return None


def segment_info(path: str) -> dict[str, Any] | None:
    """Version and data section of a sealed slot / replica file; None if torn, empty or unreadable."""
    try:
        with open(path, "rb") as fh:
            buf = fh.read()
    except OSError:
        return None
    if len(buf) < fmt.PREFIX_LEN or not any(buf[fmt.MAGIC_SLICE]):
        return None
    try:
        header = fmt.read_header(memoryview(buf))
    except fmt.SnapshotFormatError:
        return None
    header_len = fmt.header_len_of(buf)
    meta = header.get("meta") or {}
    return {"version": int(meta.get("version", -1)), "data_offset": data_offset(header_len),
            "data_nbytes": int(header["data_nbytes"]), "size": len(buf)}


def workers_of(launcher_pid: int, target: str) -> list[psutil.Process]:
    """Worker processes of ``target``: a worker id (``node1.0``) or a node (``node1``: all its workers)."""
    out: list[psutil.Process] = []
    try:
        procs = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            wid = p.environ().get("DEADPOOL_WORKER_ID", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if wid == target or ("." not in target and wid.startswith(target + ".")):
            out.append(p)
    return out


class Injector:
    """Runs a scenario's actions in order against the job under ``launcher`` (a Popen)."""

    def __init__(self, paths: JobPaths, *, deadline_s: float) -> None:
        self.paths = paths
        self.deadline_s = deadline_s
        self.records: list[Injected] = []
        self.filler: str | None = None

    # -- triggers -------------------------------------------------------------------------------------
    def _wait(self, cond, proc: subprocess.Popen, what: str, poll_s: float = 0.02) -> None:
        deadline = time.time() + self.deadline_s
        while not cond():
            if proc.poll() is not None:
                raise RuntimeError(f"job exited (rc={proc.returncode}) before {what}")
            if time.time() > deadline:
                raise TimeoutError(f"waited {self.deadline_s}s for {what}")
            time.sleep(poll_s)

    def _events(self) -> list[dict]:
        if not os.path.exists(self.paths.timeline):
            return []
        out = []
        with open(self.paths.timeline) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
        return out

    def _shm_files(self, pattern: str) -> list[str]:
        job = self.paths.job_id
        return sorted(glob.glob(os.path.join(self.paths.shm_root, f"deadpool.{job}.*", pattern.format(job=job))))

    def _bases(self, *, complete: bool) -> list[int]:
        d = self.paths.save_dir
        if not d or not os.path.isdir(d):
            return []
        out = []
        for name in os.listdir(d):
            if name.startswith("global_step") and name[len("global_step"):].isdigit():
                has_commit = os.path.exists(os.path.join(d, name, "deadpool_commit.json"))
                if has_commit == complete:
                    out.append(int(name[len("global_step"):]))
        return sorted(out)

    def _published(self) -> int:
        try:
            with open(os.path.join(self.paths.save_dir or "", "latest")) as fh:
                return int(fh.read().strip()[len("global_step"):])
        except (OSError, ValueError):
            return 0

    def _wait_write(self, files_pattern: str, proc: subprocess.Popen, step: int, what: str) -> list[str]:
        """After ``step``: wait until one of the files matching the pattern has its MAGIC zeroed after having
        held a version. Returns the files that were being written (empty on timeout: fire anyway)."""
        wait_for_step(self.paths.metrics, step, timeout_s=self.deadline_s, proc=proc)
        seen: set[str] = set()
        deadline = time.time() + min(30.0, self.deadline_s)
        while time.time() < deadline and proc.poll() is None:
            for path in self._shm_files(files_pattern):
                m = _magic(path)
                if m is None:
                    continue
                if any(m):
                    seen.add(path)
                elif path in seen:
                    return [path]
            time.sleep(POLL_S)
        return []

    # -- actions --------------------------------------------------------------------------------------
    def run(self, proc: subprocess.Popen, actions) -> None:
        try:
            for action in actions:
                rec = Injected(action=action.describe())
                self.records.append(rec)
                try:
                    self._one(proc, action, rec)
                except Exception as exc:  # noqa: BLE001 - recorded; the trial reports it as not injected
                    rec.note = f"not injected: {type(exc).__name__}: {exc}"
                    return
        finally:
            self.open_gate()

    def _one(self, proc: subprocess.Popen, a: Action, rec: Injected) -> None:
        t = a.trigger
        writing: list[str] = []
        if t.kind == "step":
            wait_for_step(self.paths.metrics, t.value, timeout_s=self.deadline_s, proc=proc)
        elif t.kind == "assignment":
            self._wait(lambda: any(e.get("event") == "assignment" and e.get("generation") == t.value
                                   for e in self._events()), proc, f"assignment {t.value}")
        elif t.kind == "slot_write":
            writing = self._wait_write(f"deadpool.{{job}}.snap.r{t.rank}.*", proc, t.value, "a slot write")
        elif t.kind == "replica_write":
            writing = self._wait_write(f"deadpool.{{job}}.replica.r{t.rank}.h*", proc, t.value, "a replica transfer")
        elif t.kind == "base_published":
            self._wait(lambda: self._published() >= t.value, proc, f"base >= {t.value} published", 0.01)
        elif t.kind == "base_writing":
            def writing_base() -> bool:
                return any(v >= t.value and v > self._published() for v in self._bases(complete=False))
            self._wait(writing_base, proc, f"base >= {t.value} being written", 0.002)
        if a.op == "signal":
            self._signal(proc, a, rec, writing)
        elif a.op == "corrupt":
            self._corrupt(a, rec)
        elif a.op == "fill":
            self._fill(rec)
        elif a.op == "kill_job":
            rec.note = f"bases complete {self._bases(complete=True)}, in flight {self._bases(complete=False)}"
            kill_tree(proc.pid)
            rec.fired, rec.at = True, time.time()

    def _log_fault(self, **rec: Any) -> None:
        with open(self.paths.timeline, "a") as fh:
            fh.write(json.dumps({"event": "fault", "time": time.time(), "source": "chaos", **rec}) + "\n")

    def _signal(self, proc: subprocess.Popen, a: Action, rec: Injected, writing: list[str]) -> None:
        deadline = time.time() + 60
        targets = workers_of(proc.pid, a.target)
        want = 1 if "." in a.target else None
        while (not targets or (want and len(targets) < want)) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
            targets = workers_of(proc.pid, a.target)
        if not targets:
            raise RuntimeError(f"no worker process for {a.target}")
        sig = getattr(signal, a.sig)
        for p in targets:
            try:
                p.send_signal(sig)
                rec.pids.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        rec.fired, rec.at = True, time.time()
        if a.trigger.kind == "step":
            rec.landed_after = max(read_metrics(self.paths.metrics), default=0)
            why = off_plan(a.trigger.value, rec.landed_after)
            rec.as_planned = why is None
            if why is not None:
                rec.note = why
        if writing:  # did the signal land while the copy/transfer was still open?
            rec.hit = not any(_magic(writing[0]) or b"\1")
        elif a.trigger.kind in ("slot_write", "replica_write"):
            rec.hit = False
            rec.note = "no write observed within the polling window: signalled at the deadline"
        self._log_fault(target=a.target, signal=int(sig), pids=rec.pids)

    def _corrupt(self, a: Action, rec: Injected) -> None:
        # Let the survivors' snapshot workers quiesce (recover() does it first) so a copy still in flight cannot
        # overwrite the flipped bytes before the restore scans them.
        time.sleep(0.5)
        if a.tier == 1:
            infos = [(p, segment_info(p)) for p in self._shm_files(f"deadpool.{{job}}.snap.r{a.rank}.*")]
            sealed = sorted(((i["version"], p, i) for p, i in infos if i), reverse=True)
            chosen = [(v, p, i, a.rank) for v, p, i in (sealed if a.which == "all" else sealed[:1])]
        else:
            held = [(p, segment_info(p)) for p in self._shm_files(f"deadpool.{{job}}.replica.r{a.rank}.h*")]
            sealed = sorted(((i["version"], p, i) for p, i in held if i), reverse=True)
            chosen = [(v, p, i, a.rank) for v, p, i in sealed[:1]] if len(sealed) >= 2 else []
            if not chosen:
                # The other buffer was torn by the kill (the transfer was in flight): corrupting the only sealed
                # copy would make the loss unrecoverable by design. Corrupt a replica nobody needs instead (a
                # survivor's, held on a surviving node): it must not stop the restore, and is reported only if a
                # restore reads it (the restore checks the copies it uses).
                # A rank whose own slots are gone was on the lost node too (its memory is dropped with it; the
                # restore gate holds the spare before it writes any): its replicas are needed as much as a.rank's.
                def owner(path: str) -> int:
                    return int(os.path.basename(path).split(".")[3][1:])

                replicas = self._shm_files("deadpool.{job}.replica.r*.h*")
                lost = {owner(p) for p in replicas if not self._shm_files(f"deadpool.{{job}}.snap.r{owner(p)}.*")}
                others = [(p, segment_info(p)) for p in replicas if owner(p) != a.rank and owner(p) not in lost]
                sealed_o = sorted(((i["version"], p, i) for p, i in others if i), reverse=True)
                chosen = [(v, p, i, owner(p)) for v, p, i in sealed_o[:1]]
                rec.note = (f"only {len(sealed)} sealed replica buffer(s) of rank {a.rank}: corrupted a survivor's "
                            f"replica instead" if chosen else f"only {len(sealed)} sealed replica buffer(s) of rank "
                            f"{a.rank} and no other replica held: corrupting none")
        if a.tier in (1, 2):
            for version, path, info, rank in chosen:
                pos = info["data_offset"] + info["data_nbytes"] // 2
                corrupt_file(path, offset_from_end=info["size"] - pos, nbytes=16)
                name = os.path.basename(path)
                rec.corrupted.append({"tier": a.tier, "path": path, "file": name, "version": version,
                                      "rank": rank, "index": int(name.rsplit("b" if a.tier == 2 else ".", 1)[1]),
                                      "unneeded": a.tier == 2 and rank != a.rank})
        else:
            version = self._published()
            d = os.path.join(self.paths.save_dir or "", f"global_step{version}")
            files = sorted((f for f in os.listdir(d) if f.endswith(".pt")),
                           key=lambda f: (-os.path.getsize(os.path.join(d, f)), f))
            path = os.path.join(d, files[0])
            corrupt_file(path, offset_from_end=os.path.getsize(path) // 2, nbytes=16)
            rec.corrupted.append({"tier": 3, "path": path, "file": files[0], "version": version,
                                  "tag": f"global_step{version}"})
        rec.fired, rec.at = bool(rec.corrupted), time.time()
        self._log_fault(corrupted=[c["file"] for c in rec.corrupted], tier=a.tier)
        self.open_gate()

    def open_gate(self) -> None:
        """Let the job's restore go on (idempotent; also called when the injector finishes or fails)."""
        if self.paths.restore_gate and not os.path.exists(self.paths.restore_gate):
            with open(self.paths.restore_gate, "w") as fh:
                fh.write(str(time.time()))

    def _fill(self, rec: Injected) -> None:
        d = self.paths.save_dir or ""
        free = shutil.disk_usage(d).free
        self.filler = os.path.join(d, ".chaos-filler")
        with open(self.filler, "wb") as fh:
            # Leave less than one chunk of a base: the next base fails up front or on ENOSPC mid-write.
            chunk = b"\0" * (1 << 20)
            left = free - (256 << 10)
            try:
                while left > 0:
                    left -= fh.write(chunk[:min(len(chunk), left)])
            except OSError:
                pass  # full already
        rec.fired, rec.at = True, time.time()
        rec.note = f"filled {free} bytes; free now {shutil.disk_usage(d).free}; published {self._published()}"
        self._log_fault(filled=free)

    def release(self) -> None:
        """Undo what must not outlive the first job (the filler file)."""
        if self.filler and os.path.exists(self.filler):
            os.unlink(self.filler)
        self.filler = None
