"""A one-rank job of the memory tiers, in process (gloo world of 1): the real SnapshotManager writes slots into
a real shared-memory directory and a fresh manager restores from them, as a restarted worker would.

The test bed's public helper for tests that need a real manager without processes: the unit tests of the snapshot
worker, the restore executor and the CUDA paths drive ``manager(root, Adapter())`` step by step; the security tests
forge or replace what a first run (``run_steps``) left (``slot_path``, ``slot_of``, ``rewrite_header``) and watch
``restore`` refuse it.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.cluster.topology import NodePlacement
from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.memory.shm import job_shm_dir, segment_name
from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot.manager import SnapshotManager
from deadpool_ext.snapshot.state import RankStateAdapter

JOB = "sec"
NODE = "n0"


class Adapter(RankStateAdapter):
    """One tensor and a step counter."""

    def __init__(self) -> None:
        self.w = torch.zeros(64)
        self.steps = 0

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("w", self.w)]

    def meta(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.w.copy_(tensors["w"])
        self.steps = meta["steps"]

    def step(self) -> int:
        return self.steps

    def restore_meta(self, meta: dict[str, Any]) -> None:
        self.steps = meta["steps"]


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def manager(root: str, adapter: Adapter) -> SnapshotManager:
    cfg = DeadpoolConfig.from_dict({"snapshot": {"interval": 1}, "local": {"shm_root": root}})
    return SnapshotManager(adapter, cfg, NodePlacement(job_id=JOB, node=NODE, first_on_node=False, shm_root=root,
                                                       launcher_pid=os.getpid()))


def run_steps(root: str, steps: int) -> None:
    """A first run: ``steps`` snapshots (tensor filled with the step number), then it ends."""
    a = Adapter()
    m = manager(root, a)
    assert m.restore_latest() is None
    for step in range(1, steps + 1):
        m.before_optimizer_step()  # the copy of the previous version is done: the "optimizer" may write
        a.w.fill_(step)
        a.steps = step
        m.after_step()
    m.close()


def slot_path(root: str, slot: int) -> str:
    return os.path.join(job_shm_dir(root, JOB, NODE), segment_name(JOB, "snap", 0, slot))


def slot_of(root: str, version: int) -> int:
    for slot in (0, 1):
        with open(slot_path(root, slot), "rb") as fh:
            if fmt.read_header(fh.read())["meta"]["version"] == version:
                return slot
    raise AssertionError(f"no slot holds version {version}")


def rewrite_header(path: str, mutate: Any) -> None:
    """Rewrite a sealed slot's header in place (MAGIC, data and checksums untouched): a forged, 'complete' copy."""
    with open(path, "r+b") as fh:
        blob = fh.read()
        n = fmt.header_len_of(blob)
        header = fmt.read_header(blob)
        mutate(header)
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= n, "the forged header must fit the slot's reserved header"
        fh.seek(fmt.PREFIX_LEN)
        fh.write(raw + b" " * (n - len(raw)))


def restore(root: str) -> tuple[int | None, Adapter]:
    """A restarted worker: a fresh manager restores from what is in memory."""
    a = Adapter()
    m = manager(root, a)
    try:
        return m.restore_latest(), a
    finally:
        m.close()
