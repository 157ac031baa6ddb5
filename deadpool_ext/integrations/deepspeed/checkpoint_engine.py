"""DeepSpeed ``CheckpointEngine`` that publishes atomically and verifies before loading.

DeepSpeed's save calls, per rank: ``create(info)``, ``save(state_dict, path)`` for each file the rank writes,
``commit(info)``; rank 0 then writes ``latest``. A load calls ``load(path)`` per file. We keep DeepSpeed's own
file names and ``torch.save`` payloads, so a checkpoint written here is a plain DeepSpeed checkpoint that
``load_checkpoint`` and ``zero_to_fp32.py`` read without the extension; what we add is write-to-temp-and-rename,
a per-rank manifest with checksums written at commit (signed with the checkpoint key when one is set,
:mod:`deadpool_ext.persist.sign`), and verification of every file against it on load.

Every load deserialises with ``torch.load(weights_only=True)`` and the DeepSpeed allowlist
(:mod:`.allowlist`): a file naming any other class is refused (``UntrustedCheckpointError``), its code never
runs. The bytes unpickled are the bytes checksummed (one open file, hashed then read). In a directory the
tier-3 loader verified (:meth:`DeadpoolCheckpointEngine.mark_verified`) only the files its commit record lists
are opened. With a checkpoint key, a directory without a signed manifest is refused.

Tier 3 (``deadpool_ext.integrations.deepspeed.tier3``) puts the engine in *capture mode* around its own
``save_checkpoint`` call: between :meth:`begin_capture` and :meth:`end_capture` (training thread, every rank),
``save`` hands the state dict to a callback that copies it into host memory instead of writing, so the call
returns in the time of a memory copy and the background writer persists and publishes the base later.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ...persist.atomic import IncompleteCheckpointError, atomic_write, open_verified, read_manifests, write_manifest
from ...persist.safe_load import SafeGlobal, UntrustedCheckpointError, safe_load
from ...persist.sign import SignatureError, checkpoint_key, key_env
from .allowlist import deepspeed_globals
from .names import deepspeed_file_names

log = logging.getLogger("deadpool_ext")
ENGINE_NAME = "DeadpoolCheckpointEngine"


class DeadpoolCheckpointEngine(CheckpointEngine):
    def __init__(self, rank: int, *, before_io: Callable[[], None] | None = None, fsync: bool = True,
                 key: str | bytes | None = None, allow: Iterable[SafeGlobal] = ()) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self.rank = rank
        self._before_io = before_io
        self._fsync = fsync
        self._key = checkpoint_key(key)
        self._allow = deepspeed_globals(allow)
        self._pending: dict[str, list[str]] = {}
        self._capture: Callable[[Any, str], None] | None = None
        self._verified: dict[str, dict[str, dict[str, Any]] | None] = {}
        self.loads: list[tuple[str, str]] = []
        """(path, how it was checked) of every file ``load`` opened, in order: ``manifest`` (against this
        directory's deadpool manifests), ``commit_record`` (a tier-3 base, against its commit record),
        ``derived`` (a private directory made from verified files) or ``unverified`` (no manifest beside it)."""

    # -- tier-3 capture mode (training thread) --------------------------------------------------------
    def begin_capture(self, sink: Callable[[Any, str], None]) -> None:
        """Until :meth:`end_capture`, ``save(state, path)`` calls ``sink(state, path)`` and writes nothing."""
        self._capture = sink

    def end_capture(self) -> None:
        self._capture = None

    def mark_verified(self, directory: str, files: dict[str, dict[str, Any]] | None = None) -> None:
        """``directory`` holds a base the tier-3 loader verified (all ranks together) against its commit record,
        whose ``files`` entries are given: ``load`` opens only those names and checks each file's bytes against
        its entry as it reads them (no manifest in the directory is consulted). ``files=None``: a private
        directory derived from verified files (the universal-checkpoint conversion); loaded weights-only."""
        self._verified[os.path.abspath(directory)] = None if files is None else dict(files)

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
        directory = os.path.abspath(os.path.dirname(path))
        if directory in self._verified:
            entries = self._verified[directory]
            if entries is None:
                self.loads.append((path, "derived"))
                return safe_load(path, allow=self._allow, map_location=map_location)
            if os.path.basename(path) not in entries:
                raise UntrustedCheckpointError(f"{path}: not listed in the verified commit record of this base; "
                                               "not opened")
            return self._load_checked(path, entries, map_location, "commit_record")
        names = deepspeed_file_names()  # what the installed DeepSpeed writes, from its own naming functions
        manifest = read_manifests(directory, key=self._key, names=names.patterns, allowed=names.allowed)
        if manifest:
            return self._load_checked(path, manifest, map_location, "manifest")
        if self._key is not None:
            raise SignatureError(f"{path}: no signed deadpool manifest beside it, and a checkpoint key is set "
                                 f"({key_env()}); refusing a checkpoint the key did not sign")
        log.warning("no deadpool manifest beside %s: loading without verification (not written by deadpool_ext?)",
                    path)
        self.loads.append((path, "unverified"))
        return safe_load(path, allow=self._allow, map_location=map_location)

    def _load_checked(self, path: str, entries: dict[str, dict[str, Any]], map_location: Any, how: str) -> Any:
        with open_verified(path, entries) as fh:  # the bytes unpickled are the bytes hashed
            state = safe_load(fh, allow=self._allow, what=path, map_location=map_location)
        self.loads.append((path, how))
        return state

    def commit(self, info: CheckpointCommitInfo) -> bool:
        if self._capture is not None:
            self._pending.pop(info.tag, None)
            return True  # tier 3 publishes from its writer thread once every rank's files are written
        files = self._pending.pop(info.tag, [])
        if files:
            directory = os.path.dirname(files[0])
            write_manifest(directory, f"rank{self.rank}", [os.path.relpath(f, directory) for f in files],
                           extra={"tag": info.tag, "rank": self.rank}, key=self._key)
        return True


__all__ = ["DeadpoolCheckpointEngine", "IncompleteCheckpointError", "UntrustedCheckpointError"]
