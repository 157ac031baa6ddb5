"""``--load URL``: resume from the newest tier-3 base that every rank verified (the remote anchor).

Call order (every rank, collective, after ``deepspeed.initialize`` and before training):
``resume_from_tier3(engine, url)`` ->

1. rank 0 lists the complete bases (a commit record that parses, names only DeepSpeed's file names and, with a
   checkpoint key, is signed by it), newest first, and broadcasts the versions (or, when the listing itself
   fails, e.g. a malformed ``latest``, the one-line reason, so every rank stops with it);
2. for each candidate: every rank reads and checks the commit record itself, then verifies a disjoint share of
   its files (file i by rank i mod world) against it: size, xxh3, and the classes its pickle names (the
   DeepSpeed allowlist, without unpickling); ``all_reduce(MIN)`` of "all my files are good". A base with a
   missing, corrupt or refused file is refused (each rank logs what it found) and the previous one is tried;
3. the chosen base is loaded: same data-parallel size and ZeRO stage -> ``engine.load_checkpoint`` in place
   (a remote URL is first downloaded, re-hashed, into this user's private cache by each node's local rank 0);
   different layout -> a private copy of exactly the listed files, then
   :mod:`deadpool_ext.integrations.deepspeed.reshard`. Every file is unpickled weights-only with the allowlist
   (our checkpoint engine for the load, ``torch.load`` swapped for DeepSpeed's direct calls), and only the
   files the commit record lists are opened.

Returns ``(version, client_state)``, or ``(None, {})`` when the URL holds no base with a commit record at all
(the caller may then try a plain DeepSpeed checkpoint directory: the engine is left with a
:class:`DeadpoolCheckpointEngine`, so that load is weights-only too). Commit records that exist but are all
refused are not "no base": every refusal is :class:`NoVerifiedBaseError` with one line (the pretraining
scripts print it and exit).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...launcher.contract import worker_env
from ...persist.atomic import IncompleteCheckpointError
from ...persist.download import cache_dir_for, download
from ...persist.layout import VersionInfo, load_candidates, read_version, verify_version, version_tag, where
from ...persist.records import CheckpointTrustError, one_line
from ...persist.safe_load import SafeGlobal, only_weights, scan
from ...persist.sign import checkpoint_key, key_env
from ...persist.storage import Storage, open_storage
from .allowlist import deepspeed_globals
from .checkpoint_engine import DeadpoolCheckpointEngine

log = logging.getLogger("deadpool_ext")
MAX_CANDIDATES = 64
_MSG_BYTES = 1024
_REFUSED = -2  # broadcast in slot 0 instead of versions: rank 0 could not list the bases (message follows)


class NoVerifiedBaseError(RuntimeError):
    """Bases exist at the URL but none is complete and verified on every rank (or the chosen one was refused
    while loading). The message is one line; ``refused`` maps each base this rank refused (its tag) to why (one
    line per problem: a checksum, a missing file, a class outside the allowlist, a special file)."""

    def __init__(self, message: str, refused: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.refused: dict[str, list[str]] = dict(refused or {})


def _broadcast_text(text: str, device: Any) -> str:
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        raw = text.encode("utf-8", "replace")[:_MSG_BYTES]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")


def _agree_candidates(storage: Storage, device: Any, key: bytes | None) -> list[int]:
    buf = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64, device=device)
    message = ""
    if dist.get_rank() == 0:
        refused: list[VersionInfo] = []
        try:
            versions = [v.version for v in load_candidates(storage, key=key, refused=refused)][:MAX_CANDIDATES]
            buf[: len(versions)] = torch.tensor(versions, dtype=torch.int64)
            if not versions and refused:  # commit records exist, every one refused: not "no base there"
                message = (f"every base's commit record is refused ({len(refused)}); the newest: "
                           f"{one_line(refused[-1].problem, 700)}")
                buf[0] = _REFUSED
        except (CheckpointTrustError, OSError) as exc:
            message = one_line(exc, 900)
            buf[0] = _REFUSED
        for v in refused:
            log.warning("tier 3: refusing base %s: %s", v.tag, v.problem)
    dist.broadcast(buf, src=0)
    if int(buf[0]) == _REFUSED:
        raise NoVerifiedBaseError(f"--load {storage.url}: {_broadcast_text(message, device)}")
    return [int(v) for v in buf.tolist() if v >= 0]


def _all_ok(ok: bool, device: Any) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _check_share(storage: Storage, info: VersionInfo, names: list[str], allow: list[SafeGlobal]) -> list[str]:
    """Sizes and checksums of ``names``, then the classes their pickles name (none outside ``allow``)."""
    errors = verify_version(storage, info, names)
    if errors:
        return errors
    for name in names:
        rel = f"{info.tag}/{name}"
        try:
            with storage.open_read(rel) as fh:
                scan(fh, allow=allow, what=where(storage, rel))
        except (CheckpointTrustError, OSError) as exc:
            errors.append(one_line(exc, 400))
    return errors


@contextlib.contextmanager
def _our_checkpoint_engine(engine: Any, key: bytes | None, allow: Iterable[SafeGlobal]) -> Iterator[Any]:
    """The engine's checkpoint engine if it is ours, else one of ours for the duration of the load."""
    ckpt = engine.checkpoint_engine
    if isinstance(ckpt, DeadpoolCheckpointEngine):
        yield ckpt
        return
    mine = DeadpoolCheckpointEngine(engine.global_rank, key=key, allow=allow)
    engine.checkpoint_engine = mine
    try:
        yield mine
    finally:
        engine.checkpoint_engine = ckpt


