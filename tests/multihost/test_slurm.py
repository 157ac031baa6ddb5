"""Under a real Slurm (``slurmctld``, one ``slurmd`` per namespace host, munge): the docs' sbatch script
(``scripts/slurm/deadpool.sbatch``) runs unchanged on 3 nodes + 1 spare (``sbatch --nodes 4``, the allocation's
fourth node the spare), and what Slurm does to a job leaves the losses of a run without failure, bit for bit."""
from __future__ import annotations

import json
import os

import pytest

from deadpool_ext.chaos.at_step import ENV, harness_env
from deadpool_ext.preempt.decide import PREEMPTED_EXIT
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.baselines import BASELINES
from deadpool_ext.testing.slurm import SlurmBed
from deadpool_ext.testing.slurmjob import SlurmRun, run_sbatch
from deadpool_ext.testing.wait import wait_until
from tests.multihost.jobs import LEADER_TTL_S, run_hosts, training_job

pytestmark = pytest.mark.slow

NODES, SPARES = 4, 1
CRED_EXPIRE_S = 5
"""The bed's credential lifetime: also how long Slurm holds a requeued job before it may start again (its default,
120 s, is the bench's and docs/slurm.md's figure)."""


def baseline(host_bed, tmp_path) -> dict[int, float]:
    """The fault-free run of the 3-node job (the one cache, the same key as test_host_faults' baseline)."""
    def run(_job) -> dict[int, float]:
        bed = host_bed(3)
        res = run_hosts(bed, tmp_path, name="base", spares=0)
        assert res.rcs == [0, 0, 0], res.tails()
        bed.close()
        return res.metrics

    return BASELINES.get(training_job(tmp_path, name="base"), run)


def submit(slurm: SlurmBed, tmp_path, name: str, *, script_args: tuple[str, ...] = (),
           launcher_flags: tuple[str, ...] = (), **kw) -> SlurmRun:
    job = training_job(tmp_path, nnodes=NODES - SPARES, name=name)
    job = job.replace(args=(*job.args, *script_args))
    assert job.metrics is not None
    return run_sbatch(slurm, str(tmp_path), job.script_argv(), job.metrics, nodes=NODES, spares=SPARES, name=name,
                      launcher_flags=("--leader-ttl-s", str(LEADER_TTL_S), "--detect-timeout-s", "8",
                                      *launcher_flags), **kw)


def replaced(res: SlurmRun) -> list[dict[str, str]]:
    return [e["replaced"] for e in res.events if e.get("event") == "assignment"]


def test_node_lost_whole(host_bed, slurm_bed, tmp_path):
    """Node 2's slurmd and every process on it SIGKILLed (the machine gone): the other launchers lose its lease,
    the allocation's spare node takes node2's rank in place and the job completes (exit 0) with the losses of the
    uninterrupted run. Slurm marks the node down and, the job being --no-kill, removes it from the allocation
    instead of ending the job."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES)
    res = submit(slurm, tmp_path, "nodelost", fault=lambda s, _: s.kill_node(2))
    assert res.metrics == base, res.tail()
    assert replaced(res) == [{"node2": "spare0"}], res.tail()
    assert (res.job["JobState"], res.job["ExitCode"]) == ("COMPLETED", "0:0"), res.tail()
    assert slurm.wait_node_state(2, "down", 30)
    assert slurm.job(res.job_id)["NodeList"] == slurm.hostlist([0, 1, 3])


def test_worker_killed_embedded_store(host_bed, slurm_bed, tmp_path):
    """node1's worker SIGKILLed, on the embedded store (the first node's launcher serves it, the others derive its
    address from SLURM's node list): the spare node takes rank 1, node1's launcher stays; Slurm sees nothing
    (the job completes, no node down)."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES)
    res = submit(slurm, tmp_path, "workerkilled", store="embedded", fault=lambda s, _: s.kill_worker(1, "node1.0"))
    assert res.metrics == base, res.tail()
    assert replaced(res) == [{"node1": "spare0"}], res.tail()
    [start] = [e for e in res.events if e.get("event") == "start"]
    assert (start["store"].split("://")[0], start["hosts"], start["spare_nodes"]) == ("dp", NODES, ["spare0"])
    assert (res.job["JobState"], res.job["ExitCode"]) == ("COMPLETED", "0:0"), res.tail()
    assert set(slurm.node_states().values()) == {"idle"}


