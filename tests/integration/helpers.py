"""Launch the pretraining scripts as real multi-process jobs for tests."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import psutil

from deadpool_ext.chaos import at_step
from deadpool_ext.chaos.at_step import StepFault
from deadpool_ext.rebuild import warm
from deadpool_ext.testing.baselines import BASELINES
from deadpool_ext.testing.faults import corrupt_file, drop_node_memory, kill_rank
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, read_metrics, run_job, wait_for_step
from deadpool_ext.testing.wait import wait_until

JOB_TIMEOUT_S = 300


def memory_tier_config(tmp_path, stage: int, shm_root: str, **deadpool) -> str:
    """The memory-tier tests' job: a snapshot every step, one peer replica, two simulated nodes, plus any other
    ``deadpool`` sections (e.g. ``differential``)."""
    from tests.conftest import make_config

    return make_config(tmp_path, stage=stage, deadpool={
        "snapshot": {"interval": 1}, "replication": {"factor": 1}, **deadpool,
        "local": {"shm_root": shm_root, "simulate_nodes": 2}})


def pretrain_job(tmp_path, config: str, *, nproc: int = 2, iters: int = 8, script: str = "scripts/pretrain_gpt.py",
                 extra: list[str] | None = None, max_restarts: int = 0, name: str = "run",
                 env: dict[str, str] | None = None) -> Job:
    """The pretraining script under torchrun: ``nproc`` ranks, ``iters`` steps, metrics in ``NAME.jsonl``."""
    return Job(launcher="torchrun", script=script, nproc_per_node=nproc, port=free_port(), max_restarts=max_restarts,
               config=config, args=("--train-iters", str(iters), *(extra or [])),
               metrics=os.path.join(str(tmp_path), f"{name}.jsonl"), env_vars=dict(env or {}))


def run_pretrain(tmp_path, job: Job, *, inject: Callable | None = None,
                 name: str = "run") -> tuple[object, dict[int, float], str]:
    """Run ``job`` (its log in ``NAME.log``); ``inject``: a :class:`KillAt` or ``inject(proc, metrics)``."""
    assert job.metrics is not None
    metrics = job.metrics
    if isinstance(inject, KillAt):
        job = job.replace(env_vars={**job.env_vars, **inject.env(os.path.join(str(tmp_path), f"{name}.fault"))})
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(),
                  while_running=(lambda p: inject(p, metrics)) if inject else None)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, f"job timed out after {JOB_TIMEOUT_S}s:\n{res.output[-4000:]}"
    return res, read_metrics(metrics), metrics


def pretrain(tmp_path, config: str, *, nproc: int = 2, iters: int = 8, script: str = "scripts/pretrain_gpt.py",
             extra: list[str] | None = None, max_restarts: int = 0, inject: Callable | None = None,
             name: str = "run", env: dict[str, str] | None = None) -> tuple[object, dict[int, float], str]:
    job = pretrain_job(tmp_path, config, nproc=nproc, iters=iters, script=script, extra=extra,
                       max_restarts=max_restarts, name=name, env=env)
    return run_pretrain(tmp_path, job, inject=inject, name=name)


def baseline(tmp_path, config: str, *, iters: int, nproc: int = 2) -> dict[int, float]:
    """The uninterrupted run's losses (``testing/baselines.py``: run once per key; every step logged)."""
    def run(job: Job) -> dict[int, float]:
        res, metrics, _ = run_pretrain(tmp_path, job, name="base")
        assert res.returncode == 0, res.output[-3000:]  # type: ignore[attr-defined]
        assert sorted(metrics) == list(range(1, iters + 1))
        return metrics

    return BASELINES.get(pretrain_job(tmp_path, config, nproc=nproc, iters=iters, name="base"), run)


def tagged_json(output: str, tag: str) -> list[dict]:
    """Every ``TAG {...}`` object the job's processes printed, in order, wherever it landed. The processes share one
    pipe, unbuffered (``PYTHONUNBUFFERED=1``), and ``print`` writes each argument, separator and the newline
    separately, so another process's output can follow an object on the same line (or a line can hold two objects).
    A worker prints its record as one string, ``print("TAG " + json.dumps(obj))``, so that the tag and its object
    arrive in one write (``print("TAG", json.dumps(obj))`` lets another rank's line in between: a record lost)."""
    dec, key, out = json.JSONDecoder(), tag + " {", []
    at = output.find(key)
    while at != -1:
        obj, end = dec.raw_decode(output, at + len(tag) + 1)
        out.append(obj)
        at = output.find(key, end)
    return out