def _local_copy(storage: Storage, chosen: VersionInfo, url: str, cache_root: str | None, device: Any) -> str:
    """Each node's local rank 0 copies (re-hashing) the base into this user's private cache; collective."""
    local = cache_dir_for(url, cache_root)
    problem = ""
    if worker_env().local_rank == 0:
        try:
            download(storage, chosen, local)
        except (IncompleteCheckpointError, CheckpointTrustError, OSError) as exc:
            problem = one_line(exc, 600)
            log.error("tier 3: copying %s to %s failed: %s", chosen.tag, local, problem)
    if not _all_ok(not problem, device):  # instead of a barrier: nobody waits for a copy that failed
        raise NoVerifiedBaseError(f"--load {url}: the verified copy of {chosen.tag} could not be made on every node"
                                  + (f" ({problem})" if problem else " (see the log of each node's first rank)"))
    return local


def resume_from_tier3(engine: Any, url: str, *, cache_root: str | None = None, key: str | bytes | None = None,
                      allow: Iterable[SafeGlobal] = ()) -> tuple[int | None, dict[str, Any]]:
    """See the module docstring. ``key``: the checkpoint key (default ``$DEADPOOL_CHECKPOINT_KEY``); with one,
    only bases whose records it signed are loaded. ``allow``: classes the client state holds beyond the
    DeepSpeed allowlist."""
    try:
        k = checkpoint_key(key)
    except CheckpointTrustError as exc:
        raise NoVerifiedBaseError(f"--load {url}: {exc}") from None
    allowlist = deepspeed_globals(allow)
    storage = open_storage(url, create=False)  # nothing there: start from scratch, create nothing
    rank, world = dist.get_rank(), dist.get_world_size()
    device = engine.device
    candidates = _agree_candidates(storage, device, k)
    if not candidates:
        # No tier-3 base at all. The caller may try the URL as a plain DeepSpeed checkpoint directory next
        # (engine.load_checkpoint): leave the engine with our checkpoint engine so that load, too, is
        # weights-only with the allowlist and checked against any manifest (with a key: a signed one).
        if not isinstance(engine.checkpoint_engine, DeadpoolCheckpointEngine):
            engine.checkpoint_engine = DeadpoolCheckpointEngine(engine.global_rank, key=k, allow=allow)
        return None, {}
    if rank == 0 and k is None:
        log.info("tier 3: no checkpoint key (%s): the bases at %s are checked for integrity only, not "
                 "authenticity", key_env(), url)
    chosen: VersionInfo | None = None
    refused: dict[str, list[str]] = {}
    for version in candidates:
        info = read_version(storage, version_tag(version), key=k)
        if info.commit is None:
            errors = [info.problem or f"{where(storage, info.tag)}: commit record missing"]
        else:
            names = sorted(info.commit["files"])
            errors = _check_share(storage, info, names[rank::world], allowlist)
        for e in errors:
            log.warning("tier 3: refusing base %s: %s", info.tag, e)
        if errors:
            refused[info.tag] = errors
        if _all_ok(not errors, device):
            chosen = info
            break
        if rank == 0:
            log.warning("tier 3: base %s at %s is not intact on every rank; falling back to the previous base",
                        info.tag, url)
    if chosen is None:
        raise NoVerifiedBaseError(f"--load {url}: none of the bases {candidates} is complete and verified on every "
                                  f"rank (checksum does not match the manifest, files missing or refused: see the "
                                  f"log)", refused)
    commit = chosen.commit
    assert commit is not None  # chosen only once its commit record was read and verified
    same_layout = (int(commit.get("dp_world_size", -1)) == int(engine.dp_world_size)
                   and int(commit.get("zero_stage", -1)) == int(engine.zero_optimization_stage()))
    in_place = storage.local_path() if same_layout else None
    local = in_place or _local_copy(storage, chosen, url, cache_root, device)
    try:
        with _our_checkpoint_engine(engine, k, allow) as ckpt, only_weights(allowlist):
            ckpt.mark_verified(os.path.join(local, chosen.tag), commit["files"])
            with _plain_load(engine):
                if same_layout:
                    path, client = engine.load_checkpoint(local, tag=chosen.tag)
                else:
                    from .reshard import load_resharded

                    path, client = load_resharded(engine, local, chosen.tag, commit, cache_root=local)
    except (CheckpointTrustError, IncompleteCheckpointError) as exc:
        raise NoVerifiedBaseError(f"--load {url}: {chosen.tag} refused while loading: {one_line(exc, 600)}") from None
    if path is None:
        raise NoVerifiedBaseError(f"--load {url}: DeepSpeed could not load {chosen.tag}")
    if rank == 0:
        log.info("tier 3: resumed from base %s at %s (dp %s -> %s)", chosen.tag, url, commit.get("dp_world_size"),
                 engine.dp_world_size)
    return chosen.version, client or {}


def _plain_load(engine: Any) -> Any:
    """DeepSpeed's own ``load_checkpoint`` (the runtime routes a script's call to memory: checkpoint_calls.py)."""
    rt = getattr(engine, "deadpool", None)
    calls = getattr(rt, "checkpoint_calls", None)
    return calls.internal() if calls is not None else contextlib.nullcontext()