@pytest.mark.full_matrix(covered_by="test_node_lost_whole (Slurm removes a down node from the --no-kill job and the "
                         "spare takes its rank, losses bit for bit)")
def test_node_set_down(host_bed, slurm_bed, tmp_path):
    """``scontrol update nodename=X state=down`` on node 2 while it trains: slurmctld removes the node from the
    --no-kill job and SIGKILLs its part of the step; the spare takes its rank, the losses are the uninterrupted
    run's. The killed launcher's status (137) is srun's, so Slurm records the job as FAILED 137 although it
    trained to its last step (docs/slurm.md)."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES)
    res = submit(slurm, tmp_path, "setdown", fault=lambda s, _: s.set_down(2))
    assert res.metrics == base, res.tail()
    assert replaced(res) == [{"node2": "spare0"}], res.tail()
    assert res.job["NodeList"] == slurm.hostlist([0, 1, 3]), res.tail()
    assert (res.job["JobState"], res.job["ExitCode"]) == ("FAILED", "137:0"), res.tail()
    assert [e for e in res.events if e.get("event") == "finished"], res.tail()


@pytest.mark.parametrize("how", [
    "preempted",
    pytest.param("scancel", marks=pytest.mark.full_matrix(
        covered_by="the preempted case (the same drain and requeue; here the batch script requeues on exit 75)")),
])
def test_drained_by_slurm_then_requeued(host_bed, slurm_bed, tmp_path, how):
    """``preempted``: a job of the ``urgent`` partition (a higher PriorityTier, PreemptMode=REQUEUE) needs every
    node while the training job is held after step 4; ``scancel``: ``scancel --signal=TERM`` at that point (not
    ``--full``: that signals srun too, which answers a SIGTERM by killing the step at once, no drain).
    Slurm SIGTERMs the training job's step, the launchers drain it (the newest step persisted to tier 3 and
    verified, exit 75 within KillWait), the job is requeued (by Slurm for a preemption, by the sbatch script on 75
    for the signal), and the requeued run, the same command line (its ``--load`` names the directory its ``--save``
    writes), resumes from that step by itself: the losses of both runs together are the uninterrupted run's, bit
    for bit."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES, cred_expire_s=CRED_EXPIRE_S)
    ckpt, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")

    def preempt(s: SlurmBed, run: SlurmRun) -> None:
        wait_until(lambda: os.path.exists(hold), 60, "rank 0 held after step 4")
        if how == "scancel":
            s.cmd("scancel", "--signal=TERM", run.job_id)
        else:
            s.cmd("sbatch", "--parsable", "--partition", "urgent", "--nodes", str(NODES), "--output", "/dev/null",
                  "--wrap", "true")
        wait_until(lambda: any(e.get("event") == "drain" for e in read_events(run.timeline)), 60,
                   "the launchers' drain after Slurm's SIGTERM")
        open(hold + ".release", "w").close()

    res = submit(slurm, tmp_path, how, fault=preempt, fault_step=3,
                 script_args=("--save", ckpt, "--load", ckpt), launcher_flags=("--preempt-grace-s", "6"),
                 env=harness_env({ENV: f"hold@step=4,rank=0,marker={hold}"}),
                 end_states=("COMPLETED", "FAILED", "CANCELLED"))
    assert (res.job["JobState"], res.job["Restarts"]) == ("COMPLETED", "1"), res.tail()
    starts = [e for e in res.events if e.get("event") == "start"]
    assert [e["job_id"] for e in starts] == [f"slurm{res.job_id}", f"slurm{res.job_id}r1"], starts
    drained = [e for e in res.events if e.get("event") == "drained" and e.get("source") == "launcher"]
    assert {e["status"] for e in drained} == {PREEMPTED_EXIT}, drained
    assert {(e["safe"], e["persisted"]) for e in drained if e["step"] is not None} == {(drained[0]["safe"],) * 2}
    safe = drained[0]["safe"]
    assert safe is not None and 4 <= safe < 10, drained
    assert res.metrics == base, res.tail()
    assert not [e for e in res.events if e.get("event") == "assignment"], res.tail()   # no node was replaced