def summary(res, script: str = "pretrain_gpt") -> dict:
    """The summary JSON the job's rank 0 prints last (``[pretrain_gpt] summary {...}``): ``deadpool`` is the
    runtime's ``stats()`` (``restore``: what the restore at start did), ``loaded_step``/``start_step`` where
    training started. The last one printed: under torchrun restarts, the attempt that finished."""
    tag = f"[{script}] summary "
    lines = [line for line in res.output.splitlines() if line.startswith(tag)]
    assert lines, f"no {tag!r} line: the job did not finish\n{res.output[-3000:]}"
    return json.JSONDecoder().raw_decode(lines[-1][len(tag):])[0]  # (another rank's output may follow on the line)


def restore_of(res) -> dict:
    """``stats()["restore"]`` of the job's finishing attempt: outcome, version, bases, fetched_from, ..."""
    return summary(res)["deadpool"]["restore"]


class KillAt:
    """Fail ``rank`` right after its optimizer step ``step``, from inside the worker (deadpool_ext.chaos.at_step),
    so the failure lands exactly there however loaded the host is; then run ``then()`` once the worker is dead
    (before the restarted workers restore)."""

    def __init__(self, step: int, rank: int, then: Callable[[], None] | None, action: str) -> None:
        self.fault = StepFault(action, step, rank, "")
        self.then = then
        self.marker = ""

    def env(self, marker: str) -> dict[str, str]:
        if os.path.exists(marker):
            os.unlink(marker)
        self.marker = marker
        return at_step.harness_env({at_step.ENV: StepFault(self.fault.action, self.fault.step, self.fault.rank,
                                                           marker).render()})

    def __call__(self, proc, metrics) -> None:
        deadline = time.time() + JOB_TIMEOUT_S
        while not (os.path.exists(self.marker) and open(self.marker).read().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"job exited (rc={proc.returncode}) before the fault at step {self.fault.step}")
            if time.time() > deadline:
                raise TimeoutError(f"waited {JOB_TIMEOUT_S}s for the fault at step {self.fault.step}")
            time.sleep(0.01)
        pid = int(open(self.marker).read())
        while time.time() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
        if self.then is not None:
            self.then()


def kill_at(step: int, rank: int = 1, *, then: Callable[[], None] | None = None, action: str = "kill") -> KillAt:
    return KillAt(step, rank, then, action)


def worker_proc(launcher_pid: int, worker_id: str, timeout_s: float = 60) -> psutil.Process:
    """The process of ``worker_id`` under the launcher, once the launcher has started it: the one running its
    script (a spare's warm child, not its warm parent: ``rebuild/warm.py``)."""
    def find() -> psutil.Process | None:
        for p in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if p.environ().get("DEADPOOL_WORKER_ID") == worker_id and p.name() != warm.PARENT_NAME:
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return None

    return wait_until(find, timeout_s, f"worker {worker_id} under launcher pid {launcher_pid}", interval_s=0.05)


def kill_node_agents(shm_root: str) -> None:
    """SIGKILL the node agents holding memory under ``shm_root`` (a test with ``local.keep_after_exit_s``: they
    would otherwise keep it for the whole window after the test)."""
    import glob
    import signal

    from deadpool_ext.memory.agent import PIDFILE

    for pidfile in glob.glob(os.path.join(shm_root, "*", PIDFILE)):
        try:
            os.kill(int(open(pidfile).read().split()[0]), signal.SIGKILL)  # "<pid> <start time>"
        except (ValueError, ProcessLookupError):
            pass


__all__ = ["worker_proc", "kill_node_agents", "pretrain", "pretrain_job", "run_pretrain", "baseline", "kill_at",
           "memory_tier_config",
           "drop_node_memory", "corrupt_file", "wait_for_step", "kill_rank"]


def release_hold_when_grown(proc, timeline: str, marker: str, timeout_s: float) -> None:
    """Elastic grow tests: once the launcher's timeline shows a grown assignment (or the job ended, or
    ``timeout_s`` passed), release the harness's ``hold@step`` fault waiting on ``marker``."""
    from deadpool_ext.recovery.timeline import read_events

    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(timeline) and any(e.get("event") == "assignment" and e.get("grown")
                                            for e in read_events(timeline)):
            break
        time.sleep(0.1)
    with open(marker + ".release", "w") as fh:
        json.dump({"released": time.time()}, fh)
