"""Where tier-3 bytes go: a local (or shared) file system path, or any fsspec URL.

Only *storage* lives here (open, rename, list, delete); what goes where (the base layout, manifests, commit
record) is in :mod:`deadpool_ext.persist.layout`. Two implementations behind one small ABC:

- :class:`LocalStorage` for plain paths and ``file://`` URLs: writes with ``open``, ``fsync`` and ``os.replace``,
  so a published file is durable and appears atomically.
- :class:`FsspecStorage` for everything else (``s3://`` through s3fs, ``memory://`` in tests): the same calls
  through ``fsspec``; a "rename" is the backend's move (on object stores a copy + delete of an object whose
  upload is itself atomic).

All paths given to a storage are relative to its root and use ``/``; a path that is absolute or has a ``..``
component is refused (:class:`~deadpool_ext.persist.records.UnsafePathError`), and :class:`LocalStorage` reads
no file through a symbolic link below its root (a link planted in a base must not make a reader open a file
outside it). Every method may be called from any thread; one writer handle is used by one thread.
"""
from __future__ import annotations

import abc
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Any

from .records import UnsafePathError, one_line
from .regular import open_regular_file


class TempWriter(abc.ABC):
    """A file written under a temporary name; :meth:`publish` renames it into place, :meth:`abort` removes it."""

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def publish(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...


class Storage(abc.ABC):
    """Root of a tier-3 location. ``url`` is what the user gave (used in messages)."""

    url: str

    @abc.abstractmethod
    def open_temp(self, rel: str) -> TempWriter:
        """Start writing ``rel`` under a temporary name in the same directory."""

    @abc.abstractmethod
    def open_read(self, rel: str) -> IO[bytes]: ...

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def size(self, rel: str) -> int: ...

    @abc.abstractmethod
    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; [] when it does not exist."""

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None: ...

    @abc.abstractmethod
    def remove(self, rel: str) -> None: ...

    def free_bytes(self) -> int | None:
        """Free space at the target, when the backend can tell (local file systems); else None."""
        return None

    def local_path(self, rel: str = "") -> str | None:
        """A local file-system path for ``rel`` when the storage is local (DeepSpeed then reads in place)."""
        return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Small file, published atomically (temporary name, then rename)."""
        w = self.open_temp(rel)
        try:
            w.write(data)
            w.publish()
        except BaseException:
            w.abort()
            raise

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as fh:
            return fh.read()

    def iter_chunks(self, rel: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        with self.open_read(rel) as fh:
            while block := fh.read(chunk):
                yield block

    def describe_full(self, rel: str, needed: int | None) -> str:
        free = self.free_bytes()
        return (f"tier 3 storage full writing {self.url.rstrip('/')}/{rel}: the base needs "
                f"{needed if needed is not None else '?'} bytes, {free if free is not None else 'unknown'} bytes "
                f"free; the previous base is untouched")


def check_rel(rel: str, url: str) -> str:
    """``rel`` if it stays under the root: relative, no empty, ``.`` or ``..`` component, no NUL or backslash."""
    if rel == "":
        return rel
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"{url.rstrip('/')}: path {one_line(repr(rel), 80)} would leave the storage root "
                              "(absolute, '..', empty or '.' components are refused)")
    return rel


def _tmp_name(rel: str) -> str:
    head, tail = os.path.split(rel)
    return os.path.join(head, f".tmp.{uuid.uuid4().hex[:12]}.{tail}")


class _LocalWriter(TempWriter):
    def __init__(self, final: str) -> None:
        self.final = final
        self.tmp = _tmp_name(final)
        os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
        self.fh = open(self.tmp, "wb")

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)

    def publish(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.final)
        # The rename is only durable once the directory entry is: fsync the directory too.
        dfd = os.open(os.path.dirname(self.final) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def abort(self) -> None:
        try:
            self.fh.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class LocalStorage(Storage):
    def __init__(self, root: str, *, create: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = root
        if create:
            os.makedirs(self.root, exist_ok=True)

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, check_rel(rel, self.url)) if rel else self.root

    def _no_links(self, rel: str) -> str:
        """The path of ``rel``, refusing it when a component below the root is a symbolic link."""
        path = self._p(rel)
        cur = self.root
        for part in rel.split("/") if rel else []:
            cur = os.path.join(cur, part)
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break  # the caller's open/stat reports it
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{self.url.rstrip('/')}/{rel}: {cur} is a symbolic link; a checkpoint "
                                      "is read only from regular files below its root")
        return path

    def open_temp(self, rel: str) -> TempWriter:
        return _LocalWriter(self._p(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return open_regular_file(self._no_links(rel), f"{self.url.rstrip('/')}/{rel}")

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self._p(rel))

    def size(self, rel: str) -> int:
        return os.path.getsize(self._no_links(rel))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._p(rel), ignore_errors=True)

    def remove(self, rel: str) -> None:
        try:
            os.unlink(self._p(rel))
        except FileNotFoundError:
            pass

    def free_bytes(self) -> int | None:
        return shutil.disk_usage(self.root).free

    def local_path(self, rel: str = "") -> str | None:
        return self._p(rel)


