"""Across tiers: a relaunch with ``--load`` (tier 3) under torchrun restarts also finds the memory tiers; the
newest version every rank can obtain wins, and a memory state no version of which every rank can rebuild
falls back to the tier-3 base (the job's summary says which: ``loaded_step``, ``start_step`` and the runtime's
``stats()["restore"]``). Losses stay identical to an uninterrupted run."""
from __future__ import annotations

import glob
import json
import os

import pytest

from deadpool_ext.testing.faults import corrupt_file
from tests.conftest import make_config
from tests.integration.helpers import baseline, kill_at, pretrain, summary

pytestmark = pytest.mark.slow
ITERS = 12


def _cfg(tmp_path, shm_root, factor):
    return make_config(tmp_path, stage=3, deadpool={
        "replication": {"factor": factor}, "local": {"shm_root": shm_root, "simulate_nodes": 2}})


def _base(tmp_path):
    return baseline(tmp_path, make_config(tmp_path, stage=3, deadpool=None), iters=ITERS)


def _args(tmp_path):
    ckpt = os.path.join(str(tmp_path), "ckpt")
    return ["--save", ckpt, "--save-interval", "4", "--load", ckpt]


def test_newest_version_across_tiers_wins(tmp_path, shm_root):
    base = _base(tmp_path)
    res, metrics, path = pretrain(tmp_path, _cfg(tmp_path, shm_root, 1), iters=ITERS, max_restarts=1,
                                  extra=_args(tmp_path), inject=kill_at(8), name="both")
    assert res.returncode == 0, res.output[-4000:]
    with open(path) as fh:  # first launch, --load = --save with no base there yet: trained from step 0
        assert json.loads(fh.readline())["step"] == 1
    s = summary(res)  # the restart: loaded a tier-3 base, and the newer of it and the memory tiers' version
    r = s["deadpool"]["restore"]
    assert s["loaded_step"] in (4, 8) and r["tier3_base"] == s["loaded_step"], s
    assert (r["outcome"] == "restored" and r["version"] > s["loaded_step"]) or r["outcome"] == "kept_tier3_base", r
    assert s["start_step"] == max(s["loaded_step"], r["version"]) and s["start_step"] >= 7, s
    assert metrics == base


def test_memory_without_a_common_version_falls_back_to_tier3(tmp_path, shm_root):
    base = _base(tmp_path)

    def corrupt_rank1_memory():
        for path in glob.glob(os.path.join(shm_root, "deadpool.*", "deadpool.*.snap.r1.*")):
            corrupt_file(path)

    res, metrics, _ = pretrain(tmp_path, _cfg(tmp_path, shm_root, 0), iters=ITERS, max_restarts=1,
                               extra=_args(tmp_path), inject=kill_at(8, then=corrupt_rank1_memory), name="fallback")
    assert res.returncode == 0, res.output[-4000:]
    s = summary(res)
    r = s["deadpool"]["restore"]
    # Rank 1's slot is refused (checksum), no replica (factor 0): no version every rank can restore, so the job
    # goes on from the tier-3 base it loaded.
    assert [(p["rank"], p["from"]) for p in r["refused_before_use"]] == [(1, "local")], r
    assert "checksum mismatch" in r["refused_before_use"][0]["why"], r
    assert r["outcome"] == "no_common_version", r
    assert s["loaded_step"] is not None and s["start_step"] == s["loaded_step"], s
    assert metrics == base
