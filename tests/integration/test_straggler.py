"""Stragglers under deadpool-run (issue 46, part 1), with a real slowdown: the worker's process moved into a cgroup
whose CPU quota is a fraction of one core (``testing/throttle.py``; the kernel's CFS bandwidth control, no sleep in
the code). GPT tiny, ZeRO-1, 2 nodes + 1 spare.

- ``swap``: the throttled node is named and evicted into the spare through the failed-node path (fenced, the
  spare takes its rank, its state from memory), and the losses equal an uninterrupted run's bit for bit;
- ``report`` (the default): the throttled node is only named (``straggler`` events, no failure);
- a uniform slowdown (every worker in the same throttled cgroup) names no one.
"""
from __future__ import annotations

import os
import time

import pytest

from deadpool_ext.recovery.ledger import ledger
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.baselines import BASELINES
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import read_metrics, run_job, wait_for_step
from deadpool_ext.testing.throttle import CpuQuota, quota_unavailable
from deadpool_ext.testing.wait import wait_until
from tests.conftest import make_config
from tests.integration.helpers import worker_proc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(quota_unavailable() is not None, reason=f"no CPU quota: {quota_unavailable()}")]
STAGE = 1
WINDOW_S = 4.0
FRACTION = 0.1
"""The throttled worker's CPU: a tenth of one core (tiny GPT's step on a free core: tens of ms)."""
THROTTLE_AT = 6
"""The step after which the throttle starts (past the start-up: the first steps are slow on every rank)."""


def straggler_job(tmp_path, shm_root, *, name: str, iters: int, spares: int = 1, action: str | None = None,
                  config_action: str | None = None) -> Job:
    """``action``: ``--straggler-action``; ``config_action``: the job's ``deadpool.straggler.action`` instead."""
    section: dict = {"local": {"shm_root": shm_root}}
    if config_action is not None:
        section["straggler"] = {"action": config_action}
    config = make_config(tmp_path, stage=STAGE, deadpool=section)
    flags = ["--straggler-window", str(WINDOW_S), "--straggler-factor", "2"]
    if action is not None:
        flags += ["--straggler-action", action]
    return Job(script="scripts/pretrain_gpt.py", nnodes=2, nproc_per_node=1, spare_nodes=spares,
               shm_root=shm_root, timeline=os.path.join(str(tmp_path), f"{name}.timeline.jsonl"),
               launcher_flags=tuple(flags), config=config, args=("--train-iters", str(iters)),
               metrics=os.path.join(str(tmp_path), f"{name}.jsonl"))


def events_of(job: Job, kind: str) -> list[dict]:
    assert job.timeline is not None
    return [e for e in (read_events(job.timeline) if os.path.exists(job.timeline) else []) if e.get("event") == kind]


