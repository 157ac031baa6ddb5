"""A real slowdown of running processes, applied from outside (issue 46, part 1's tests and benchmark): the kernel's
CPU bandwidth control, never a sleep in the code under test.

:class:`CpuQuota` makes a cgroup whose CPU quota is a fraction of one core (cgroup v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, or cgroup v2 ``cpu.max``) and moves whole processes (every thread) into it; the scheduler
then runs them at most that fraction of each period. :meth:`CpuQuota.release` moves them back where they were and
removes the cgroup. Needs root (or a delegated cgroup); :func:`quota_unavailable` says why not, before a test
starts. :class:`DutyCycle` is the fallback without cgroups: SIGSTOP / SIGCONT from a thread of the caller, so the
process runs ``fraction`` of every ``period_s``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid

V1_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
PERIOD_US = 10_000
"""The quota's period: 10 ms, so that a throttled process runs in short slices (with the kernel's 100 ms default, a
process at a tenth of a core runs 10 ms and then stands still for 90: a step of tens of ms is either untouched or
stopped whole, inside a collective as often as outside)."""


def _root() -> tuple[str, str] | None:
    """(version, mount) of a CPU controller a cgroup with a quota can be made in, None if none."""
    if os.path.exists(os.path.join(V1_ROOT, "cpu.cfs_quota_us")):
        return "v1", V1_ROOT
    for root in V2_ROOTS:
        ctl = os.path.join(root, "cgroup.subtree_control")
        if os.path.exists(ctl):
            with open(ctl) as fh:
                if "cpu" in fh.read().split():
                    return "v2", root
    return None


def quota_unavailable() -> str | None:
    """Why no CPU quota can be set on this host (None: it can)."""
    root = _root()
    if root is None:
        return "no cgroup CPU controller (v1 cpu.cfs_quota_us, or v2 cpu in cgroup.subtree_control) is mounted"
    if not os.access(root[1], os.W_OK):
        return f"{root[1]} is not writable (run as root, or delegate a cgroup)"
    return None


def _cgroup_of(pid: int, version: str) -> str:
    """The path, inside the controller's hierarchy, of ``pid``'s cgroup."""
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == "v1" and "cpu" in controllers.split(",")) or (version == "v2" and controllers == ""):
                return path
    return "/"


class CpuQuota:
    """A cgroup limited to ``fraction`` of one core; :meth:`add` moves a process (all its threads) into it."""

    def __init__(self, fraction: float, name: str = "deadpool-throttle") -> None:
        if not 0 < fraction <= 64:
            raise ValueError(f"fraction {fraction}: must be in (0, 64] cores")
        why = quota_unavailable()
        root = _root()
        if why is not None or root is None:
            raise RuntimeError(f"no CPU quota can be set here: {why}")
        self.version, self.root = root
        self.fraction = fraction
        self.path = os.path.join(self.root, f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self.moved: dict[int, str] = {}
        self.set(fraction)

    def set(self, fraction: float) -> None:
        """The quota, now: ``fraction`` of one core per period (the processes inside feel it at the next one)."""
        quota = max(1000, int(fraction * PERIOD_US))
        if self.version == "v1":
            self._write("cpu.cfs_period_us", str(PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
        else:
            self._write("cpu.max", f"{quota} {PERIOD_US}")
        self.fraction = fraction

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as fh:
            fh.write(value)

    def add(self, pid: int) -> None:
        self.moved.setdefault(pid, _cgroup_of(pid, self.version))
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as fh:
            return [int(x) for x in fh.read().split()]

    def release(self) -> None:
        """Every process back where it was (a process that exited is skipped); the cgroup removed."""
        for pid in self.pids():
            back = os.path.join(self.root, self.moved.get(pid, "/").lstrip("/"), "cgroup.procs")
            with contextlib.suppress(OSError), open(back, "w") as fh:
                fh.write(str(pid))
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class DutyCycle:
    """SIGSTOP / SIGCONT from a thread: each process in ``pids`` runs ``fraction`` of every ``period_s``."""

    def __init__(self, pids: list[int], fraction: float, period_s: float = 0.05) -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"fraction {fraction}: must be in (0, 1)")
        self.pids, self.fraction, self.period_s = list(pids), fraction, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._signal(signal.SIGSTOP)
                self._stop.wait(self.period_s * (1 - self.fraction))
                self._signal(signal.SIGCONT)
                self._stop.wait(self.period_s * self.fraction)
        finally:
            self._signal(signal.SIGCONT)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)


__all__ = ["CpuQuota", "DutyCycle", "quota_unavailable"]
