"""Load a tier-3 base into a job with a different data-parallel size (e.g. dp 4 -> dp 2).

Route: DeepSpeed's universal checkpoint. The base (standard DeepSpeed files) is converted once per node by
``deepspeed.checkpoint.ds_to_universal`` into per-parameter fp32 files (weights and Adam moments, unpartitioned)
in a local cache; each new rank then loads it with DeepSpeed's ``load_universal_checkpoint`` code path, which
reads every parameter file and keeps only the slice of its own new partition. ZeRO-1/2 and ZeRO-3 both work
(whatever ``ds_to_universal`` supports in the installed DeepSpeed).

Shards on the right node are not moved: when the layout is unchanged (same dp size and ZeRO stage) no
conversion happens and each rank reads exactly the files it wrote (``zero_pp_rank_R_*``) - from the local
file system in place for a local/shared path, otherwise downloaded once per node. Only a layout change pays
the conversion, and the converted cache is kept keyed by URL and tag, so a second job with the new layout reuses it.

Call order (every rank, collective): ``load_resharded(engine, local_root, tag, commit, cache_root=...)``; each
node's local rank 0 converts, everyone waits on a barrier, then every rank loads.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
from typing import Any

import torch.distributed as dist

from ...launcher.contract import worker_env

log = logging.getLogger("deadpool_ext")
DONE = ".deadpool_universal_done"


def convert_to_universal(src_tag_dir: str, out_tag_dir: str) -> None:
    """Run DeepSpeed's converter in this process (one worker: no process pool)."""
    from deepspeed.checkpoint import ds_to_universal

    if os.path.exists(os.path.join(out_tag_dir, DONE)):
        return
    shutil.rmtree(out_tag_dir, ignore_errors=True)
    # inject_missing_state: ZeRO-1/2 conversion wants `universal_checkpoint_info` (tensor-parallel merge
    # patterns) that Megatron-DeepSpeed writes; without tensor parallelism DeepSpeed's own default (version
    # only, no patterns) is exactly right.
    args = argparse.Namespace(input_folder=src_tag_dir, output_folder=out_tag_dir, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    # The converter prints a progress bar per phase; keep it off the job's stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    with open(os.path.join(out_tag_dir, DONE), "w") as fh:
        fh.write(src_tag_dir)


def load_resharded(engine: Any, local_root: str, tag: str, commit: dict[str, Any], *,
                   cache_root: str) -> tuple[str | None, dict[str, Any]]:
    universal_root = os.path.join(cache_root, "universal")
    out = os.path.join(universal_root, tag)
    if dist.get_rank() == 0:
        log.info("tier 3: %s was saved with dp=%s, ZeRO %s; this job has dp=%s, ZeRO %s: resharding through "
                 "DeepSpeed's universal checkpoint in %s", tag, commit.get("dp_world_size"), commit.get("zero_stage"),
                 engine.dp_world_size, engine.zero_optimization_stage(), out)
    if worker_env().local_rank == 0:
        convert_to_universal(os.path.join(local_root, tag), out)
    dist.barrier()
    if hasattr(engine.checkpoint_engine, "mark_verified"):
        engine.checkpoint_engine.mark_verified(out)  # derived from a base all ranks verified
    cfg = engine._config
    before = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(universal_root, tag=tag)
    finally:
        cfg.load_universal_checkpoint = before