def run_throttled(tmp_path, job: Job, workers: list[str], *, until: str, timeout_s: float = 150):
    """Runs ``job``; after step :data:`THROTTLE_AT` the ``workers`` go into one cgroup of :data:`FRACTION` of a core
    until the timeline has an event ``until`` (or the job ends), then out again."""
    assert job.metrics is not None
    seen: dict[str, float] = {}

    def inject(proc):
        wait_for_step(job.metrics, THROTTLE_AT, timeout_s=180, proc=proc)
        with CpuQuota(FRACTION) as quota:
            for wid in workers:
                quota.add(worker_proc(proc.pid, wid).pid)
            seen["throttled_at"] = time.time()
            wait_until(lambda: bool(events_of(job, until)) or proc.poll() is not None, timeout_s,
                       f"a {until!r} event in the timeline while {', '.join(workers)} run at {FRACTION} of a core")

    res = run_job(job.argv(), timeout_s=400, while_running=inject, env=job.env())
    with open(os.path.join(str(tmp_path), f"{os.path.basename(job.metrics)}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_metrics(job.metrics), seen


def test_throttled_node_is_swapped_for_the_spare_with_identical_losses(tmp_path, shm_root):
    """The action comes from the job's config (``deadpool.straggler.action: swap``, written to the store by rank 0
    and read by the coordinator); the window and factor from the flags."""
    iters = 60
    job = straggler_job(tmp_path, shm_root, name="swap", iters=iters, config_action="swap")

    def run_base(base: Job) -> dict[int, float]:
        res = run_job(base.argv(), timeout_s=300, env=base.env())
        assert res.returncode == 0, res.output[-3000:]
        return read_metrics(base.metrics)  # type: ignore[arg-type]

    base = BASELINES.get(straggler_job(tmp_path, shm_root, name="base", iters=iters, spares=0), run_base)
    res, metrics, seen = run_throttled(tmp_path, job, ["node1.0"], until="assignment")
    assert res.returncode == 0, res.output[-4000:]
    [named] = events_of(job, "straggler")
    assert (named["node"], named["decision"], named["action"]) == ("node1", "evicted", "swap"), named
    assert "deadpool.straggler.action" in named["why"], named   # the config's key, not a flag, chose swap
    assert named["ratio"] >= 2 and named["time"] > seen["throttled_at"], named
    [failure] = events_of(job, "failure")
    assert failure["failed"]["node1.0"]["why"].startswith("straggler: "), failure
    [assigned] = [e for e in events_of(job, "assignment") if e.get("generation") == 1]
    assert assigned["replaced"] == {"node1": "spare0"}, assigned
    assert metrics == base   # bit for bit: the spare restored node1's rank from memory
    # the goodput ledger (what deadpool timeline prints and the metrics serve): the straggler's seconds and a
    # recovery of cause straggler
    led = ledger(read_events(job.timeline), time.time())
    assert led.stragglers_named == 1 and led.lost_s["straggler"] > 0, led
    assert [c for (c, _), n in led.recoveries.items() for _ in range(n)] == ["straggler"], led.recoveries


@pytest.mark.full_matrix(covered_by="tests/unit/test_straggler.py::test_a_slow_node_is_named_once_per_window_with_the_"
                                   "seconds_the_job_lost (the report rule) and test_throttled_node_is_swapped_for_the_"
                                   "spare_with_identical_losses (the same naming end to end, then the swap)")
def test_report_names_the_throttled_node_and_keeps_it(tmp_path, shm_root):
    job = straggler_job(tmp_path, shm_root, name="report", iters=200)
    res, _, seen = run_throttled(tmp_path, job, ["node1.0"], until="straggler")
    assert res.returncode == 0, res.output[-4000:]
    named = events_of(job, "straggler")
    assert named and all((e["node"], e["decision"], e["action"]) == ("node1", "named", "report") for e in named)
    assert named[0]["lost_s"] > 0 and named[0]["time"] > seen["throttled_at"]
    assert not events_of(job, "failure") and not [e for e in events_of(job, "assignment") if e.get("generation")]


@pytest.mark.full_matrix(covered_by="tests/unit/test_straggler.py::test_uniform_slowdown_names_no_one (the decision) "
                         "and test_throttled_node_is_swapped_for_the_spare_with_identical_losses (the measurement "
                         "under a real cgroup throttle, end to end)")
def test_uniform_slowdown_evicts_no_one(tmp_path, shm_root):
    """Every worker in one cgroup of a fifth of a core (the whole job slow) for three windows: no one is named."""
    job = straggler_job(tmp_path, shm_root, name="uniform", iters=110, action="swap")
    assert job.metrics is not None
    span: dict[str, float] = {}

    def inject(proc):
        wait_for_step(job.metrics, THROTTLE_AT, timeout_s=180, proc=proc)
        with CpuQuota(2 * FRACTION) as quota:
            for wid in ("node0.0", "node1.0"):
                quota.add(worker_proc(proc.pid, wid).pid)
            span["from"] = time.time()
            wait_until(lambda: time.time() >= span["from"] + 3 * WINDOW_S or proc.poll() is not None, 60,
                       "three straggler windows with every worker throttled")
            span["to"] = time.time()

    res = run_job(job.argv(), timeout_s=400, while_running=inject, env=job.env())
    assert res.returncode == 0, res.output[-4000:]
    assert span["to"] - span["from"] >= 2 * WINDOW_S, span   # the job trained throttled for two windows at least
    assert not events_of(job, "straggler") and not events_of(job, "failure")
