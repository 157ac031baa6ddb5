"""One deadpool-run launcher per namespace host (``testing/hosts.py``), a training job, a fault applied to the bed.

Shared by the multi-host tests and ``benchmarks/bench_hosts.py``: every launcher gets the same command line except
what tells it its place (``launch``), the etcd cluster of the bed as its store, and one timeline file (each line is
one append: JSON lines from every launcher and worker interleave whole).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..recovery.timeline import read_events
from .hosts import HostBed
from .jobs import Job
from .launch import REPO, base_env, read_metrics, wait_for_step


@dataclass
class HostsRun:
    rcs: list[int | None]          # per host; None: the host was killed with its launcher
    metrics: dict[int, float]
    events: list[dict[str, Any]]
    logs: list[str]
    t_fault: float | None = None
    timeline: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as fh:
            return fh.read()

    def tails(self, n: int = 2500) -> str:
        return "\n".join(f"--- host {i} ---\n{self.log(i)[-n:]}" for i in range(len(self.logs)))


def run_on_hosts(bed: HostBed, workdir: str, script: Sequence[str], metrics: str, *, nnodes: int, spares: int,
                 name: str, fault: Callable[[HostBed, str], None] | None = None, fault_step: int = 4,
                 timeout_s: float = 300, extra: Sequence[str] = (), launch: str = "flags", hosts: int | None = None,
                 leader_ttl_s: int = 4, env: dict[str, str] | None = None) -> HostsRun:
    """Run ``script`` (the training script and its arguments, writing ``metrics``) under one launcher per host of
    the bed (the first ``hosts`` of them). ``fault(bed, timeline)`` runs once the metrics reach ``fault_step``.
    ``launch``: how each launcher learns its place: ``flags`` (--hosts, --host-rank, --host), ``hostfile`` (one
    identical command line on every host, --hostfile listing the hosts' addresses) or ``slurm`` (identical command
    line with --from-slurm, SLURM's variables in each host's environment). ``env``: added to the launchers'
    environment (e.g. a fault injector's ``chaos.at_step.harness_env``)."""
    assert bed.etcd is not None, "the bed needs its etcd cluster (bed.start_etcd)"
    if launch not in ("flags", "hostfile", "slurm"):
        raise ValueError(f"run_on_hosts: launch={launch!r}: must be flags, hostfile or slurm")
    n_hosts = bed.n_hosts if hosts is None else hosts
    timeline = os.path.join(workdir, f"{name}.timeline.jsonl")
    job_env = base_env({"DEADPOOL_STORE_TOKEN": bed.etcd.token, "GLOO_SOCKET_IFNAME": "eth0", **(env or {})})
    hostfile = os.path.join(workdir, f"{name}.hostfile")
    with open(hostfile, "w") as fh:
        fh.write("".join(f"{bed.addr(h)} slots=1\n" for h in range(n_hosts)))
    prefix = bed.addr(0).rsplit(".", 1)[0]
    procs, logs = [], []
    for h in range(n_hosts):
        log_path = os.path.join(workdir, f"{name}.host{h}.log")
        logs.append(log_path)
        job = Job(script=script[0], args=tuple(script[1:]), nnodes=nnodes, spare_nodes=spares,
                  store_url=bed.etcd.store_url, timeline=timeline,
                  launcher_flags=("--leader-ttl-s", str(leader_ttl_s), *extra))
        if launch == "flags":
            job = job.replace(hosts=n_hosts, host_rank=h, host=bed.addr(h), nproc_per_node=1, job_id=name)
        elif launch == "hostfile":
            job = job.replace(job_id=name, launcher_flags=("--hostfile", hostfile, *job.launcher_flags))
        else:
            job = job.replace(launcher_flags=("--from-slurm", *job.launcher_flags))
        host_env = dict(job_env)
        if launch == "slurm":
            host_env.update(SLURM_JOB_ID=name, SLURM_NNODES=str(n_hosts), SLURM_NODEID=str(h),
                            SLURM_STEP_NODELIST=f"{prefix}.[1-{n_hosts}]")
        with open(log_path, "w") as fh:
            procs.append(bed.popen(h, job.argv(), cwd=REPO, env=host_env, stdout=fh, stderr=fh))
    rcs: list[int | None] = [None] * len(procs)
    t_fault = None
    try:
        if fault is not None:
            wait_for_step(metrics, fault_step, timeout_s=timeout_s, proc=procs[0])
            t_fault = time.time()
            with open(timeline, "a") as fh:
                fh.write(json.dumps({"event": "fault", "time": t_fault, "source": "injector",
                                     "fault": getattr(fault, "__name__", "fault")}) + "\n")
            fault(bed, timeline)
        deadline = time.monotonic() + timeout_s
        for h, p in enumerate(procs):
            if bed.holders.get(h) is None:
                continue  # the host was killed: its launcher with it
            rcs[h] = p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = read_events(timeline) if os.path.exists(timeline) else []
    return HostsRun(rcs, read_metrics(metrics), events, logs, t_fault, timeline)
