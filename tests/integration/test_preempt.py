"""Preemption without loss (issue 46, part 3), end to end: real SIGTERMs to a deadpool-run job of the GPT script.

- SIGTERM to the launcher mid-run: every rank stops at one step boundary, the step is persisted to tier 3 and
  verified, the job exits 75; the next start with ``--load`` resumes from that step, and the losses of both runs
  together equal an uninterrupted run's bit for bit.
- SIGTERM to one worker only (as a node's own kubelet or slurmstepd sends it): the whole job drains the same way,
  nobody is fenced or replaced by the spare.
"""
from __future__ import annotations

import os
import signal

from deadpool_ext.persist.layout import list_versions, verify_version
from deadpool_ext.persist.storage import open_storage
from deadpool_ext.preempt.decide import PREEMPTED_EXIT
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import read_metrics, run_job, wait_for_step
from tests.conftest import make_config
from tests.integration.helpers import JOB_TIMEOUT_S, baseline, summary, worker_proc

ITERS = 24


def _job(tmp_path, shm_root: str, name: str, config: str, ckpt: str, *, spares: int = 0,
         extra: tuple[str, ...] = ()) -> Job:
    return Job(script="scripts/pretrain_gpt.py", nnodes=2, nproc_per_node=1, spare_nodes=spares or None,
               shm_root=shm_root, timeline=os.path.join(str(tmp_path), f"{name}.timeline.jsonl"), config=config,
               args=("--train-iters", str(ITERS), "--save", ckpt, *extra),
               metrics=os.path.join(str(tmp_path), f"{name}.jsonl"))


def _run(tmp_path, job: Job, name: str, signal_to=None):
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(), while_running=signal_to)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    assert job.timeline is not None and job.metrics is not None
    return res, read_metrics(job.metrics), read_events(job.timeline)


def _drained(events: list[dict]) -> tuple[dict, dict]:
    """The launcher's and rank 0's ``drained`` events (one each)."""
    launcher = [e for e in events if e.get("event") == "drained" and e.get("source") == "launcher"]
    worker = [e for e in events if e.get("event") == "drained" and e.get("source") != "launcher"]
    assert len(launcher) == 1 and len(worker) == 1, events
    return launcher[0], worker[0]


def test_sigterm_to_the_launcher_mid_run_persists_the_step_and_load_resumes_bit_for_bit(tmp_path, shm_root):
    config = make_config(tmp_path)
    base = baseline(tmp_path, config, iters=ITERS)
    ckpt = os.path.join(str(tmp_path), "ckpt")
    job = _job(tmp_path, shm_root, "preempted", config, ckpt)

    def sigterm_launcher(proc) -> None:
        wait_for_step(job.metrics, 4, timeout_s=JOB_TIMEOUT_S, proc=proc)
        proc.send_signal(signal.SIGTERM)

    res, first, events = _run(tmp_path, job, "preempted", sigterm_launcher)
    assert res.returncode == PREEMPTED_EXIT, res.output[-4000:]
    launcher, rank0 = _drained(events)
    step = rank0["step"]
    assert 4 <= step < ITERS and rank0["persisted"] == step and launcher["persisted"] == launcher["safe"] == step
    assert launcher["status"] == PREEMPTED_EXIT and launcher["killed_late"] == []
    assert rank0["seconds"] < 25.0  # SIGTERM -> verified commit record, within the default budget
    storage = open_storage(ckpt, create=False)
    newest = max(v.version for v in list_versions(storage) if v.commit is not None)
    assert newest == step
    assert sorted(first) == list(range(1, step + 1))   # the drained step's own metrics line was written

    again = job.replace(args=(*job.args, "--load", ckpt), metrics=os.path.join(str(tmp_path), "resumed.jsonl"),
                        timeline=os.path.join(str(tmp_path), "resumed.timeline.jsonl"))
    res2, second, _ = _run(tmp_path, again, "resumed")
    assert res2.returncode == 0, res2.output[-4000:]
    assert summary(res2)["loaded_step"] == step
    assert sorted(second) == list(range(step + 1, ITERS + 1))
    assert {**first, **second} == base   # bit for bit: float equality of every step's loss


def test_sigterm_to_one_worker_only_drains_the_whole_job_without_a_swap(tmp_path, shm_root):
    config = make_config(tmp_path)
    ckpt = os.path.join(str(tmp_path), "ckpt")
    job = _job(tmp_path, shm_root, "worker", config, ckpt, spares=1)

    def sigterm_worker(proc) -> None:
        wait_for_step(job.metrics, 3, timeout_s=JOB_TIMEOUT_S, proc=proc)
        worker_proc(proc.pid, "node1.0").send_signal(signal.SIGTERM)

    res, _, events = _run(tmp_path, job, "worker", sigterm_worker)
    assert res.returncode == PREEMPTED_EXIT, res.output[-4000:]
    asked = [e for e in events if e.get("event") == "drain"]
    assert [e["by"] for e in asked] == ["SIGTERM to worker node1.0"], asked
    launcher, rank0 = _drained(events)
    assert rank0["persisted"] == launcher["safe"] == rank0["step"] >= 3
    assert not [e for e in events if e.get("event") in ("failure", "recover", "assignment")], events
    storage = open_storage(ckpt, create=False)
    info = [v for v in list_versions(storage) if v.version == rank0["step"]]
    assert len(info) == 1 and info[0].commit is not None and verify_version(storage, info[0]) == []


def test_a_budget_too_short_publishes_nothing_partial_and_says_what_is_safe(tmp_path, shm_root):
    """A base is being written (throttled to 0.2 MiB/s: seconds) when the SIGTERM comes with a 1 s budget: the
    drain cannot write its step; nothing half-written is published (no commit record anywhere), the job still ends
    with 75 and the outcome says no step is safe on tier 3."""
    config = make_config(tmp_path, deadpool={"snapshot": {"interval": 1}, "replication": {"factor": 1},
                                             "persist": {"interval": 2, "max_mb_s": 0.2, "adaptive": False}})
    ckpt = os.path.join(str(tmp_path), "ckpt")
    job = _job(tmp_path, shm_root, "short", config, ckpt).replace(launcher_flags=("--preempt-grace-s", "1"))

    def sigterm_launcher(proc) -> None:
        wait_for_step(job.metrics, 3, timeout_s=JOB_TIMEOUT_S, proc=proc)
        proc.send_signal(signal.SIGTERM)

    res, _, events = _run(tmp_path, job, "short", sigterm_launcher)
    assert res.returncode == PREEMPTED_EXIT, res.output[-4000:]
    launcher = [e for e in events if e.get("event") == "drained" and e.get("source") == "launcher"]
    assert len(launcher) == 1 and launcher[0]["persisted"] is None and launcher[0]["safe"] is None, events
    rank0 = [e for e in events if e.get("event") == "drained" and e.get("source") != "launcher"]
    assert all(e["persisted"] is None for e in rank0), rank0   # none, or one that says it wrote nothing
    storage = open_storage(ckpt, create=False)
    assert [v.version for v in list_versions(storage) if v.commit is not None] == []