class _FsspecWriter(TempWriter):
    def __init__(self, fs: Any, final: str) -> None:  # an fsspec filesystem
        self.fs, self.final = fs, final
        self.tmp = _tmp_name(final)
        self.fh = fs.open(self.tmp, "wb")

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(bytes(data) if isinstance(data, memoryview) else data)

    def publish(self) -> None:
        self.fh.close()
        self.fs.mv(self.tmp, self.final)

    def abort(self) -> None:
        try:
            self.fh.close()
        except Exception:  # noqa: BLE001 - the upload is being abandoned; its error was already reported
            pass
        try:
            self.fs.rm(self.tmp)
        except (FileNotFoundError, OSError):
            pass


class FsspecStorage(Storage):
    """Any fsspec URL, e.g. ``s3://bucket/run`` (``pip install s3fs``; credentials the usual AWS way)."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        import fsspec

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        if not create:
            return  # readers must not create anything (s3fs would create a missing bucket)
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except (OSError, NotImplementedError):
            pass  # object stores have no directories

    def _p(self, rel: str) -> str:
        return f"{self.root}/{check_rel(rel, self.url)}" if rel else self.root

    def open_temp(self, rel: str) -> TempWriter:
        return _FsspecWriter(self.fs, self._p(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.fs, LocalFileSystem):   # a local path can hold a FIFO or a device: checked first
            return open_regular_file(self._p(rel), f"{self.url.rstrip('/')}/{rel}")
        fh: IO[bytes] = self.fs.open(self._p(rel), "rb")
        return fh

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._p(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._p(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self._p(rel).rstrip("/") + "/"
        return sorted({e[len(base):].split("/")[0] if e.startswith(base) else e.rsplit("/", 1)[-1]
                       for e in entries} - {""})

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self._p(rel), recursive=True)
        except FileNotFoundError:
            pass

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(self._p(rel))
        except FileNotFoundError:
            pass


def open_storage(url: str, *, create: bool = True) -> Storage:
    """``/path`` or ``file:///path`` -> :class:`LocalStorage`; any other ``scheme://`` -> :class:`FsspecStorage`.

    ``create=False`` for readers (``--load``, ``deadpool inspect|verify|export``): a missing location is not
    created (a mistyped bucket or path must not appear as an empty checkpoint store)."""
    if "://" not in url:
        return LocalStorage(url, create=create)
    if url.startswith("file://"):
        return LocalStorage(url[len("file://"):], create=create)
    return FsspecStorage(url, create=create)


def open_existing(url: str) -> Storage:
    """A reader's view of ``url``; a location that does not exist is an error naming it."""
    storage = open_storage(url, create=False)
    try:
        present = storage.exists("")
    except Exception as exc:  # e.g. credentials or endpoint problems: say which location
        raise FileNotFoundError(f"{url}: cannot reach the tier-3 location: {exc}") from exc
    if not present:
        raise FileNotFoundError(f"{url}: no such tier-3 location (nothing was ever saved there, or the path/bucket "
                                "is mistyped); nothing was created")
    return storage


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
