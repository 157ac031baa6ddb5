from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest

from deadpool_ext.testing.launch import REPO


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
