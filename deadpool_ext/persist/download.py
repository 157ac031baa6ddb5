"""Copy one verified tier-3 base from its storage into a local directory (for loaders that need files)."""
from __future__ import annotations

import hashlib
import os
import tempfile

import xxhash

from .atomic import IncompleteCheckpointError, file_checksum
from .layout import VersionInfo
from .storage import Storage


def cache_dir_for(url: str, cache_root: str | None = None) -> str:
    root = cache_root or os.path.join(tempfile.gettempdir(), "deadpool-tier3-cache")
    return os.path.join(root, hashlib.sha256(url.encode()).hexdigest()[:16])


def download(storage: Storage, info: VersionInfo, dest_root: str) -> str:
    """Copy base ``info`` (and DeepSpeed's recovery scripts) under ``dest_root``; returns ``dest_root``.

    Every file ends up with the checksum the commit record names: a cached copy is reused only when its bytes
    hash to it (a base rewritten at the same URL and step must not resume from stale local bytes), and a
    download is hashed on the way and refused when it does not match."""
    assert info.commit is not None  # a committed base, as verify_version() requires
    os.makedirs(os.path.join(dest_root, info.tag), exist_ok=True)
    for name in sorted(info.commit["files"]):
        entry = info.commit["files"][name]
        dst = os.path.join(dest_root, info.tag, name)
        if os.path.exists(dst) and os.path.getsize(dst) == int(entry["nbytes"]) \
                and file_checksum(dst) == entry["xxh3_64"]:
            continue
        h = xxhash.xxh3_64()
        with open(dst + ".part", "wb") as fh:
            for block in storage.iter_chunks(f"{info.tag}/{name}"):
                h.update(block)
                fh.write(block)
        if h.hexdigest() != entry["xxh3_64"]:
            os.unlink(dst + ".part")
            raise IncompleteCheckpointError(f"tier 3: {info.tag}/{name} changed while it was downloaded "
                                            f"(xxh3 {h.hexdigest()}, the commit record says {entry['xxh3_64']})")
        os.replace(dst + ".part", dst)
    for name in ("deadpool_commit.json",):
        with open(os.path.join(dest_root, info.tag, name), "wb") as fh:
            fh.write(storage.read_bytes(f"{info.tag}/{name}"))
    return dest_root
