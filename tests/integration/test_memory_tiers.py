"""Memory tiers: a SIGKILLed worker under torchrun --max-restarts 1 resumes from tier 1 (own node's shared
memory) or tier 2 (a peer node's replica, when its node's memory is gone), with a loss trajectory identical
bit for bit to an uninterrupted run, for ZeRO-1, 2 and 3."""
from __future__ import annotations

import glob
import json
import os
import socket

import pytest

from deadpool_ext.testing.faults import corrupt_file, drop_node_memory
from tests.conftest import make_config, matrix
from tests.integration.helpers import baseline, kill_at, kill_node_agents, memory_tier_config, pretrain, restore_of

pytestmark = pytest.mark.slow
ITERS = 10
NODE1 = f"{socket.gethostname()}-sim1"
_cfg = memory_tier_config


def _baseline(tmp_path, stage: int, shm_root: str) -> dict[int, float]:
    return baseline(tmp_path, _cfg(tmp_path, stage, shm_root), iters=ITERS)


@pytest.mark.full_matrix(covered_by="test_relaunch_under_the_deepspeed_launcher_restores_from_memory (ZeRO-3: every "
                                    "rank from its own node's memory, nothing fetched, identical losses) and "
                                    "tests/integration/test_existing_jobs.py's torchrun restarts")
@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[3]))  # ZeRO-1: the test below
def test_restart_restores_from_tier1(tmp_path, shm_root, stage):
    base = _baseline(tmp_path, stage, shm_root)
    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, stage, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(4), name="fault")
    assert res.returncode == 0, res.output[-4000:]
    r = restore_of(res)  # every rank from its own node's memory: nothing fetched from a peer
    assert r["outcome"] == "restored" and r["fetched_from"] == {} and not r["refused_before_use"], r
    assert metrics == base


@pytest.mark.full_matrix(covered_by="every hot-swap test (the spare restores the lost rank from its peer replica: "
                         "test_hot_swap.py, ZeRO-3) and tests/integration/test_elastic.py::test_shrink_reshards_from_"
                         "memory_element_exact (ZeRO-1: the lost rank's state read from peer memory)")
@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[1]))
def test_lost_node_memory_restores_from_tier2(tmp_path, shm_root, stage):
    base = _baseline(tmp_path, stage, shm_root)
    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, stage, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(4, then=lambda: drop_node_memory(shm_root, NODE1)), name="lost")
    assert res.returncode == 0, res.output[-4000:]
    # Rank 1 fetched its state from rank 0's replica (tier 2); a fetched copy is verified before use (a bad
    # one would be refused, or fail the restore).
    r = restore_of(res)
    assert r["outcome"] == "restored" and r["fetched_from"] == {"1": 0} and not r["refused_before_use"], r
    assert metrics == base


def test_corrupt_tier1_falls_back_to_peer(tmp_path, shm_root):
    base = _baseline(tmp_path, 3, shm_root)

    def corrupt_rank1_slots():
        for path in glob.glob(os.path.join(shm_root, f"deadpool.*.{NODE1}", "deadpool.*.snap.r1.*")):
            corrupt_file(path)

    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, 3, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(4, then=corrupt_rank1_slots), name="corrupt")
    assert res.returncode == 0, res.output[-4000:]
    # Rank 1's own slot was refused by the check before use (checksum), and its state fetched from rank 0.
    r = restore_of(res)
    refused = r["refused_before_use"]
    assert [(p["rank"], p["from"]) for p in refused] == [(1, "local")] and "checksum mismatch" in refused[0]["why"], r
    assert r["outcome"] == "restored" and r["fetched_from"] == {"1": 0}, r
    assert metrics == base


@pytest.mark.parametrize("stage,bf16,gas,derive", matrix(
    [(1, False, 1, True), (2, True, 2, True), (3, False, 1, True), (3, True, 1, True), (3, False, 1, False)],
    ci=[(1, False, 1, True), (2, True, 2, True), (3, False, 1, False)]))
