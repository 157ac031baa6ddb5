from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

from deadpool_ext.testing.launch import REPO, free_port

# The demo GPT of every job the suite launches is the plain-PyTorch one (deadpool_ext/training/models.py, TorchGPT):
# the same architecture without transformers' import, about 1.7 s of CPU less per worker process, and the suite
# starts several hundred. Tests compare runs of one implementation with runs of the same; the Hugging Face model
# is still what the Trainer tests, BERT and the tier-3 export test train. Benchmarks keep the default (hf).
os.environ.setdefault("DEADPOOL_GPT_IMPL", "torch")

FULL_MATRIX = os.environ.get("DEADPOOL_FULL_MATRIX", "") == "1"
"""Run every combination of the end-to-end matrices (ZeRO stage x fault x framework); by default a fixed subset."""


def matrix(values: list, ci: list) -> list:
    """The values of an end-to-end test matrix this run covers: all of them with ``DEADPOOL_FULL_MATRIX=1``,
    else the fixed subset ``ci`` (chosen so the suite fits CI's 30 minutes while every stage, fault and
    framework is still exercised by some test of the module). The subset is explicit, never random: a CI failure
    replays as it ran."""
    missing = [v for v in ci if v not in values]
    assert not missing, f"matrix subset {missing} not among {values}"
    return list(values) if FULL_MATRIX else [v for v in values if v in ci]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``full_matrix(covered_by=...)`` run only with ``DEADPOOL_FULL_MATRIX=1`` (deselected, as the
    matrix subsets leave combinations out); the marker must name what covers them in CI."""
    if FULL_MATRIX:
        return
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("full_matrix")
        if mark is not None:
            assert mark.kwargs.get("covered_by"), f"{item.nodeid}: full_matrix needs covered_by=..."
        (drop if mark is not None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return ("end-to-end matrices: full (DEADPOOL_FULL_MATRIX=1)" if FULL_MATRIX else
            "end-to-end matrices: the CI subset (DEADPOOL_FULL_MATRIX=1 runs every combination)")


@pytest.fixture
def shm_root():
    """A real tmpfs directory per test, removed afterwards (killed workers must not fill /dev/shm)."""
    root = f"/dev/shm/dp-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make_config(tmp_path, *, stage: int = 3, deadpool: dict | None | bool = True, base: str = "gpt_tiny_zero3_cpu.json",
                **overrides) -> str:
    with open(os.path.join(REPO, "configs", base)) as fh:
        cfg = json.load(fh)
    cfg["zero_optimization"] = {"stage": stage}
    if deadpool is None or deadpool is False:
        cfg.pop("deadpool", None)
    elif isinstance(deadpool, dict):
        cfg["deadpool"] = deadpool
    cfg.update(overrides)
    path = os.path.join(str(tmp_path), f"ds_{uuid.uuid4().hex[:6]}.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


@contextlib.contextmanager
def one_rank_gloo_world() -> Iterator[None]:
    """A 1-rank gloo default group for real DeepSpeed engines in the test process (DeepSpeed's CPU accelerator),
    unless one exists; on exit the process is left as found: no default group, no launcher variables."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    from deadpool_ext.launcher.contract import reset_worker_env

    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in names}
    made_group = not dist.is_initialized()
    if made_group:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        reset_worker_env()
        deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        if made_group:
            from deadpool_ext.integrations.deepspeed.rebuild import reset_deepspeed_comm_state

            dist.destroy_process_group()
            reset_deepspeed_comm_state()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            reset_worker_env()
