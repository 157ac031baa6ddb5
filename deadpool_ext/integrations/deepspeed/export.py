"""Consolidated fp32 weights of a tier-3 base as one ``.safetensors`` file (Hugging Face can load it).

The consolidation is DeepSpeed's own (``deepspeed.utils.zero_to_fp32``): the base is a standard DeepSpeed
checkpoint, so the result is exactly what ``zero_to_fp32.py`` gives. Called in one process, no
``torch.distributed``; a remote URL is downloaded to the local cache first.
"""
from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

from ...persist.download import cache_dir_for, download
from ...persist.layout import VersionInfo, load_candidates, read_commit, verify_version, version_tag
from ...persist.storage import open_existing


def pick_version(url: str, version: int | None, *, verify: bool = True,
                 progress: Callable[[int, int], None] | None = None,
                 log: Callable[[str], None] = print) -> VersionInfo:
    """The requested base (or the newest complete one whose files all verify)."""
    storage = open_existing(url)
    if version is not None:
        cands = [VersionInfo(version, version_tag(version), read_commit(storage, version_tag(version)))]
        if cands[0].commit is None:
            raise SystemExit(f"{url}: base {version_tag(version)} has no commit record (incomplete or absent)")
    else:
        cands = load_candidates(storage)
        if not cands:
            raise SystemExit(f"{url}: no complete tier-3 base")
    for info in cands:
        errors = verify_version(storage, info, progress=progress) if verify else []
        if not errors:
            return info
        for e in errors:
            log(f"refusing {info.tag}: {e}")
    raise SystemExit(f"{url}: no base verifies")


def export_safetensors(url: str, out: str, *, version: int | None = None, cache_root: str | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       log: Callable[[str], None] = print) -> dict[str, object]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    storage = open_existing(url)
    info = pick_version(url, version, progress=progress, log=log)
    root = storage.local_path() or download(storage, info, cache_dir_for(url, cache_root))
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints per-parameter progress
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=info.tag)
    # Tied weights (GPT-2's lm_head / wte) share storage; safetensors refuses shared tensors, so each entry
    # gets its own contiguous copy. Hugging Face re-ties them on load.
    tensors = {k: v.detach().float().contiguous().clone() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt", "source": f"{url}/{info.tag}", "producer": "deadpool_ext"})
    os.replace(tmp, out)
    return {"version": info.version, "tag": info.tag, "tensors": len(tensors),
            "parameters": int(sum(t.numel() for t in tensors.values())), "out": out, "bytes": os.path.getsize(out)}
