"""Under a real Slurm (``slurmctld``, one ``slurmd`` per namespace host, munge): the docs' sbatch script
(``scripts/slurm/deadpool.sbatch``) runs unchanged on 3 nodes + 1 spare (``sbatch --nodes 4``, the allocation's
fourth node the spare), and what Slurm does to a job leaves the losses of a run without failure, bit for bit."""
from __future__ import annotations

import pytest

from deadpool_ext.testing.baselines import BASELINES
from deadpool_ext.testing.slurm import SlurmBed
from deadpool_ext.testing.slurmjob import SlurmRun, run_sbatch
from tests.multihost.jobs import LEADER_TTL_S, run_hosts, training_job

pytestmark = pytest.mark.slow

NODES, SPARES = 4, 1


def baseline(host_bed, tmp_path) -> dict[int, float]:
    """The fault-free run of the 3-node job (the one cache, the same key as test_host_faults' baseline)."""
    def run(_job) -> dict[int, float]:
        bed = host_bed(3)
        res = run_hosts(bed, tmp_path, name="base", spares=0)
        assert res.rcs == [0, 0, 0], res.tails()
        bed.close()
        return res.metrics

    return BASELINES.get(training_job(tmp_path, name="base"), run)


def submit(slurm: SlurmBed, tmp_path, name: str, **kw) -> SlurmRun:
    job = training_job(tmp_path, nnodes=NODES - SPARES, name=name)
    assert job.metrics is not None
    return run_sbatch(slurm, str(tmp_path), job.script_argv(), job.metrics, nodes=NODES, spares=SPARES, name=name,
                      launcher_flags=("--leader-ttl-s", str(LEADER_TTL_S), "--detect-timeout-s", "8"), **kw)


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
