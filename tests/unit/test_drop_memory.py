"""A failed node's memory leaves the job at once and its pages are freed off the recovery path
(``launcher/local.py``: ``LocalNodes.drop_memory``)."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from deadpool_ext.launcher.local import LocalNodes
from deadpool_ext.memory.shm import job_shm_dir


def _nodes(root: str) -> LocalNodes:
    args = SimpleNamespace(shm_root=root)
    return LocalNodes(args, "job1", "tok", [], {"node0", "node1"}, event=lambda **_: None)


def _fill(root: str, node: str) -> str:
    d = job_shm_dir(root, "job1", node)
    os.makedirs(d)
    for i in range(3):
        with open(os.path.join(d, f"deadpool.job1.slot.r0.{i}"), "wb") as f:
            f.write(b"\0" * 4096)
    return d


def test_dropped_memory_is_gone_at_once_and_freed_in_the_background(tmp_path, monkeypatch):
    root = str(tmp_path)
    d, kept = _fill(root, "node1"), _fill(root, "node0")
    gate = threading.Event()
    nodes = _nodes(root)
    real = os.setpriority

    def held(*a):  # the removal thread waits here until the test has looked
        gate.wait(10)
        return real(*a)

    monkeypatch.setattr(os, "setpriority", held)
    try:
        nodes.drop_memory("node1")
        assert not os.path.exists(d)                       # nothing of the job finds it any more
        hidden = [n for n in os.listdir(root) if n.startswith(".dropped-")]
        assert len(hidden) == 1 and not hidden[0].startswith("deadpool.")
        os.makedirs(d)                                     # a node started again gets a directory of its own
    finally:
        gate.set()
    nodes.settle()
    assert sorted(os.listdir(root)) == sorted([os.path.basename(d), os.path.basename(kept)])
    assert os.listdir(kept)


def test_wait_removes_in_the_foreground_and_a_missing_directory_is_no_error(tmp_path):
    root = str(tmp_path)
    _fill(root, "node0")
    nodes = _nodes(root)
    nodes.drop_memory("node0", wait=True)
    assert os.listdir(root) == [] and nodes._removals == []
    nodes.drop_memory("node1")                             # never made: nothing to do
    nodes.drop_memory("elsewhere")                         # another host's node: its own launcher drops it
    nodes.settle()
    assert os.listdir(root) == []
