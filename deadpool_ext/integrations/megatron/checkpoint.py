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

Reading is data-only (the trust rules of ``docs/tier3.md``): ``latest`` must name ``iter_<7+ digits>``, the
manifest is parsed strictly and lists only the file names torch_dist writes (:data:`FILE_PATTERNS`), with a
checkpoint key (``$DEADPOOL_CHECKPOINT_KEY``) it must be signed by it; ``dist_checkpointing.load`` runs with
every ``torch.load`` weights-only (:mod:`.allowlist`) and the ``.metadata`` pickle read by a restricted
unpickler whose storage entries must name the base's own ``__R_I.distcp`` files. Rank 0's verdict reaches the
other ranks as JSON in a tensor (no pickle over the process group).

Layout of the saved state: ``model`` (the chunk's sharded state dict), ``optimizer`` (Megatron's sharded
optimizer state, resharded on load), and common state (iteration, consumed samples, LR scheduler). RNG
states are per rank and layout-specific, so they are not part of a base: a loaded run re-seeds.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from typing import IO, Any

import torch
import torch.distributed as dist

from ...config import ConfigError
from ...persist.atomic import (
    MANIFEST_PREFIX,
    IncompleteCheckpointError,
    atomic_write,
    open_regular,
    read_manifest_records,
    verify_file,
    write_manifest,
)
from ...persist.records import (
    BadRecordError,
    CheckpointTrustError,
    UnsafeNameError,
    one_line,
    parse_json_object,
    read_capped,
)
from ...persist.safe_load import UntrustedCheckpointError, only_weights, restricted_load
from ...persist.sign import checkpoint_key, key_env
from .allowlist import dcp_metadata_table, megatron_globals
from .layout import LayoutError

log = logging.getLogger("deadpool_ext")

LATEST = "latest"
BASE_NAME = re.compile(r"^iter_[0-9]{7,12}$", re.ASCII)
_DISTCP = re.compile(r"^__[0-9]{1,9}_[0-9]{1,9}\.distcp$", re.ASCII)
FILE_PATTERNS = (_DISTCP, re.compile(r"^\.metadata$"), re.compile(r"^common\.pt$"),
                 re.compile(r"^metadata\.json$"))
FILES_ALLOWED = "torch_dist file names: __R_I.distcp, .metadata, common.pt, metadata.json"
BASE_MANIFEST = f"{MANIFEST_PREFIX}.base.json"
_VERDICT_MAX = 64 << 20


def _name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


VPP_FLAG = "--virtual-pipeline-model-parallel-size"


def refuse_virtual_pipeline(chunks: list[Any], bases: str | None) -> None:
    """At start-up, every rank alike and before any collective: a job whose tier-3 bases are on (``bases``: the
    flag or config key that turned them on, e.g. ``--save`` or ``persist.url``; None: off) and whose model is in
    virtual pipeline stages (more than one chunk per rank) is refused, a :class:`ConfigError` in one line naming
    the keys to change. A base is written and read for one model chunk per rank."""
    if bases and len(chunks) != 1:
        raise ConfigError(f"deadpool_ext: Megatron-Core tier-3 bases take one model chunk per rank, this model has "
                          f"{len(chunks)} (virtual pipeline stages); change {VPP_FLAG} (to 1, or leave it unset) or "
                          f"{bases} (unset it: no tier-3 bases)", key=VPP_FLAG)


def one_chunk(chunks: list[Any], what: str) -> None:
    """Refuse, on every rank alike and before any collective, a model in virtual pipeline stages: a base is written
    and read for one model chunk per rank (a job is refused at start-up, :func:`refuse_virtual_pipeline`; this is
    for a direct call)."""
    if len(chunks) != 1:
        raise LayoutError(f"{what}: tier-3 bases take one model chunk per rank, got {len(chunks)} (virtual pipeline "
                          "stages, --virtual-pipeline-model-parallel-size > 1, are not supported)")


def _sharded_state_dict(chunks: list[Any], optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    model_sd = chunks[0].module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_base(directory: str, chunks: list[Any], optimizer: Any, scheduler: Any, progress: Any,
              layout: Any, keep_last: int = 2) -> str:
    """Collective: write a base of the current state; returns the published directory."""
    from megatron.core import dist_checkpointing

    one_chunk(chunks, "save_base")

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
                                                  "layout": state["saved_layout"]}, key=checkpoint_key())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        atomic_write(os.path.join(directory, LATEST), lambda fh: fh.write(name.encode()))
        _prune(directory, keep_last)
        log.info("tier 3: base of iteration %d published at %s (%d files)", progress.iteration, final, len(files))
    dist.barrier()
    return final


def _prune(directory: str, keep_last: int) -> None:
    bases = sorted(d for d in os.listdir(directory) if BASE_NAME.fullmatch(d))
    for old in bases[:-keep_last]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def verify_base(path: str, *, key: str | bytes | None = None) -> dict[str, Any]:
    """Raise IncompleteCheckpointError (or a ``CheckpointTrustError``: a malformed, unsigned or forged manifest)
    unless every file of the base matches its manifest; return the manifest. ``key``: default
    ``$DEADPOOL_CHECKPOINT_KEY``; with one, the manifest must be signed by it."""
    k = checkpoint_key(key)
    records = read_manifest_records(path, key=k, names=FILE_PATTERNS, allowed=FILES_ALLOWED)
    if BASE_MANIFEST not in records:
        raise IncompleteCheckpointError(f"{path}: no {BASE_MANIFEST} (incomplete base)")
    manifest = records[BASE_MANIFEST]["files"]
    for rel in manifest:
        verify_file(os.path.join(path, rel), manifest)
    return records[BASE_MANIFEST]


