"""The restore executor (snapshot/restore.py) running an elastic plan, in process: a gloo world of one restores the
snapshots a world of two left in its node's shared memory (real segments, the real census, check before use and
moves), its one partition assembled from both old partitions; a copy refused before use is replaced by the next
one. The plan alone is tested without any process in test_restore_plan.py."""
from __future__ import annotations

import os
from typing import Any

import torch

from deadpool_ext.cluster.topology import NodePlacement
from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.memory.shm import ShmSegment, ensure_private_dir, job_shm_dir
from deadpool_ext.recovery.reshard import PartitionLayout
from deadpool_ext.snapshot.manager import SnapshotManager
from deadpool_ext.snapshot.slots import serialize
from deadpool_ext.testing.memory_job import JOB, NODE, Adapter, world_of_one

OLD = PartitionLayout(rule="flat", dp=2, dp_rank=0, groups=(((0, 64),),), part=(32,), model="m")
NEW = PartitionLayout(rule="flat", dp=1, dp_rank=0, groups=(((0, 64),),), part=(64,), model="m")
WHOLE = torch.arange(64, dtype=torch.float32)
_BLOB_NBYTES: dict[str, int] = {}


class Resharded(Adapter):
    """The one-tensor adapter with a partition layout: the masters of one flat group."""

    def __init__(self) -> None:
        super().__init__()
        self.got: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def partition_layout(self) -> dict[str, Any] | None:
        return NEW.to_json()

    def restore_resharded(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.got = ({k: v.clone() for k, v in tensors.items()}, meta)


def _old_copy(directory: str, name: str, rank: int, version: int = 6) -> ShmSegment:
    """Old rank ``rank``'s snapshot of a world of 2: its half of the masters and its layout."""
    layout = PartitionLayout(rule=OLD.rule, dp=2, dp_rank=rank, groups=OLD.groups, part=OLD.part, model=OLD.model)
    blob = serialize({"tensors": {"master.0": WHOLE[rank * 32:(rank + 1) * 32].clone()},
                      "state": {"steps": version, "layout": layout.to_json()}},
                     {"version": version, "rank": rank, "world_size": 2, "job_id": JOB, "node": NODE})
    seg = ShmSegment.create(name, len(blob), root=directory)
    seg.buf[:len(blob)] = blob
    _BLOB_NBYTES[name] = len(blob)
    return seg


def _restore(root: str) -> tuple[int | None, Resharded, dict[str, Any]]:
    cfg = DeadpoolConfig.from_dict({"snapshot": {"interval": 1}, "local": {"shm_root": root},
                                    "elastic": {"no_spare_policy": "shrink"}})
    a = Resharded()
    m = SnapshotManager(a, cfg, NodePlacement(job_id=JOB, node=NODE, first_on_node=False, shm_root=root,
                                              launcher_pid=os.getpid()))
    try:
        return m.restore_latest(), a, m.stats()
    finally:
        m.close()


def test_a_world_of_two_is_resharded_onto_one_rank_from_its_node_memory(tmp_path):
    root = str(tmp_path)
    directory = job_shm_dir(root, JOB, NODE)
    ensure_private_dir(directory)
    segs = [_old_copy(directory, f"deadpool.{JOB}.snap.r{r}.0", r) for r in (0, 1)]
    with world_of_one():
        version, a, stats = _restore(root)
    assert version == 6 and a.got is not None
    assert torch.equal(a.got[0]["master.0"], WHOLE) and a.got[1]["steps"] == 6
    r = stats["restore"]
    assert (r["outcome"], r["from_world"], r["to_world"], r["drawn_from"]) == ("resharded", 2, 1, [0, 1]), r
    assert r["providers"] == {"0": [0, 1], "1": [0, 1]} and not r["refused_before_use"], r
    assert stats["restored_from"] == "resharded" and stats["committed_version"] == 6
    for seg in segs:
        seg.close()


def test_a_copy_refused_before_use_is_replaced_by_its_replica(tmp_path):
    root = str(tmp_path)
    directory = job_shm_dir(root, JOB, NODE)
    ensure_private_dir(directory)
    segs = [_old_copy(directory, f"deadpool.{JOB}.snap.r{r}.0", r) for r in (0, 1)]
    segs.append(_old_copy(directory, f"deadpool.{JOB}.replica.r1.h0b0", 1))
    end = _BLOB_NBYTES[segs[1].name]
    segs[1].buf[end - 1] ^= 0xFF  # a flipped bit in rank 1's masters (the blob's last bytes): a checksum mismatch
    with world_of_one():
        version, a, stats = _restore(root)
    assert version == 6 and a.got is not None and torch.equal(a.got[0]["master.0"], WHOLE)
    r = stats["restore"]
    assert r["refused_before_use"] == [f"0:deadpool.{JOB}.snap.r1.0"], r
    assert r["providers"] == {"0": [0, 1], "1": [0, 2]}, r  # rank 1's state came from the replica (tier 2)
    for seg in segs:
        seg.close()
