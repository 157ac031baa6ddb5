"""Differential checkpoints in memory (TierCheck): bases every K steps, differentials in between, restored by
replaying the differentials on the base. A killed worker resumes from its own node's memory (local anchor) or,
when its node's memory is gone, from a peer's base and differential replicas (peer anchor), with losses
identical bit for bit to an uninterrupted run."""
from __future__ import annotations

import glob
import json
import os
import socket

import pytest

from deadpool_ext.testing.faults import corrupt_file, drop_node_memory
from tests.conftest import make_config, matrix
from tests.integration.helpers import (
    baseline,
    kill_at,
    memory_tier_config,
    pretrain,
    restore_of,
    summary,
    tagged_json,
)

pytestmark = pytest.mark.slow
ITERS = 10
K = 4
NODE1 = f"{socket.gethostname()}-sim1"


def _cfg(tmp_path, stage, shm_root):
    return memory_tier_config(tmp_path, stage, shm_root, differential={"enabled": True, "base_interval": K})


def _baseline(tmp_path, stage: int, shm_root: str) -> dict[int, float]:
    return baseline(tmp_path, make_config(tmp_path, stage=stage, deadpool=None), iters=ITERS)


def _replayers(restore: dict) -> list[int]:
    """Ranks whose restore replayed differentials: their base is older than the version restored (each replays
    the differentials base+1..version)."""
    return sorted(int(r) for r, b in restore["bases"].items() if b < restore["version"])


@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[2]))  # ZeRO-3: the replay test below
def test_killed_worker_replays_local_differentials(tmp_path, shm_root, stage):
    base = _baseline(tmp_path, stage, shm_root)
    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, stage, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(6), name="fault")
    assert res.returncode == 0, res.output[-4000:]
    r = restore_of(res)  # every rank from its own memory: a base (every K steps) plus the differentials after it
    assert r["outcome"] == "restored" and r["fetched_from"] == {}, r
    assert _replayers(r) == [0, 1] and all(b % K == 0 for b in r["bases"].values()), r
    assert summary(res)["deadpool"]["replayed"] == r["version"] - r["bases"]["0"], r  # rank 0: base+1..version
    assert metrics == base


@pytest.mark.full_matrix(covered_by="tests/unit/test_replay.py (the single-tensor and fused kernels replayed bit for "
                                    "bit, stepwise and fused) and test_killed_worker_replays_local_differentials "
                                    "(the replay end to end in a real job)")
def test_single_tensor_adam_kernel_replays_bit_exact(tmp_path, shm_root):
    """The shipped configs train with torch's fused Adam kernel (``"fused": true``); the other tests replay it.
    Here the single-tensor kernel (torch's CPU default, ``"fused": false``): the differentials record it and the
    replay follows its operation sequence, so a killed worker resumes identical to an uninterrupted run."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        optimizer = json.load(fh)["optimizer"]
    optimizer["params"]["fused"] = False
    plain = make_config(tmp_path, stage=3, deadpool=None, optimizer=optimizer)
    res, base, _ = pretrain(tmp_path, plain, iters=ITERS, name="single_base")
    assert res.returncode == 0 and sorted(base) == list(range(1, ITERS + 1)), res.output[-3000:]
    cfg = make_config(tmp_path, stage=3, optimizer=optimizer, deadpool={
        "snapshot": {"interval": 1}, "replication": {"factor": 1},
        "differential": {"enabled": True, "base_interval": K}, "local": {"shm_root": shm_root, "simulate_nodes": 2}})
    res, metrics, _ = pretrain(tmp_path, cfg, iters=ITERS, max_restarts=1, inject=kill_at(6), name="single")
    assert res.returncode == 0, res.output[-4000:]
    assert _replayers(restore_of(res)), restore_of(res)
    assert metrics == base
    # The kernel matters: the fused kernel gives different floats (so the check above can fail).
    assert _baseline(tmp_path, 3, shm_root) != base


@pytest.mark.parametrize("stage", matrix([2, 3], ci=[3]))  # ZeRO-2 differentials: the local-replay test above
def test_lost_node_memory_replays_peer_differentials(tmp_path, shm_root, stage):
    base = _baseline(tmp_path, stage, shm_root)
    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, stage, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(6, then=lambda: drop_node_memory(shm_root, NODE1)), name="lost")
    assert res.returncode == 0, res.output[-4000:]
    # Rank 1 fetched its base and its differentials from rank 0's replicas (verified, or the restore fails),
    # and replayed them.
    r = restore_of(res)
    assert r["outcome"] == "restored" and r["fetched_from"] == {"1": 0}, r
    assert r["fetched_diffs"] == {"1": list(range(r["bases"]["1"] + 1, r["version"] + 1))}, r
    assert 1 in _replayers(r), r
    assert metrics == base


def test_corrupt_differential_falls_back_to_an_older_version(tmp_path, shm_root):
    """A differential with a flipped byte breaks its chain: the newest version every rank can rebuild is the
    one before it, restored and continued from, still identical to the uninterrupted run."""
    base = _baseline(tmp_path, 3, shm_root)

    def corrupt_newest_diffs():
        for path in glob.glob(os.path.join(shm_root, "deadpool.*", "deadpool.*.d*.r1.*")):
            corrupt_file(path)

    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, 3, shm_root), iters=ITERS, max_restarts=1,
                               inject=kill_at(6, then=corrupt_newest_diffs), name="corrupt")
    assert res.returncode == 0, res.output[-4000:]
    # Every differential of rank 1 (its ring and rank 0's replicas of it) is refused: the newest version both
    # ranks can rebuild is the base of step K, restored without a replay (else differentials K+1.. are replayed:
    # test_killed_worker_replays_local_differentials).
    r = restore_of(res)
    assert r["outcome"] == "restored" and r["version"] == K and r["bases"] == {"0": K, "1": K}, r
    assert metrics == base


@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[3]))  # ZeRO-2: the test above; ZeRO-1: elsewhere
def test_replay_in_place_equals_the_live_state(tmp_path, shm_root, stage):
    """Train 6 steps (base 4, differentials 5 and 6), wreck the live state, restore: every tensor, counter and
    a forward pass equal what they were, bit for bit."""

    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port, run_job

    job = Job(launcher="torchrun", script="tests/integration/workers/differential_equality.py", nproc_per_node=2,
              port=free_port(), args=(_cfg(tmp_path, stage, shm_root), "6"))
    res = run_job(job.argv(), timeout_s=300, env=job.env())
    assert not res.timed_out and res.returncode == 0, res.output[-4000:]
    results = tagged_json(res.output, "RESULT")
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["replayed"] == 2 for r in results), results
    sizes = [(r["diff_nbytes"], r["base_nbytes"]) for r in results]
    # A differential holds the gradients: one master-sized tensor, where a base holds three (master and Adam's
    # two moments; the parameter buffers are re-derived, snapshot.derive_params). Headers add a little on tiny.
    assert sizes and all(int(d) <= 0.38 * int(b) for d, b in sizes), sizes
