"""Tier 3 for Megatron-Core: base checkpoints in ``megatron.core.dist_checkpointing``'s torch_dist format.

Why that format: every rank writes only its own shard, and a checkpoint saved with one TP/PP layout loads
into another (dist_checkpointing reshards by global tensor coordinates), which the in-memory tiers cannot do.

Atomic publication (same rules as ``deadpool_ext.persist.atomic``):

1. (all ranks) ``dist_checkpointing.save`` into ``DIR/.tmp.iter_<N>`` (rank 0 clears a stale one first);
2. (rank 0) a manifest with every file's size and checksum is written into it, last;
3. (rank 0) the directory is renamed to ``DIR/iter_<N>`` and ``DIR/latest`` is replaced atomically;
   older bases beyond ``keep_last`` are removed only after that.

A crash at any point leaves either the previous base (``latest`` unchanged) or the new one, complete.
Loading verifies every file against the manifest on rank 0 before any rank reads a byte.

Layout of the saved state: ``model`` (the chunk's sharded state dict), ``optimizer`` (Megatron's sharded
optimizer state, resharded on load), and common state (iteration, consumed samples, LR scheduler). RNG
states are per rank and layout-specific, so they are not part of a base: a loaded run re-seeds.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch.distributed as dist

from ...persist.atomic import (
    MANIFEST_PREFIX,
    IncompleteCheckpointError,
    atomic_write,
    read_manifests,
    verify_file,
    write_manifest,
)

log = logging.getLogger("deadpool_ext")

LATEST = "latest"


def _name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _sharded_state_dict(chunks: list[Any], optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    if len(chunks) != 1:
        raise NotImplementedError("tier-3 bases support one model chunk per rank (no virtual pipeline stages)")
    model_sd = chunks[0].module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_base(directory: str, chunks: list[Any], optimizer: Any, scheduler: Any, progress: Any,
              layout: Any, keep_last: int = 2) -> str:
    """Collective: write a base of the current state; returns the published directory."""
    from megatron.core import dist_checkpointing

    name = _name(progress.iteration)
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".tmp.{name}")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at the same iteration
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state_dict(chunks, optimizer, is_loading=False)
    state["iteration"] = int(progress.iteration)
    state["consumed_samples"] = int(progress.consumed_samples)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["saved_layout"] = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        files = sorted(os.path.relpath(os.path.join(root, f), tmp) for root, _, fs in os.walk(tmp) for f in fs)
        write_manifest(tmp, "base", files, extra={"iteration": int(progress.iteration), "format": "torch_dist",
                                                  "layout": state["saved_layout"]})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        atomic_write(os.path.join(directory, LATEST), lambda fh: fh.write(name.encode()))
        _prune(directory, keep_last)
        log.info("tier 3: base of iteration %d published at %s (%d files)", progress.iteration, final, len(files))
    dist.barrier()
    return final


def _prune(directory: str, keep_last: int) -> None:
    bases = sorted(d for d in os.listdir(directory) if d.startswith("iter_"))
    for old in bases[:-keep_last]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def verify_base(path: str) -> dict[str, Any]:
    """Raise IncompleteCheckpointError unless every file of the base matches its manifest; return the manifest."""
    manifest = read_manifests(path)
    if not manifest:
        raise IncompleteCheckpointError(f"{path}: no {MANIFEST_PREFIX}.*.json (incomplete base)")
    for rel in manifest:
        if os.sep in rel:
            raise IncompleteCheckpointError(f"{path}: unexpected nested file {rel} in a torch_dist base")
        verify_file(os.path.join(path, rel), manifest)
    with open(os.path.join(path, f"{MANIFEST_PREFIX}.base.json")) as fh:
        return json.load(fh)


def latest_base(directory: str) -> str | None:
    pointer = os.path.join(directory, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as fh:
        return os.path.join(directory, fh.read().strip())


def load_base(directory: str, chunks: list[Any], optimizer: Any, scheduler: Any, progress: Any,
              *, load_optimizer: bool = True) -> int | None:
    """Collective: load the latest verified base of ``directory`` into the live model/optimizer/scheduler,
    whatever TP/PP layout it was saved with. Returns its iteration, or None when there is none."""
    from megatron.core import dist_checkpointing

    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        path = latest_base(directory)
        try:
            verdict[0] = None if path is None else (path, verify_base(path).get("layout"))
        except IncompleteCheckpointError as exc:
            verdict[0] = ("error", str(exc))
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return None
    if verdict[0][0] == "error":
        raise IncompleteCheckpointError(verdict[0][1])
    path, saved_layout = verdict[0]
    state = _sharded_state_dict(chunks, optimizer, is_loading=True)
    if not load_optimizer:
        state.pop("optimizer")
    state["iteration"] = None
    state["consumed_samples"] = None
    state["scheduler"] = None
    loaded = dist_checkpointing.load(state, path)
    chunks[0].module.load_state_dict(loaded["model"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    progress.iteration = int(loaded["iteration"])
    progress.consumed_samples = int(loaded["consumed_samples"])
    if dist.get_rank() == 0:
        log.info("tier 3: loaded base of iteration %d from %s (saved at layout %s)", progress.iteration, path,
                 saved_layout)
    return progress.iteration
