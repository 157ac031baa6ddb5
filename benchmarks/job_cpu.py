"""The CPU of a benchmark job's whole process tree, counted by the kernel: a cgroup made for the job.

Every process the job starts (launcher, ranks, spare, helpers such as a checkpoint writer or DLRover's saver) is
in the cgroup its first process was put in, and the kernel counts their CPU there, exited processes included:
cgroup v1 ``cpuacct.usage`` (ns) or cgroup v2 ``cpu.stat`` ``usage_usec``. No sampling. ``read_role_cpu`` adds the
split by process over the same window, from each live process's /proc counters (its threads, and the children it
reaped).

    with JobCgroup.create("deadpool_bench_x") as cg:
        run_job(cg.wrap(cmd), env={..., CGROUP_ENV: cg.path})
    # inside the job: JobCgroup.from_env().usage_s()
"""
from __future__ import annotations

import os
import signal
import time
from types import TracebackType

CGROUP_ENV = "DEADPOOL_BENCH_CGROUP"
"""The job's cgroup folder, handed to its processes so that rank 0 reads the usage at its window's barriers."""
ROOTS = (("v1", "/sys/fs/cgroup/cpuacct"), ("v2", "/sys/fs/cgroup/unified"), ("v2", "/sys/fs/cgroup"))


class NoCgroup(RuntimeError):
    """No cgroup could be made here for a job (no writable cpuacct or cgroup2 hierarchy)."""


def _version_of(path: str) -> str:
    return "v1" if os.path.exists(os.path.join(path, "cpuacct.usage")) else "v2"


class JobCgroup:
    def __init__(self, path: str, owned: bool = False) -> None:
        self.path = path
        self.version = _version_of(path)
        self.owned = owned

    @property
    def source(self) -> str:
        return "cgroup v1 cpuacct.usage" if self.version == "v1" else "cgroup v2 cpu.stat usage_usec"

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    @classmethod
    def create(cls, name: str) -> JobCgroup:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"cgroup name {name!r}: one path component expected")
        errors = []
        for version, root in ROOTS:
            if not os.path.isdir(root) or (version == "v2" and not os.path.exists(os.path.join(root, "cgroup.procs"))):
                continue
            if version == "v2" and os.path.exists(os.path.join(root, "cpuacct.usage")):
                continue
            path = os.path.join(root, name)
            try:
                os.mkdir(path)
            except OSError as exc:
                errors.append(f"{root}: {exc.strerror}")
                continue
            cg = cls(path, owned=True)
            if cg.version == version and os.path.exists(cg._usage_file()):
                return cg
            os.rmdir(path)
            errors.append(f"{root}: no CPU usage file in a new cgroup")
        raise NoCgroup("no cgroup can be made for a job's CPU here (" + ("; ".join(errors) or "no cpuacct or cgroup2 "
                       "hierarchy mounted") + "): run as root on a host with cgroups mounted")

    @classmethod
    def check(cls) -> None:
        """Exit with one line when no cgroup can be made (before any job runs)."""
        try:
            with cls.create(f"deadpool_probe_{os.getpid()}"):
                pass
        except NoCgroup as exc:
            raise SystemExit(f"bench: {exc}") from None

    @classmethod
    def from_env(cls) -> JobCgroup:
        path = os.environ.get(CGROUP_ENV)
        if not path or not os.path.isdir(path):
            raise NoCgroup(f"{CGROUP_ENV} names no cgroup folder ({path!r}); the job must be started by cg.wrap")
        return cls(path)

    def _usage_file(self) -> str:
        return os.path.join(self.path, "cpuacct.usage" if self.version == "v1" else "cpu.stat")

    def usage_s(self) -> float:
        """CPU seconds of every process that was ever in the cgroup, from the kernel."""
        with open(self._usage_file()) as fh:
            text = fh.read()
        if self.version == "v1":
            return int(text.strip()) / 1e9
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        raise NoCgroup(f"{self._usage_file()}: no usage_usec line")

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as fh:
                return [int(line) for line in fh if line.strip()]
        except OSError:
            return []

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the cgroup: a shell writes its own pid into it, then becomes ``cmd``."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs_file, *cmd]

    def __enter__(self) -> JobCgroup:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self.owned:
            return
        # only this job's processes are in it: what outlived the job's own reaping is killed, then it is removed
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            left = self.pids()
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.2)


def role_file(role_dir: str, pid: int) -> str:
    return os.path.join(role_dir, str(int(pid)))


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads) + cutime + cstime (the children it reaped), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


def classify(role: str | None, cmdline: str) -> str:
    """A process's share of the job: ``ranks`` (a training rank), ``spare`` (a worker that never got a rank),
    ``launcher`` (deadpool-run, torchrun's agent), ``other``."""
    if role and role.startswith("rank"):
        return "ranks"
    if role == "script":
        return "spare"
    if "deadpool_ext.launcher" in cmdline or "torch.distributed.run" in cmdline or "torchrun" in cmdline:
        return "launcher"
    return "other"


def read_role_cpu(cgroup: JobCgroup, role_dir: str) -> dict[str, float]:
    """CPU seconds so far per share of the job (:func:`classify`), over the processes now in the cgroup."""
    out: dict[str, float] = {}
    for pid in cgroup.pids():
        cpu = _proc_cpu_s(pid)
        if cpu is None:
            continue
        try:
            with open(role_file(role_dir, pid)) as fh:
                role: str | None = fh.read().strip()
        except OSError:
            role = None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = ""
        share = classify(role, cmdline)
        out[share] = out.get(share, 0.0) + cpu
    return out
