"""``--load URL``: resume from the newest tier-3 base that every rank verified (the remote anchor).

Call order (every rank, collective, after ``deepspeed.initialize`` and before training):
``resume_from_tier3(engine, url)`` ->

1. rank 0 lists the complete bases (commit record present), newest first, and broadcasts the versions;
2. for each candidate: every rank verifies a disjoint share of its files (file i by rank i mod world) against
   the commit record; ``all_reduce(MIN)`` of "all my files are good". A base with a missing or corrupt file
   is refused (each rank logs what it found) and the previous one is tried;
3. the chosen base is loaded: same data-parallel size and ZeRO stage -> ``engine.load_checkpoint`` in place
   (a remote URL is first downloaded to a local cache by each node's local rank 0); different layout ->
   :mod:`deadpool_ext.integrations.deepspeed.reshard`.

Returns ``(version, client_state)``, or ``(None, {})`` when the URL holds no base with a commit record (the
caller may then try a plain DeepSpeed checkpoint directory).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ...launcher.contract import worker_env
from ...persist.download import cache_dir_for, download
from ...persist.layout import VersionInfo, load_candidates, read_commit, verify_version
from ...persist.storage import Storage, open_storage

log = logging.getLogger("deadpool_ext")
MAX_CANDIDATES = 64


class NoVerifiedBaseError(RuntimeError):
    """Bases exist at the URL but none is complete and verified on every rank."""


def _agree_candidates(storage: Storage, device: Any) -> list[int]:
    buf = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64, device=device)
    if dist.get_rank() == 0:
        versions = [v.version for v in load_candidates(storage)][:MAX_CANDIDATES]
        buf[: len(versions)] = torch.tensor(versions, dtype=torch.int64)
    dist.broadcast(buf, src=0)
    return [int(v) for v in buf.tolist() if v >= 0]


def _all_ok(ok: bool, device: Any) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def resume_from_tier3(engine: Any, url: str, *, cache_root: str | None = None) -> tuple[int | None, dict[str, Any]]:
    storage = open_storage(url, create=False)  # nothing there: start from scratch, create nothing
    rank, world = dist.get_rank(), dist.get_world_size()
    device = engine.device
    candidates = _agree_candidates(storage, device)
    if not candidates:
        return None, {}
    chosen: VersionInfo | None = None
    for version in candidates:
        info = VersionInfo(version, f"global_step{version}", None)
        info.commit = read_commit(storage, info.tag)
        if info.commit is None:
            errors = [f"{url}/{info.tag}: commit record missing or unreadable"]
        else:
            names = sorted(info.commit["files"])
            errors = verify_version(storage, info, names[rank::world])
        for e in errors:
            log.warning("tier 3: refusing base %s: %s", info.tag, e)
        if _all_ok(not errors, device):
            chosen = info
            break
        if rank == 0:
            log.warning("tier 3: base %s at %s is not intact on every rank; falling back to the previous base",
                        info.tag, url)
    if chosen is None:
        raise NoVerifiedBaseError(f"--load {url}: none of the bases {candidates} is complete and verified on every "
                                  f"rank (checksum does not match the manifest, or files missing: see the log)")
    local = storage.local_path()
    if local is None:
        local = cache_dir_for(url, cache_root)
        if worker_env().local_rank == 0:
            download(storage, chosen, local)
        dist.barrier()
    commit = chosen.commit
    assert commit is not None  # chosen only once its commit record was read and verified
    same_layout = (int(commit.get("dp_world_size", -1)) == int(engine.dp_world_size)
                   and int(commit.get("zero_stage", -1)) == int(engine.zero_optimization_stage()))
    ckpt = engine.checkpoint_engine
    if hasattr(ckpt, "mark_verified"):
        ckpt.mark_verified(os.path.join(local, chosen.tag))
    if same_layout:
        path, client = engine.load_checkpoint(local, tag=chosen.tag)
    else:
        from .reshard import load_resharded

        path, client = load_resharded(engine, local, chosen.tag, commit, cache_root=cache_dir_for(url, cache_root))
    if path is None:
        raise NoVerifiedBaseError(f"--load {url}: DeepSpeed could not load {chosen.tag}")
    if rank == 0:
        log.info("tier 3: resumed from base %s at %s (dp %s -> %s)", chosen.tag, url, commit.get("dp_world_size"),
                 engine.dp_world_size)
    return chosen.version, client or {}
