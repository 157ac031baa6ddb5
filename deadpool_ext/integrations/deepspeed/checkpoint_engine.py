"""DeepSpeed ``CheckpointEngine`` that publishes atomically and verifies before loading.

DeepSpeed's save calls, per rank: ``create(info)``, ``save(state_dict, path)`` for each file the rank writes,
``commit(info)``; rank 0 then writes ``latest``. A load calls ``load(path)`` per file. We keep DeepSpeed's own
file names and ``torch.save`` payloads, so a checkpoint written here is a plain DeepSpeed checkpoint that
``load_checkpoint`` and ``zero_to_fp32.py`` read without the extension; what we add is write-to-temp-and-rename,
a per-rank manifest with checksums written at commit, and verification of every file against it on load.

Tier 3 (``deadpool_ext.integrations.deepspeed.tier3``) puts the engine in *capture mode* around its own
``save_checkpoint`` call: between :meth:`begin_capture` and :meth:`end_capture` (training thread, every rank),
``save`` hands the state dict to a callback that copies it into host memory instead of writing, so the call
returns in the time of a memory copy and the background writer persists and publishes the base later.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

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
        self._capture: Callable[[Any, str], None] | None = None
        self._verified: set[str] = set()

    # -- tier-3 capture mode (training thread) --------------------------------------------------------
    def begin_capture(self, sink: Callable[[Any, str], None]) -> None:
        """Until :meth:`end_capture`, ``save(state, path)`` calls ``sink(state, path)`` and writes nothing."""
        self._capture = sink

    def end_capture(self) -> None:
        self._capture = None

    def mark_verified(self, directory: str) -> None:
        """Files under ``directory`` were verified against their manifest by the tier-3 loader (all ranks
        together): ``load`` does not hash them a second time."""
        self._verified.add(os.path.abspath(directory))

    def create(self, info: CheckpointCommitInfo) -> None:
        # A tier-3 capture only reads the live tensors, like the snapshot copy: no need to wait for it.
        if self._before_io is not None and self._capture is None:
            # A snapshot copy may still be reading the live tensors that a load is about to overwrite.
            self._before_io()
        self._pending[info.tag] = []

    def save(self, state_dict: Any, path: str) -> None:
        if self._capture is not None:
            self._capture(state_dict, path)
            return
        atomic_write(path, lambda fh: torch.save(state_dict, fh), fsync=self._fsync)
        for files in self._pending.values():
            files.append(path)

    def load(self, path: str, map_location: Any = None) -> Any:
        if self._before_io is not None:
            self._before_io()
        if os.path.abspath(os.path.dirname(path)) in self._verified:
            return torch.load(path, map_location=map_location, weights_only=False)
        manifest = read_manifests(os.path.dirname(path))
        if manifest:
            verify_file(path, manifest)
        else:
            log.warning("no deadpool manifest beside %s: loading without verification (not written by deadpool_ext?)",
                        path)
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        if self._capture is not None:
            self._pending.pop(info.tag, None)
            return True  # tier 3 publishes from its writer thread once every rank's files are written
        files = self._pending.pop(info.tag, [])
        if files:
            directory = os.path.dirname(files[0])
            write_manifest(directory, f"rank{self.rank}", [os.path.relpath(f, directory) for f in files],
                           extra={"tag": info.tag, "rank": self.rank})
        return True


__all__ = ["DeadpoolCheckpointEngine", "IncompleteCheckpointError"]
