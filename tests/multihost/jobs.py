"""One deadpool-run launcher per namespace host, a tiny GPT job, faults applied to whole hosts."""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.hosts import HostBed
from deadpool_ext.testing.launch import REPO, base_env, read_metrics, wait_for_step
from tests.conftest import make_config

ITERS = 10
LEADER_TTL_S = 4


@dataclass
class HostsRun:
    rcs: list[int | None]
    metrics: dict[int, float]
    events: list[dict]
    logs: list[str]

    def log(self, i: int) -> str:
        return open(self.logs[i]).read()

    def tails(self) -> str:
        return "\n".join(f"--- host {i} ---\n{self.log(i)[-2500:]}" for i in range(len(self.logs)))


def run_hosts(bed: HostBed, tmp_path, *, nnodes: int = 3, spares: int = 2, stage: int = 3, iters: int = ITERS,
              name: str = "mh", fault: Callable[[HostBed, str], None] | None = None, fault_step: int = 4,
              timeout_s: float = 300, extra: tuple[str, ...] = (), launch: str = "flags") -> HostsRun:
    """``fault(bed, metrics_path)`` runs once the metrics reach ``fault_step``. Launchers whose host was killed
    report None. ``launch``: how each launcher learns its place: ``flags`` (--hosts, --host-rank, --host),
    ``hostfile`` (one identical command line on every host, --hostfile listing the hosts' addresses) or ``slurm``
    (identical command line with --from-slurm, SLURM's variables in each host's environment)."""
    assert bed.etcd is not None
    cfg = make_config(tmp_path, stage=stage, deadpool={})
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    env = base_env({"DEADPOOL_STORE_TOKEN": bed.etcd.token, "GLOO_SOCKET_IFNAME": "eth0"})
    procs, logs = [], []
    hostfile = os.path.join(str(tmp_path), f"{name}.hostfile")
    with open(hostfile, "w") as fh:
        fh.write("".join(f"{bed.addr(h)} slots=1\n" for h in range(bed.n_hosts)))
    prefix = bed.addr(0).rsplit(".", 1)[0]
    for h in range(bed.n_hosts):
        log_path = os.path.join(str(tmp_path), f"{name}.host{h}.log")
        logs.append(log_path)
        place = {"flags": ["--hosts", str(bed.n_hosts), "--host-rank", str(h), "--host", bed.addr(h),
                           "--nproc-per-node", "1", "--job-id", name],
                 "hostfile": ["--hostfile", hostfile, "--job-id", name],
                 "slurm": ["--from-slurm"]}[launch]
        host_env = dict(env)
        if launch == "slurm":
            host_env.update(SLURM_JOB_ID=name, SLURM_NNODES=str(bed.n_hosts), SLURM_NODEID=str(h),
                            SLURM_STEP_NODELIST=f"{prefix}.[1-{bed.n_hosts}]")
        cmd = [sys.executable, "-m", "deadpool_ext.launcher.cli", "--nnodes", str(nnodes), *place,
               "--spare-nodes", str(spares), "--store-url", bed.etcd.store_url,
               "--leader-ttl-s", str(LEADER_TTL_S), "--timeline", timeline, *extra,
               "scripts/pretrain_gpt.py", "--deepspeed_config", cfg, "--train-iters", str(iters),
               "--metrics-out", metrics]
        with open(log_path, "w") as fh:
            procs.append(bed.popen(h, cmd, cwd=REPO, env=host_env, stdout=fh, stderr=fh))
    rcs: list[int | None] = [None] * len(procs)
    try:
        if fault is not None:
            wait_for_step(metrics, fault_step, timeout_s=timeout_s, proc=procs[0])
            with open(timeline, "a") as fh:
                fh.write(json.dumps({"event": "fault", "time": time.time(), "source": "injector",
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
    return HostsRun(rcs, read_metrics(metrics), events, logs)