def latest_base(directory: str) -> str | None:
    """The base ``DIR/latest`` names (None: no ``latest``); anything but ``iter_<7 to 12 digits>`` is
    :class:`~deadpool_ext.persist.records.BadRecordError` naming the file (never joined to a path)."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.lexists(pointer):
        return None
    try:
        with open_regular(pointer) as fh:
            data = read_capped(fh, pointer, limit=256)
    except OSError as exc:
        raise BadRecordError(f"{pointer}: cannot be read as a regular file ({one_line(exc, 100)})") from None
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadRecordError(f"{pointer}: not UTF-8 text; expected iter_<7 to 12 digits>") from None
    if not BASE_NAME.fullmatch(name):
        raise UnsafeNameError(f"{pointer}: holds {one_line(repr(name), 60)}, expected iter_<7 to 12 digits> (a "
                              "base directory beside it)")
    return os.path.join(directory, name)


class _MetadataPickle:
    """Stands in for the ``pickle`` module inside ``torch.distributed.checkpoint.filesystem`` while a base is
    loaded: ``load`` is the restricted unpickler, and every storage entry must name one of the base's files."""

    def __init__(self, path: str, listed: set[str], refusals: list[CheckpointTrustError]) -> None:
        self.path, self.listed, self.refusals = path, listed, refusals

    def load(self, fh: IO[bytes]) -> Any:
        try:
            return self._load(fh)
        except CheckpointTrustError as exc:
            self.refusals.append(exc)
            raise

    def _load(self, fh: IO[bytes]) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata

        where = os.path.join(self.path, ".metadata")
        md = restricted_load(fh, dcp_metadata_table(), where)
        if not isinstance(md, Metadata):
            raise UntrustedCheckpointError(f"{where}: holds a {type(md).__name__}, expected a checkpoint Metadata")
        for info in (md.storage_data or {}).values():
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str) or not _DISTCP.fullmatch(rel) or rel not in self.listed:
                raise UnsafeNameError(f"{where}: a storage entry names {one_line(repr(rel), 80)}, not one of the "
                                      "base's own __R_I.distcp files listed in its manifest")
        return md

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)  # dump, ... (a concurrent save is unaffected)


@contextlib.contextmanager
def _data_only(path: str, listed: set[str]) -> Iterator[None]:
    """``dist_checkpointing.load`` of ``path`` reading data only; a refusal surfaces as our one-line error
    (torch.distributed.checkpoint wraps what its readers raise in a multi-rank report)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    refusals: list[CheckpointTrustError] = []
    before = dcp_fs.pickle
    dcp_fs.pickle = _MetadataPickle(path, listed, refusals)  # type: ignore[assignment]
    try:
        with only_weights(megatron_globals(), refusals=refusals):
            yield
    except (Exception, CheckpointException):
        if refusals:
            raise refusals[0] from None
        raise
    finally:
        dcp_fs.pickle = before


def _broadcast_verdict(verdict: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's verdict (a JSON object) on every rank, as bytes in a tensor: nothing is unpickled."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    raw = json.dumps(verdict).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=0)
    size = int(n.item())
    if not 0 < size <= _VERDICT_MAX:
        raise IncompleteCheckpointError(f"rank 0 sent a verdict of {size} bytes (allowed: 1 to {_VERDICT_MAX})")
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return parse_json_object(buf.cpu().numpy().tobytes(), "the verdict broadcast by rank 0")


def load_base(directory: str, chunks: list[Any], optimizer: Any, scheduler: Any, progress: Any,
              *, load_optimizer: bool = True) -> int | None:
    """Collective: load the latest verified base of ``directory`` into the live model/optimizer/scheduler,
    whatever TP/PP layout it was saved with. Returns its iteration, or None when there is none."""
    from megatron.core import dist_checkpointing

    one_chunk(chunks, "load_base")
    verdict: dict[str, Any] = {}
    if dist.get_rank() == 0:
        try:
            path = latest_base(directory)
            if path is None:
                verdict = {"status": "none"}
            else:
                man = verify_base(path)
                verdict = {"status": "ok", "name": os.path.basename(path), "layout": man.get("layout"),
                           "files": sorted(man["files"])}
        except (IncompleteCheckpointError, CheckpointTrustError) as exc:
            verdict = {"status": "error", "message": str(exc)}
        if checkpoint_key() is None and verdict.get("status") == "ok":
            log.info("tier 3: no checkpoint key (%s): base checked for integrity only, not authenticity", key_env())
    verdict = _broadcast_verdict(verdict)
    if verdict.get("status") == "none":
        return None
    if verdict.get("status") != "ok":
        raise IncompleteCheckpointError(one_line(verdict.get("message", "the base was refused on rank 0"), 1000))
    name = verdict.get("name")
    if not isinstance(name, str) or not BASE_NAME.fullmatch(name):  # re-checked here before the join
        raise IncompleteCheckpointError(f"{directory}: rank 0 named base {one_line(repr(name), 60)}")
    path = os.path.join(directory, name)
    saved_layout = verdict.get("layout")
    listed = {f for f in verdict.get("files", []) if isinstance(f, str)}
    state = _sharded_state_dict(chunks, optimizer, is_loading=True)
    if not load_optimizer:
        state.pop("optimizer")
    state["iteration"] = None
    state["consumed_samples"] = None
    state["scheduler"] = None
    with _data_only(path, listed):
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
