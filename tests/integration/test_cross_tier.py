"""Across tiers: a relaunch with ``--load`` (tier 3) under torchrun restarts also finds the memory tiers; the
newest version every rank can obtain wins, and a memory state no version of which every rank can rebuild
falls back to the tier-3 base, with a log line saying so. Losses stay identical to an uninterrupted run."""
from __future__ import annotations

import glob
import os

import pytest

from deadpool_ext.testing.faults import corrupt_file
from tests.conftest import make_config
from tests.integration.helpers import kill_at, pretrain

pytestmark = pytest.mark.slow
ITERS = 12
_baseline: dict[str, dict[int, float]] = {}


def _cfg(tmp_path, shm_root, factor):
    return make_config(tmp_path, stage=3, deadpool={
        "replication": {"factor": factor}, "local": {"shm_root": shm_root, "simulate_nodes": 2}})


def _base(tmp_path):
    if "m" not in _baseline:
        res, metrics, _ = pretrain(tmp_path, make_config(tmp_path, stage=3, deadpool=None), iters=ITERS, name="base")
        assert res.returncode == 0, res.output[-3000:]
        _baseline["m"] = metrics
    return _baseline["m"]


def _args(tmp_path):
    ckpt = os.path.join(str(tmp_path), "ckpt")
    return ["--save", ckpt, "--save-interval", "4", "--load", ckpt]


def test_newest_version_across_tiers_wins(tmp_path, shm_root):
    base = _base(tmp_path)
    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, shm_root, 1), iters=ITERS, max_restarts=1,
                               extra=_args(tmp_path), inject=kill_at(8), name="both")
    assert res.returncode == 0, res.output[-4000:]
    assert "no complete base there yet; starting from step 0" in res.output  # first launch: --load = --save
    assert "resumed from checkpoint" in res.output, res.output[-4000:]  # the restart loaded a tier-3 base
    assert ("resumed from in-memory snapshot" in res.output or "not newer than the tier-3 base" in res.output)
    assert metrics == base


def test_memory_without_a_common_version_falls_back_to_tier3(tmp_path, shm_root):
    base = _base(tmp_path)

    def corrupt_rank1_memory():
        for path in glob.glob(os.path.join(shm_root, "deadpool.*", "deadpool.*.snap.r1.*")):
            corrupt_file(path)

    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, shm_root, 0), iters=ITERS, max_restarts=1,
                               extra=_args(tmp_path), inject=kill_at(8, then=corrupt_rank1_memory), name="fallback")
    assert res.returncode == 0, res.output[-4000:]
    assert "checksum mismatch" in res.output, res.output[-4000:]
    assert "continuing from the tier-3 base of step" in res.output, res.output[-4000:]
    assert metrics == base
