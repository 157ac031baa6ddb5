"""DeepSpeed ``CheckpointEngine`` that publishes atomically and verifies before loading.

DeepSpeed's save calls, per rank: ``create(info)``, ``save(state_dict, path)`` for each file the rank writes,
``commit(info)``; rank 0 then writes ``latest``. A load calls ``load(path)`` per file. We keep DeepSpeed's own
file names and ``torch.save`` payloads, so a checkpoint written here is a plain DeepSpeed checkpoint that
``load_checkpoint`` and ``zero_to_fp32.py`` read without the extension; what we add is write-to-temp-and-rename,
a per-rank manifest with checksums written at commit, and verification of every file against it on load.
"""
from __future__ import annotations

import io
import logging
import os
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ...persist.atomic import IncompleteCheckpointError, atomic_write, read_manifests, verify_file, write_manifest

log = logging.getLogger("deadpool_ext")
ENGINE_NAME = "DeadpoolCheckpointEngine"


class DeadpoolCheckpointEngine(CheckpointEngine):
    def __init__(self, rank: int, *, before_io: Callable[[], None] | None = None, fsync: bool = True) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self.rank = rank
        self._before_io = before_io
        self._fsync = fsync
        self._pending: dict[str, list[str]] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._before_io is not None:
            # A snapshot copy may still be reading the live tensors that a load is about to overwrite.
            self._before_io()
        self._pending[info.tag] = []

    def save(self, state_dict: Any, path: str) -> None:
        atomic_write(path, lambda fh: torch.save(state_dict, fh), fsync=self._fsync)
        for files in self._pending.values():
            files.append(path)

    def load(self, path: str, map_location: Any = None) -> Any:
        if self._before_io is not None:
            self._before_io()
        manifest = read_manifests(os.path.dirname(path))
        if manifest:
            verify_file(path, manifest)
        else:
            log.warning("no deadpool manifest beside %s: loading without verification (not written by deadpool_ext?)",
                        path)
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        files = self._pending.pop(info.tag, [])
        if files:
            directory = os.path.dirname(files[0])
            write_manifest(directory, f"rank{self.rank}", [os.path.relpath(f, directory) for f in files],
                           extra={"tag": info.tag, "rank": self.rank})
        return True


__all__ = ["DeadpoolCheckpointEngine", "IncompleteCheckpointError"]