def test_snapshot_equals_live_state(tmp_path, shm_root, stage, bf16, gas, derive):
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, run_job
    extra = {"gradient_accumulation_steps": gas}
    if bf16:
        extra["bf16"] = {"enabled": True}
    cfg = make_config(tmp_path, stage=stage, deadpool={"local": {"shm_root": shm_root, "simulate_nodes": 2},
                                                       "snapshot": {"derive_params": derive}}, **extra)
    out = tmp_path / "results"
    out.mkdir()
    job = Job(launcher="torchrun", script="tests/integration/workers/snapshot_equality.py", nproc_per_node=2,
              port=free_port(), args=(cfg, "3", str(out)))
    res = run_job(job.argv(), timeout_s=300, env=job.env())
    errors = [line for line in res.output.splitlines() if "Error" in line or "assert" in line]
    assert res.returncode == 0, "\n".join(errors[:40]) + res.output[-2000:]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["tensors_equal"] for r in results), results
    if bf16:
        assert all("torch.bfloat16" in r["dtypes"] for r in results), results


@pytest.mark.full_matrix(covered_by="tests/unit/test_ds_wrappers.py::test_real_engine_wrappers_snapshot_and_restore_"
                                    "bit_identical[bf16-zero3] (bf16 ZeRO-3 state through a snapshot and back, real "
                                    "engines), test_snapshot_equals_live_state (bf16 captured as the live state), "
                                    "test_lost_node_memory_restores_from_tier2 (a lost node's state from its peer)")
def test_bf16_zero3_lost_node_identical(tmp_path, shm_root):
    cfg = make_config(tmp_path, stage=3, bf16={"enabled": True}, deadpool={
        "local": {"shm_root": shm_root, "simulate_nodes": 2}})
    res, base, _ = pretrain(tmp_path, cfg, iters=8, name="bf16base")
    assert res.returncode == 0, res.output[-3000:]
    res, metrics, _ = pretrain(tmp_path, cfg, iters=8, max_restarts=1, name="bf16lost",
                               inject=kill_at(3, then=lambda: drop_node_memory(shm_root, NODE1)))
    assert res.returncode == 0, res.output[-4000:]
    assert restore_of(res)["fetched_from"] == {"1": 0}
    assert metrics == base and len(base) == 8


def test_relaunch_under_the_deepspeed_launcher_restores_from_memory(tmp_path, shm_root):
    """DeepSpeed's launcher ends the whole job when a worker dies and never restarts it. With
    local.keep_after_exit_s the node agent keeps tier 1 for a while; relaunching the same command (same master
    port, hence the same job id) restores from it, losses identical to an uninterrupted run."""
    from deadpool_ext.chaos import at_step
    from deadpool_ext.chaos.at_step import StepFault
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, read_metrics, run_job

    stage = 3
    base = _baseline(tmp_path, stage, shm_root)
    cfg = make_config(tmp_path, stage=stage, deadpool={
        "snapshot": {"interval": 1}, "local": {"shm_root": shm_root, "keep_after_exit_s": 120}})
    metrics = os.path.join(str(tmp_path), "ds_relaunch.jsonl")
    job = Job(launcher="deepspeed", script="scripts/pretrain_gpt.py", nproc_per_node=2, port=free_port(),
              config=cfg, args=("--train-iters", str(ITERS)), metrics=metrics,
              env_vars=at_step.harness_env({at_step.ENV: StepFault("kill", 4, 1, os.path.join(str(tmp_path),
                                                                                             "ds.fault")).render()}))
    cmd, env = job.argv(), job.env()
    try:
        first = run_job(cmd, timeout_s=300, env=env)
        assert first.returncode != 0 and not first.timed_out, first.output[-3000:]
        assert max(read_metrics(metrics)) < ITERS
        second = run_job(cmd, timeout_s=300, env=env)  # the fault fires once per job (its marker exists)
        assert second.returncode == 0, second.output[-4000:]
        # The relaunch (a new job's processes) restored from the first run's memory, kept by the node agent.
        r = restore_of(second)
        assert r["outcome"] == "restored" and r["fetched_from"] == {} and r["version"] >= 3, r
        assert read_metrics(metrics) == base
    finally:  # the agents would otherwise hold the memory for the whole window after the test
        kill_node_agents(shm_root)
