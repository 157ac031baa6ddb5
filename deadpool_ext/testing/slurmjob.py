"""A training job submitted to the Slurm bed (``testing/slurm.py``) with the docs' sbatch script, unchanged.

Shared by ``tests/multihost/test_slurm.py`` and ``benchmarks/bench_slurm.py``::

    res = run_sbatch(slurm, workdir, script_argv, metrics, nodes=4, spares=1, name="kill",
                     fault=lambda s, run: s.kill_node(2), fault_step=4)
    res.job["JobState"], res.metrics, res.events, res.output

The job's store is the bed's etcd cluster (``DEADPOOL_STORE_URL``), or the embedded one served by the first node
(``store="embedded"``); its launchers' flags after the script's own (``launcher_flags``) and the training script
with its arguments (``script``) are the sbatch script's arguments, as a user would pass them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..recovery.timeline import read_events
from .launch import REPO, base_env, read_metrics
from .slurm import SlurmBed, SlurmBedError

SBATCH_SCRIPT = os.path.join(REPO, "scripts", "slurm", "deadpool.sbatch")
"""The sbatch script of docs/slurm.md: run as it is, never a copy."""
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
               "PREEMPTED")

__all__ = ["SlurmRun", "run_sbatch", "SBATCH_SCRIPT", "DONE_STATES"]


@dataclass
class SlurmRun:
    job_id: str
    job: dict[str, str]                 # scontrol show job at its end (JobState, ExitCode, Restarts, NodeList, ...)
    metrics: dict[int, float]
    events: list[dict[str, Any]]
    output_path: str
    timeline: str = ""
    t_fault: float | None = None
    t_submit: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output(self) -> str:
        """The job's output (the batch script's and every launcher's, as srun forwards them)."""
        try:
            with open(self.output_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def tail(self, n: int = 4000) -> str:
        return f"job {self.job}\n{self.output[-n:]}"


def job_env(slurm: SlurmBed, *, spares: int, store: str = "etcd", extra: Mapping[str, str] | None = None
            ) -> dict[str, str]:
    """What the submitting shell exports (sbatch hands it to the job): the store and its token, the spares,
    gloo's interface on the namespace hosts, this interpreter's ``bin`` first on PATH (``deadpool-run``)."""
    bed = slurm.bed
    if bed.etcd is None:
        raise SlurmBedError("the Slurm bed's host bed has no etcd cluster (its token is the job's store token)")
    env = base_env({"DEADPOOL_STORE_TOKEN": bed.etcd.token, "GLOO_SOCKET_IFNAME": "eth0",
                    "DEADPOOL_SPARES": str(spares), **(extra or {})})
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("DEADPOOL_STORE_URL", None)
    if store == "etcd":
        env["DEADPOOL_STORE_URL"] = bed.etcd.store_url
    elif store != "embedded":
        raise ValueError(f"run_sbatch: store={store!r}: must be etcd or embedded")
    return slurm.env(env)


def run_sbatch(slurm: SlurmBed, workdir: str, script: Sequence[str], metrics: str, *, nodes: int, spares: int,
               name: str, launcher_flags: Sequence[str] = (), store: str = "etcd",
               fault: Callable[[SlurmBed, SlurmRun], None] | None = None, fault_step: int = 4,
               timeout_s: float = 300, sbatch_options: Sequence[str] = (), env: Mapping[str, str] | None = None,
               end_states: Sequence[str] = DONE_STATES, batch_script: str = SBATCH_SCRIPT) -> SlurmRun:
    """Submit ``script`` (the training script and its arguments, writing ``metrics``) with the docs' sbatch script
    on ``nodes`` nodes, ``spares`` of them spares; ``fault(slurm, run)`` once the metrics reach ``fault_step``;
    then wait for the job to end (one of ``end_states``). ``batch_script``: another sbatch script (a benchmark's
    reference), given ``launcher_flags`` then ``script``, without the timeline flag."""
    timeline = os.path.join(workdir, f"{name}.timeline.jsonl")
    out = os.path.join(workdir, f"{name}.slurm.out")
    argv = ([SBATCH_SCRIPT, "--timeline", timeline] if batch_script == SBATCH_SCRIPT else [batch_script]) + \
        [*launcher_flags, *script]
    t_submit = time.time()
    job_id = slurm.sbatch(argv, env=job_env(slurm, spares=spares, store=store, extra=env),
                          options=("--nodes", str(nodes), "--output", out, "--chdir", REPO, "--job-name", name,
                                   *sbatch_options))
    run = SlurmRun(job_id, {}, {}, [], out, timeline=timeline, t_submit=t_submit)
    deadline = time.monotonic() + timeout_s
    try:
        if fault is not None:
            while max(read_metrics(metrics), default=0) < fault_step:
                info = slurm.job(job_id)
                if info.get("JobState") in DONE_STATES or time.monotonic() > deadline:
                    raise SlurmBedError(f"job {job_id} ({info.get('JobState')}, reason {info.get('Reason')}) did not "
                                        f"reach step {fault_step} within {timeout_s:g}s:\n{run.tail()}\n"
                                        f"{slurm.log_tails()}")
                time.sleep(0.05)
            run.t_fault = time.time()
            with open(timeline, "a") as fh:
                fh.write(json.dumps({"event": "fault", "time": run.t_fault, "source": "injector",
                                     "fault": getattr(fault, "__name__", "fault")}) + "\n")
            fault(slurm, run)
        run.job = slurm.wait_job(job_id, end_states, max(1.0, deadline - time.monotonic()), f":\n{run.tail()}")
    finally:
        if slurm.job(job_id).get("JobState") not in DONE_STATES:
            slurm.cmd("scancel", "--full", "--signal=KILL", job_id, check=False)
    run.metrics = read_metrics(metrics)
    run.events = read_events(timeline) if os.path.exists(timeline) else []
    return run