def test_cancelled_by_scancel_persists_then_the_next_submission_resumes(host_bed, slurm_bed, tmp_path):
    """``scancel JOB``, a plain cancel (issue 47): Slurm SIGTERMs the job's processes and SIGKILLs them after
    ``KillWait``. The launchers drain within it (the newest step persisted to tier 3 and verified), and the job ends
    CANCELLED: it is not requeued. The user's next ``sbatch`` of the same command line (its ``--load`` names the
    directory its ``--save`` writes) resumes from that step by itself: the losses of both runs together are the
    uninterrupted run's, bit for bit."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES, cred_expire_s=CRED_EXPIRE_S)
    ckpt, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")

    def cancel(s: SlurmBed, run: SlurmRun) -> None:
        wait_until(lambda: os.path.exists(hold), 60, "rank 0 held after step 4")
        s.cmd("scancel", run.job_id)
        wait_until(lambda: any(e.get("event") == "drain" for e in read_events(run.timeline)), 60,
                   "the launchers' drain after Slurm's SIGTERM")
        open(hold + ".release", "w").close()

    common = {"script_args": ("--save", ckpt, "--load", ckpt), "launcher_flags": ("--preempt-grace-s", "6")}
    first = submit(slurm, tmp_path, "cancelled", fault=cancel, fault_step=3, **common,
                   env=harness_env({ENV: f"hold@step=4,rank=0,marker={hold}"}),
                   end_states=("COMPLETED", "FAILED", "CANCELLED"))
    assert (first.job["JobState"], first.job["Restarts"]) == ("CANCELLED", "0"), first.tail()
    drained = [e for e in first.events if e.get("event") == "drained" and e.get("source") == "launcher"]
    safe = drained[0]["safe"] if drained else None
    assert safe is not None and 4 <= safe < 10 and {e["persisted"] for e in drained if e["step"] is not None} == \
        {safe}, (drained, first.tail())
    second = submit(slurm, tmp_path, "cancelled", **common)   # the user submits the same command line again
    assert second.job["JobState"] == "COMPLETED", second.tail()
    assert second.metrics == base, second.tail()   # steps 1..safe from the first run, the rest from the second
    # resumed from the drained step, not from step 0: no step up to it was trained twice
    job = training_job(tmp_path, nnodes=NODES - SPARES, name="cancelled")
    assert job.metrics is not None
    with open(job.metrics) as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert all(steps.count(s) == 1 for s in range(1, safe + 1)) and max(steps) == 10, steps


@pytest.mark.full_matrix(covered_by="test_node_lost_whole (a node lost with a spare left); the no-spare decisions: "
                                    "tests/unit/test_decide.py")
def test_more_nodes_lost_than_spares(host_bed, slurm_bed, tmp_path):
    """Nodes 1 and 2 lost at once with one spare: the spare takes one, none is left for the other, and under the
    default --no-spare-policy fail the job stops (cause out_of_spares, not a script error); the steps trained
    before the loss are the uninterrupted run's. Slurm ends the job as failed."""
    base = baseline(host_bed, tmp_path)
    slurm = slurm_bed(NODES)

    def two_nodes(s: SlurmBed, _run: SlurmRun) -> None:
        s.kill_node(1)
        s.kill_node(2)

    res = submit(slurm, tmp_path, "twolost", fault=two_nodes)
    [stopped] = [e for e in res.events if e.get("event") == "stopped"]
    assert stopped["cause"] == "out_of_spares", stopped
    assert res.job["JobState"] == "FAILED", res.tail()
    assert res.metrics and all(res.metrics[s] == base[s] for s in res.metrics), res.tail()
