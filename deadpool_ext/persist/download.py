"""Copy one verified tier-3 base from its storage into a private local directory (for loaders that need files).

The cache is the current user's own: ``cache_root`` if given, else ``$XDG_CACHE_HOME/deadpool/tier3``, else
``~/.cache/deadpool/tier3``, else ``<tmp>/deadpool-<uid>/tier3`` (:func:`private_cache_root`). Every directory
of it is created mode 0700 without following symbolic links, and one that exists must be a real directory
owned by this user that nobody else can write to (else :class:`CacheDirError`, one line). Nothing in it is
trusted from an earlier run: no marker file skips a check, and every use re-hashes every file against the
commit record (:func:`download`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

import xxhash

from .atomic import IncompleteCheckpointError
from .layout import COMMIT, VersionInfo, check_file_name
from .records import CheckpointTrustError, one_line
from .regular import open_regular_file
from .storage import Storage


class CacheDirError(CheckpointTrustError, OSError):
    """The local cache directory is not private to this user (a link, another owner, not a directory)."""


def private_cache_root(cache_root: str | None = None) -> str:
    """The per-user cache root (created, private: see the module docstring)."""
    if cache_root:
        return ensure_private_dir(os.path.abspath(cache_root))
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = os.path.expanduser("~")
    if xdg and os.path.isabs(xdg):
        base = os.path.join(xdg, "deadpool")
    elif home and home != "~" and os.path.isdir(home) and os.access(home, os.W_OK):
        base = os.path.join(home, ".cache", "deadpool")
    else:
        base = os.path.join(tempfile.gettempdir(), f"deadpool-{os.geteuid()}")
    ensure_private_dir(base)
    return ensure_private_dir(os.path.join(base, "tier3"))


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (and missing parents) with mode 0700, never through a symbolic link; check that the
    directory itself is a real directory of this user that nobody else can write to. Returns ``path``."""
    path = os.path.abspath(path)
    missing = []
    cur = path
    while not os.path.lexists(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # created concurrently (another local rank): checked below like any existing directory
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CacheDirError(f"{path}: cannot be used as a private cache directory ({exc.strerror}; a symbolic link "
                            "or not a directory?)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise CacheDirError(f"{path}: owned by uid {st.st_uid}, not by this user ({os.geteuid()}); refusing to "
                                "use a cache directory someone else controls (remove it or give --cache)")
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise CacheDirError(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); a cache "
                                "directory must be writable by its owner only (chmod go-w, or give another --cache)")
    finally:
        os.close(fd)
    return path


def cache_dir_for(url: str, cache_root: str | None = None) -> str:
    """This user's private cache directory for ``url`` (created)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return ensure_private_dir(os.path.join(private_cache_root(cache_root), digest))


def _create_private_file(path: str) -> int:
    try:
        os.unlink(path)  # a leftover .part (ours: the directory is private)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)


def _file_matches(path: str, nbytes: int, digest: str) -> bool:
    try:   # a FIFO or device left in the cache is no copy: refused without opening it, and downloaded again
        fh = open_regular_file(path)
    except OSError:
        return False
    with fh:
        if os.fstat(fh.fileno()).st_size != nbytes:
            return False
        h = xxhash.xxh3_64()
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest() == digest


def download(storage: Storage, info: VersionInfo, dest_root: str,
             progress: Callable[[int, int], None] | None = None) -> str:
    """Copy base ``info`` under ``dest_root`` (a private directory: :func:`cache_dir_for`); returns ``dest_root``.

    Afterwards ``dest_root/<tag>/`` holds exactly the files the commit record lists (anything else there is
    removed, so a loader that globs finds nothing unverified) plus the record itself, each with the checksum
    the record names: a cached copy is kept only when its bytes hash to it (re-hashed on every use), and a
    download is hashed on the way and refused when it does not match
    (:class:`~deadpool_ext.persist.atomic.IncompleteCheckpointError`)."""
    assert info.commit is not None  # a committed base, as verify_version() requires
    files = info.commit["files"]
    for name in files:
        check_file_name(name, f"{storage.url.rstrip('/')}/{info.tag}/{COMMIT}")
    ensure_private_dir(dest_root)
    tag_dir = ensure_private_dir(os.path.join(dest_root, info.tag))
    for entry_name in os.listdir(tag_dir):
        if entry_name not in files and entry_name != COMMIT:
            p = os.path.join(tag_dir, entry_name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
    total = sum(int(e["nbytes"]) for e in files.values())
    done = 0
    for name in sorted(files):
        entry = files[name]
        dst = os.path.join(tag_dir, name)
        if not _file_matches(dst, int(entry["nbytes"]), entry["xxh3_64"]):
            h = xxhash.xxh3_64()
            n = 0
            part = dst + ".part"
            with os.fdopen(_create_private_file(part), "wb") as fh:
                for block in storage.iter_chunks(f"{info.tag}/{name}"):
                    h.update(block)
                    n += len(block)
                    if n > int(entry["nbytes"]):
                        break  # longer than the record says: refused below, without filling the disk
                    fh.write(block)
            if n != int(entry["nbytes"]) or h.hexdigest() != entry["xxh3_64"]:
                os.unlink(part)
                raise IncompleteCheckpointError(
                    f"tier 3: {storage.url.rstrip('/')}/{info.tag}/{name} does not match its commit record (read "
                    f"{n}{'+' if n > int(entry['nbytes']) else ''} bytes, xxh3 {h.hexdigest()}; the record says "
                    f"{entry['nbytes']} bytes, {one_line(entry['xxh3_64'], 20)}): changed or corrupt")
            os.replace(part, dst)
        done += int(entry["nbytes"])
        if progress is not None:
            progress(done, total)
    body = json.dumps(info.commit, indent=1, sort_keys=True).encode()  # the record as verified, not re-read
    with os.fdopen(_create_private_file(os.path.join(tag_dir, COMMIT + ".part")), "wb") as fh:
        fh.write(body)
    os.replace(os.path.join(tag_dir, COMMIT + ".part"), os.path.join(tag_dir, COMMIT))
    return dest_root
