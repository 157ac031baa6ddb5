"""A real Slurm on the namespace hosts (``testing/hosts.py``): ``munged``, ``slurmctld`` and one ``slurmd`` per host.

Debian's ``slurm-wlm`` 22.05 and ``munge``, as root, nothing of the machine's own configuration used::

    with HostBed(4 + 1) as bed:                   # 4 compute hosts, the last one is the control host
        slurm = SlurmBed(bed, nodes=4, workdir=tmp)
        slurm.start()                             # munged, slurmctld on the control host, slurmd -N NAME per host
        job = slurm.sbatch(["scripts/slurm/deadpool.sbatch", ...], nodes=4, env=env)
        slurm.wait_job(job, ("COMPLETED",), 300)
        slurm.scontrol("update", f"nodename={slurm.node(2)}", "state=down", "reason=test")
        slurm.stop()

Layout: compute host i is node ``dp<tag>n<i>`` at the host's address (``NodeAddr``), the last host of the bed is
``dp<tag>ctl`` running ``slurmctld``; each host's private mount namespace gets its own ``/etc/hosts`` naming every
node (a cluster's DNS: the names Slurm hands a job resolve on every host, and nowhere else on this machine). One
``munged`` (on the control host; its socket is a file under :data:`RUN_ROOT`, reached from every network
namespace) signs for all. Every daemon runs in the foreground under the bed's ``popen``, so the bed's teardown ends
them, and a failed start says which daemon and shows its log's tail. Two partitions on the same nodes: ``main`` and
``urgent`` (higher priority tier, ``PreemptMode=REQUEUE``: a job there requeues the jobs of ``main`` it needs the
nodes of).
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .hosts import HostBed, HostBedError

__all__ = ["SlurmBed", "SlurmBedError", "missing_slurm", "SLURM_TIMERS", "SCHEDULER_PARAMETERS"]

_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
START_DEADLINE_S = 30.0
RUN_ROOT = "/run/deadpool-slurm"
"""Each bed's munge directory and slurmd spool directories (``RUN_ROOT/<tag>/``): short paths, as unix sockets
live there (at most 108 bytes, which a pytest directory exceeds), and no 0700 directory above them (munged refuses
one)."""
CTLD_PORT, SLURMD_PORT = 6817, 6818   # inside the bed's namespaces only: nothing else listens there
SLURM_TIMERS = {"SlurmdTimeout": 6, "SlurmctldTimeout": 10, "MessageTimeout": 5, "KillWait": 10,
                "InactiveLimit": 0, "MinJobAge": 300, "TCPTimeout": 2}
"""Timers of the bed's slurm.conf (seconds). ``SlurmdTimeout``: a node whose slurmd does not answer is DOWN after
this (Debian's default 300 s: a test would wait minutes); ``KillWait``: between the SIGTERM and the SIGKILL of a
cancelled or preempted job (its grace time)."""


SCHEDULER_PARAMETERS = "sched_interval=2"
"""The main scheduling loop every 2 s (Slurm's default, 60 s, can hold a requeued job that long after its begin
time)."""


class SlurmBedError(HostBedError):
    pass


def missing_slurm() -> str | None:
    """Why a Slurm bed cannot run here (a command of slurm-wlm or munge missing), or None."""
    for tool in _DAEMONS:
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install slurm-wlm munge)"
    return None


def sweep_stale_run_dirs() -> list[str]:
    """Remove the :data:`RUN_ROOT` directories of beds that are gone (a run killed before its teardown: its
    daemons died with its namespaces, ``hosts.sweep_stale``); returns their tags."""
    from .hosts import RECORDS

    gone = []
    if os.path.isdir(RUN_ROOT):
        for tag in os.listdir(RUN_ROOT):
            if not os.path.exists(os.path.join(RECORDS, f"{tag}.json")):
                shutil.rmtree(os.path.join(RUN_ROOT, tag), ignore_errors=True)
                gone.append(tag)
    return gone


def slurm_conf(tag: str, workdir: str, run_dir: str, munge_socket: str, nodes: Sequence[tuple[str, str]],
               ctl: tuple[str, str], cpus: int = 2, timers: Mapping[str, int] | None = None,
               cred_expire_s: int | None = None, grace_time_s: int = 0) -> str:
    """The bed's slurm.conf (pure): ``nodes`` and ``ctl`` are (name, address); logs and state under ``workdir``,
    slurmd's spool (its sockets) under ``run_dir``. ``cred_expire_s``: also how long a requeued job waits before it
    may start again (None: Slurm's 120 s); ``grace_time_s``: partition ``main``'s preemption GraceTime."""
    t = {**SLURM_TIMERS, **(timers or {})}
    names = ",".join(n for n, _ in nodes)
    lines = [
        f"ClusterName=dp{tag}",
        f"SlurmctldHost={ctl[0]}({ctl[1]})",
        f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}" + (f",cred_expire={cred_expire_s}" if cred_expire_s else ""),
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={workdir}/state",
        f"SlurmdSpoolDir={run_dir}/spool/%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid", f"SlurmdPidFile={workdir}/slurmd.%n.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log", f"SlurmdLogFile={workdir}/slurmd.%n.log",
        "SlurmctldDebug=info", "SlurmdDebug=info", "MailProg=/bin/true",
        # no cgroups here: processes are tracked by their parentage, tasks are not bound to cores
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
        "SwitchType=switch/none", "SelectType=select/linear", "SchedulerType=sched/builtin",
        f"SchedulerParameters={SCHEDULER_PARAMETERS}",
        "SlurmdParameters=config_overrides", "ReturnToService=1", "JobRequeue=1",
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        *(f"{k}={v}" for k, v in t.items()),
        *(f"NodeName={n} NodeAddr={a} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory=1000 "
          "State=UNKNOWN" for n, a in nodes),
        f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
        f"GraceTime={grace_time_s}",
        f"PartitionName=urgent Nodes={names} Default=NO MaxTime=INFINITE State=UP PriorityTier=2",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class SlurmBed:
    """Slurm on ``bed``: hosts ``0..nodes-1`` are compute nodes, host ``nodes`` (the bed's last) the controller."""

    bed: HostBed
    nodes: int
    workdir: str
    timers: dict[str, int] = field(default_factory=dict)
    cred_expire_s: int | None = None
    """Slurm's credential lifetime, which is also how long a requeued job waits (None: Slurm's default, 120 s)."""
    grace_time_s: int = 0
    """Partition ``main``'s preemption GraceTime (Slurm's default 0: SIGTERM, then SIGKILL after KillWait)."""
    munged: subprocess.Popen[bytes] | None = None
    ctld: subprocess.Popen[bytes] | None = None
    slurmd: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    dir: str = ""

    # -- names ------------------------------------------------------------------------------------
    def node(self, i: int) -> str:
        return f"dp{self.bed.tag}n{i}"

    @property
    def ctl_host(self) -> int:
        return self.nodes

    @property
    def ctl_name(self) -> str:
        return f"dp{self.bed.tag}ctl"

    @property
    def conf(self) -> str:
        return os.path.join(self.dir, "slurm.conf")

    @property
    def run_dir(self) -> str:
        return os.path.join(RUN_ROOT, self.bed.tag)

    @property
    def munge_dir(self) -> str:
        """munged's key, socket and log (:data:`RUN_ROOT`)."""
        return os.path.join(self.run_dir, "munge")

    @property
    def munge_socket(self) -> str:
        return os.path.join(self.munge_dir, "munge.socket")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm's commands on this bed (``SLURM_CONF``), ``extra`` added."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        env.update(extra or {})
        return env

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        why = missing_slurm()
        if why is not None:
            raise SlurmBedError(why)
        if self.bed.n_hosts < self.nodes + 1:
            raise SlurmBedError(f"a Slurm bed of {self.nodes} nodes needs {self.nodes + 1} hosts (one controller); "
                                f"the bed has {self.bed.n_hosts}")
        sweep_stale_run_dirs()
        self.dir = os.path.join(self.workdir, f"slurm-{self.bed.tag}")
        os.makedirs(os.path.join(self.dir, "state"), mode=0o700, exist_ok=True)
        for i in range(self.nodes):
            os.makedirs(os.path.join(self.run_dir, "spool", self.node(i)), mode=0o700, exist_ok=True)
        os.makedirs(self.munge_dir, mode=0o755, exist_ok=True)
        for d in (RUN_ROOT, self.run_dir, self.munge_dir):
            os.chmod(d, 0o755)
        self._resolve_names()
        nodes = [(self.node(i), self.bed.addr(i)) for i in range(self.nodes)]
        with open(self.conf, "w") as fh:
            fh.write(slurm_conf(self.bed.tag, self.dir, self.run_dir, self.munge_socket, nodes,
                                (self.ctl_name, self.bed.addr(self.ctl_host)), timers=self.timers,
                                cred_expire_s=self.cred_expire_s, grace_time_s=self.grace_time_s))
        with open(os.path.join(self.dir, "cgroup.conf"), "w") as fh:
            fh.write("CgroupPlugin=cgroup/v1\n")   # autodetect finds no cgroup file system in a host's namespace
        try:
            self._start_munged()
            self.ctld = self._daemon(self.ctl_host, self.ctl_name, ["slurmctld", "-D", "-c", "-i", "-f", self.conf],
                                     "slurmctld")
            for i in range(self.nodes):
                self.start_slurmd(i)
            self.wait_nodes_idle(range(self.nodes), START_DEADLINE_S)
        except BaseException:
            self.stop()
            raise

    def _resolve_names(self) -> None:
        """Every host's own /etc/hosts (its private mount namespace): the machine's, plus the bed's names."""
        with open("/etc/hosts") as fh:
            base = fh.read()
        path = os.path.join(self.dir, "hosts")
        extra = [f"{self.bed.addr(i)} {self.node(i)}" for i in range(self.nodes)]
        extra.append(f"{self.bed.addr(self.ctl_host)} {self.ctl_name}")
        with open(path, "w") as fh:
            fh.write(base.rstrip("\n") + "\n# deadpool Slurm bed\n" + "\n".join(extra) + "\n")
        os.chmod(path, 0o644)
        for i in range(self.nodes + 1):
            res = self.bed.run(i, ["mount", "--bind", path, "/etc/hosts"])
            if res.returncode != 0:
                raise SlurmBedError(f"host {i}: bind-mounting the bed's /etc/hosts failed: {res.stderr.strip()}")

    def _start_munged(self) -> None:
        key = os.path.join(self.munge_dir, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as fh:
            fh.write(secrets.token_bytes(1024))
        d = self.munge_dir
        self.munged = self._daemon(self.ctl_host, self.ctl_name, [
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"], "munged")
        deadline = time.monotonic() + START_DEADLINE_S
        while not os.path.exists(self.munge_socket):
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmBedError(f"munged did not start (exit {self.munged.poll()}):\n"
                                    + _tail(os.path.join(d, "munged.log"))
                                    + _tail(os.path.join(self.dir, "munged.out")))
            time.sleep(0.05)

    def _daemon(self, host: int, hostname: str, argv: list[str], what: str) -> subprocess.Popen[bytes]:
        """``argv`` on ``host`` with a hostname of its own (a UTS namespace: slurmctld checks that it runs on the
        controller it is configured as; each slurmd's jobs see their node's name)."""
        log = open(os.path.join(self.dir, f"{what}.out"), "ab")
        try:
            return self.bed.popen(host, ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                                         hostname, *argv], env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def start_slurmd(self, i: int) -> None:
        """Host ``i``'s slurmd, as node ``node(i)`` (``-N``: the machine's hostname is every host's)."""
        self.slurmd[i] = self._daemon(i, self.node(i), ["slurmd", "-D", "-N", self.node(i), "-f", self.conf],
                                      f"slurmd.{i}")

    def stop(self) -> None:
        """Every daemon ended (SIGKILL: the state is thrown away with the bed), whatever state it is in."""
        for p in [*self.slurmd.values(), self.ctld, self.munged]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- commands ---------------------------------------------------------------------------------
    def cmd(self, *argv: str, timeout_s: float = 20.0, check: bool = True,
            env: Mapping[str, str] | None = None) -> str:
        """A Slurm command run here (the root namespace reaches the controller over the bridge); its stdout."""
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=self.env(env))
        if check and res.returncode != 0:
            raise SlurmBedError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
        return res.stdout

    def scontrol(self, *argv: str) -> str:
        return self.cmd("scontrol", *argv)

    def hostlist(self, hosts: Sequence[int]) -> str:
        """Slurm's compressed node list of hosts ``hosts`` (``dpTn[0-1,3]``), as scontrol writes it."""
        return self.cmd("scontrol", "show", "hostlist", ",".join(self.node(i) for i in hosts)).strip()

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (``idle``, ``alloc``, ``down*``, ...)."""
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_node_state(self, i: int, prefix: str, timeout_s: float) -> str:
        """Wait until node ``i``'s sinfo state starts with ``prefix`` (``down``: ``down`` or ``down*``); the state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.node_states().get(self.node(i), "")
            if state.startswith(prefix):
                return state
            if time.monotonic() > deadline:
                raise SlurmBedError(f"node {self.node(i)} not {prefix} within {timeout_s:g}s (state {state!r})")
            time.sleep(0.2)

    def wait_nodes_idle(self, hosts: Sequence[int] | range, timeout_s: float) -> None:
        want = {self.node(i) for i in hosts}
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while True:
            try:
                states = self.node_states()
            except (SlurmBedError, subprocess.TimeoutExpired):
                states = {}
            if all(states.get(n) == "idle" for n in want):
                return
            dead = [w for w, p in (("slurmctld", self.ctld), *((f"slurmd {i}", p) for i, p in self.slurmd.items()))
                    if p is not None and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmBedError(f"Slurm nodes not idle within {timeout_s:g}s (states {states}; exited: "
                                    f"{', '.join(dead) or 'none'}):\n{self.log_tails()}")
            time.sleep(0.2)

    def sbatch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, options: Sequence[str] = ()
               ) -> str:
        """Submit a batch job (``sbatch --parsable OPTIONS ARGV``); its job id."""
        return self.cmd("sbatch", "--parsable", *options, *argv, env=env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, Restarts, BatchHost, ExitCode, ...)."""
        out = self.cmd("scontrol", "-o", "show", "job", job_id)
        fields: dict[str, str] = {}
        for word in out.split():
            k, sep, v = word.partition("=")
            if sep:
                fields[k] = v
        return fields

    def wait_job(self, job_id: str, states: Sequence[str], timeout_s: float, what: str = "") -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, Any] = {}
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise SlurmBedError(f"job {job_id} not {'/'.join(states)} within {timeout_s:g}s{what} "
                                    f"(state {info.get('JobState')}, reason {info.get('Reason')})")
            time.sleep(0.2)

    # -- faults -----------------------------------------------------------------------------------
    def kill_node(self, i: int) -> int:
        """Node ``i`` lost: its slurmd and every process of its host SIGKILLed (``HostBed.kill_host``)."""
        self.slurmd.pop(i, None)
        return self.bed.kill_host(i)

    def kill_worker(self, i: int, worker_id: str, sig: int = 9) -> int:
        """Signal the worker process ``worker_id`` on node ``i`` (found by its ``DEADPOOL_WORKER_ID``); its pid."""
        import psutil

        for pid in self.bed.pids(i):
            try:
                proc = psutil.Process(pid)
                if proc.environ().get("DEADPOOL_WORKER_ID") == worker_id:
                    proc.send_signal(sig)
                    return pid
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        raise SlurmBedError(f"no process of worker {worker_id} on node {self.node(i)}")

    def set_down(self, i: int, reason: str = "test") -> None:
        """``scontrol update nodename=NODE state=down``: what an admin or a health check does to a bad node."""
        self.scontrol("update", f"nodename={self.node(i)}", "state=down", f"reason={reason}")

    def log_tails(self, n: int = 1500) -> str:
        names = ["slurmctld.log", *(f"slurmd.{self.node(i)}.log" for i in range(self.nodes)), "slurmctld.out"]
        return "\n".join(f"--- {name} ---\n{_tail(os.path.join(self.dir, name), n)}" for name in names
                         if os.path.exists(os.path.join(self.dir, name)))


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""
