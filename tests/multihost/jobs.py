"""The multi-host tests' job: tiny GPT under one deadpool-run per namespace host (``testing/hostjob.py``)."""
from __future__ import annotations

import os
from collections.abc import Callable

from deadpool_ext.testing.hostjob import HostsRun, run_on_hosts
from deadpool_ext.testing.hosts import HostBed
from deadpool_ext.testing.jobs import Job
from tests.conftest import make_config

ITERS = 10
LEADER_TTL_S = 4

__all__ = ["HostsRun", "run_hosts", "training_job", "ITERS"]


def training_job(tmp_path, *, nnodes: int = 3, stage: int = 3, iters: int = ITERS, name: str = "mh") -> Job:
    """The training job every host's launcher runs (its launcher flags are ``run_on_hosts``'): tiny GPT on
    ``nnodes`` nodes of one process."""
    return Job(script="scripts/pretrain_gpt.py", nnodes=nnodes, config=make_config(tmp_path, stage=stage, deadpool={}),
               args=("--train-iters", str(iters)), metrics=os.path.join(str(tmp_path), f"{name}.jsonl"))


def run_hosts(bed: HostBed, tmp_path, *, nnodes: int = 3, spares: int = 2, stage: int = 3, iters: int = ITERS,
              name: str = "mh", fault: Callable[[HostBed, str], None] | None = None, fault_step: int = 4,
              timeout_s: float = 300, extra: tuple[str, ...] = (), launch: str = "flags",
              env: dict[str, str] | None = None) -> HostsRun:
    job = training_job(tmp_path, nnodes=nnodes, stage=stage, iters=iters, name=name)
    assert job.metrics is not None
    metrics, script = job.metrics, job.script_argv()
    # 8 s heartbeat detection (deadpool-run's default is 3 s): losing an etcd member that was the cluster's leader
    # holds every heartbeat for its re-election plus a failover (seen: 4.4 s on the loaded 2-core host); a lost or
    # cut-off host is found by its lease (4 s) first anyway.
    return run_on_hosts(bed, str(tmp_path), script, metrics, nnodes=nnodes, spares=spares, name=name, fault=fault,
                        fault_step=fault_step, timeout_s=timeout_s, extra=("--detect-timeout-s", "8", *extra),
                        launch=launch, leader_ttl_s=LEADER_TTL_S, env=env)
