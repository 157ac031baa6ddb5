"""Consolidated fp32 weights of a tier-3 base as one ``.safetensors`` file (Hugging Face can load it).

The consolidation is DeepSpeed's own (``deepspeed.utils.zero_to_fp32``): the base is a standard DeepSpeed
checkpoint, so the result is exactly what ``zero_to_fp32.py`` gives. Called in one process, no
``torch.distributed``.

What it reads, and how: ``zero_to_fp32`` globs ``*_model_states.pt`` / ``*_optim_states.pt`` in the folder it
is given and unpickles them with ``weights_only=False``. So it is never given the storage: each candidate base
is first copied into a fresh private directory (this user's cache, :mod:`deadpool_ext.persist.download`),
exactly the files its commit record lists, hashed on the way (what is consolidated is what was verified), then
each copy's pickle is checked against the DeepSpeed allowlist, and the consolidation runs with ``torch.load``
swapped for the weights-only loader (:func:`~deadpool_ext.persist.safe_load.only_weights`), refusing any path
outside that copy. The copy is removed afterwards. With a checkpoint key only bases whose commit record it
signed are exported; the result says ``"authenticated": false`` when there was no key (integrity only).
A failed export raises one line (:class:`ExportError`: the reason, or the first of several).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

from ...persist.atomic import IncompleteCheckpointError
from ...persist.download import download, private_cache_root
from ...persist.layout import VersionInfo, load_candidates, read_version, version_tag, where
from ...persist.records import CheckpointTrustError, one_line
from ...persist.safe_load import SafeGlobal, UntrustedCheckpointError, only_weights, scan
from ...persist.sign import checkpoint_key
from ...persist.storage import Storage, open_existing
from .allowlist import deepspeed_globals


class ExportError(CheckpointTrustError):
    """No base can be exported (none complete, none verifies, or the one asked for is refused); one line."""


def _summary(refused: list[str], fallback: str) -> str:
    """One line for a failed export: the one reason, or the first of several."""
    if not refused:
        return fallback
    return refused[0] + (f" (and {len(refused) - 1} more refusal(s))" if len(refused) > 1 else "")


def _candidates(storage: Storage, url: str, version: int | None, key: bytes | None,
                refused: list[str]) -> list[VersionInfo]:
    """Bases to try, newest first; the reasons for bases refused on their records go to ``refused``."""
    if version is not None:
        if version < 0:
            raise ExportError(f"--version {version}: a base's version is a step number (>= 0)")
        info = read_version(storage, version_tag(version), key=key)
        if info.problem is not None:
            raise ExportError(f"refusing {info.tag}: {info.problem}")
        if info.commit is None:
            raise ExportError(f"{url}: base {version_tag(version)} has no commit record (incomplete or absent)")
        return [info]
    bad: list[VersionInfo] = []
    cands = load_candidates(storage, key=key, refused=bad)
    refused.extend(f"refusing {r.tag}: {r.problem}" for r in bad)
    if not cands:
        raise ExportError(_summary(refused, f"{url}: no complete tier-3 base"))
    return cands


def _private_copy(storage: Storage, info: VersionInfo, work: str, allow: list[SafeGlobal],
                  progress: Callable[[int, int], None] | None) -> str:
    """``work/<tag>/``: the listed files, hashed while copied, each pickle checked against ``allow``."""
    download(storage, info, work, progress=progress)
    tag_dir = os.path.join(work, info.tag)
    assert info.commit is not None
    for name in sorted(info.commit["files"]):
        scan(os.path.join(tag_dir, name), allow=allow, what=where(storage, f"{info.tag}/{name}"))
    return tag_dir


def export_safetensors(url: str, out: str, *, version: int | None = None, cache_root: str | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       log: Callable[[str], None] = print, key: str | bytes | None = None,
                       allow: Iterable[SafeGlobal] = ()) -> dict[str, object]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    k = checkpoint_key(key)
    storage = open_existing(url)
    refused: list[str] = []
    cands = _candidates(storage, url, version, k, refused)
    allowlist = deepspeed_globals(allow)
    state = None
    info: VersionInfo | None = None
    for cand in cands:
        work = tempfile.mkdtemp(prefix="export-", dir=private_cache_root(cache_root))
        try:
            try:
                tag_dir = _private_copy(storage, cand, work, allowlist, progress)
            except (IncompleteCheckpointError, CheckpointTrustError) as exc:
                refused.append(f"refusing {cand.tag}: {exc}")
                continue
            assert cand.commit is not None
            listed = {os.path.join(tag_dir, n) for n in cand.commit["files"]}

            def opened(path: str, listed: set[str] = listed) -> None:
                if os.path.abspath(path) not in listed:
                    raise UntrustedCheckpointError(f"{path}: not a file of the verified copy; not opened")

            try:
                with contextlib.redirect_stdout(io.StringIO()), only_weights(allowlist, opened=opened):
                    # DeepSpeed prints per-parameter progress
                    state = get_fp32_state_dict_from_zero_checkpoint(work, tag=cand.tag)
            except CheckpointTrustError:
                raise
            except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, AssertionError) as exc:
                # Verified bytes that unpickle to something zero_to_fp32 does not expect: one line, not its trace.
                raise ExportError(f"{where(storage, cand.tag)}: DeepSpeed's zero_to_fp32 cannot consolidate it "
                                  f"({type(exc).__name__}: {one_line(exc, 200)})") from None
            info = cand
            break
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if state is None or info is None:
        raise ExportError(_summary(refused, f"{url}: no base verifies"))
    for r in refused:  # the export succeeded from an older base: say which were skipped and why
        log(r)
    # Tied weights (GPT-2's lm_head / wte) share storage; safetensors refuses shared tensors, so each entry
    # gets its own contiguous copy. Hugging Face re-ties them on load.
    tensors = {k_: v.detach().float().contiguous().clone() for k_, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt", "source": f"{url}/{info.tag}", "producer": "deadpool_ext"})
    os.replace(tmp, out)
    return {"version": info.version, "tag": info.tag, "tensors": len(tensors),
            "parameters": int(sum(t.numel() for t in tensors.values())), "out": out, "bytes": os.path.getsize(out),
            "authenticated": k is not None}
