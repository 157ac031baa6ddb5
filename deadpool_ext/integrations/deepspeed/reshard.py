"""Load a tier-3 base into a job with a different data-parallel size (e.g. dp 4 -> dp 2).

Route: DeepSpeed's universal checkpoint. The base (standard DeepSpeed files) is converted per node by
``deepspeed.checkpoint.ds_to_universal`` into per-parameter fp32 files (weights and Adam moments, unpartitioned);
each new rank then loads it with DeepSpeed's ``load_universal_checkpoint`` code path, which reads every
parameter file and keeps only the slice of its own new partition. ZeRO-1/2 and ZeRO-3 both work (whatever
``ds_to_universal`` supports in the installed DeepSpeed).

Shards on the right node are not moved: when the layout is unchanged (same dp size and ZeRO stage) no
conversion happens and each rank reads exactly the files it wrote (``zero_pp_rank_R_*``) - from the local
file system in place for a local/shared path, otherwise downloaded once per node. Only a layout change pays
the conversion.

What the converter reads and writes is never trusted from elsewhere: its input is this user's private copy of
exactly the files the verified commit record lists (``ds_to_universal`` globs its input folder, so nothing
else may be there), it runs with ``torch.load`` swapped for the weights-only loader with the DeepSpeed
allowlist (it calls ``torch.load(weights_only=False)`` itself), and its output goes to a fresh directory inside
the private cache that is removed after the load. No earlier conversion is reused (a "done" marker would let
whatever sits in a cache skip every check).

Call order (every rank, collective): ``load_resharded(engine, local_root, tag, commit, cache_root=...)``; each
node's local rank 0 converts, everyone agrees it worked (``all_reduce``), every rank loads, then the
conversion is removed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import secrets
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ...launcher.contract import worker_env
from ...persist.download import ensure_private_dir
from ...persist.records import CheckpointTrustError, one_line
from ...persist.safe_load import SafeGlobal, only_weights
from .allowlist import deepspeed_globals

log = logging.getLogger("deadpool_ext")


class ReshardError(CheckpointTrustError):
    """The conversion to a universal checkpoint failed or was refused (one line)."""


def convert_to_universal(src_tag_dir: str, out_tag_dir: str, allow: list[SafeGlobal] | None = None) -> None:
    """Run DeepSpeed's converter in this process (one worker: no process pool), weights-only."""
    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(out_tag_dir, ignore_errors=True)
    # inject_missing_state: ZeRO-1/2 conversion wants `universal_checkpoint_info` (tensor-parallel merge
    # patterns) that Megatron-DeepSpeed writes; without tensor parallelism DeepSpeed's own default (version
    # only, no patterns) is exactly right.
    args = argparse.Namespace(input_folder=src_tag_dir, output_folder=out_tag_dir, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    # The converter prints a progress bar per phase; keep it off the job's stdout.
    with contextlib.redirect_stdout(io.StringIO()), only_weights(deepspeed_globals() if allow is None else allow):
        ds_to_universal.main(args)


def _token(device: Any) -> str:
    t = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return f"{int(t.item()):016x}"


def load_resharded(engine: Any, local_root: str, tag: str, commit: dict[str, Any], *,
                   cache_root: str) -> tuple[str | None, dict[str, Any]]:
    """``local_root/tag`` must be a private copy of exactly the verified files (``persist.download``)."""
    universal_root = ensure_private_dir(os.path.join(cache_root, f"universal-{_token(engine.device)}"))
    out = os.path.join(universal_root, tag)
    if dist.get_rank() == 0:
        log.info("tier 3: %s was saved with dp=%s, ZeRO %s; this job has dp=%s, ZeRO %s: resharding through "
                 "DeepSpeed's universal checkpoint in %s", tag, commit.get("dp_world_size"), commit.get("zero_stage"),
                 engine.dp_world_size, engine.zero_optimization_stage(), out)
    problem = ""
    if worker_env().local_rank == 0:
        try:
            convert_to_universal(os.path.join(local_root, tag), out)
        except CheckpointTrustError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed's converter: reported on every rank, then raised
            problem = f"{type(exc).__name__}: {one_line(exc, 300)}"
        if problem:
            log.error("tier 3: converting %s to a universal checkpoint failed: %s", tag, problem)
    ok = torch.tensor([0 if problem else 1], dtype=torch.int64, device=engine.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # instead of a barrier: nobody waits for a conversion that failed
    try:
        if not ok.item():
            raise ReshardError(f"converting {tag} to a universal checkpoint failed"
                               + (f": {problem}" if problem else " on another node (see its log)"))
        if hasattr(engine.checkpoint_engine, "mark_verified"):
            engine.checkpoint_engine.mark_verified(out)  # derived from a base all ranks verified, private
        cfg = engine._config
        before = cfg.load_universal_checkpoint
        cfg.load_universal_checkpoint = True
        try:
            with only_weights(deepspeed_globals()):
                result: tuple[str | None, dict[str, Any]] = engine.load_checkpoint(universal_root, tag=tag)
        finally:
            cfg.load_universal_checkpoint = before
        dist.barrier()  # every rank of the node has read the conversion
        return result
    finally:
        if worker_env().local_rank == 0:
            shutil.rmtree(universal_root, ignore_errors=True)
