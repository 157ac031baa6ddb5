"""Tier-1 snapshot storage: named shared-memory segments on the local node.

Segments are plain files in a tmpfs (``/dev/shm``) mapped with ``mmap``. Being
named files, they outlive the process that wrote them: when a training
process crashes or is killed, its last snapshot (and the replicas it held for
peers) stays in node memory for the restarted process to pick up. Anonymous
memory would die with the process.

We deliberately do not use ``multiprocessing.shared_memory``: its resource
tracker unlinks a segment when the process that created it exits (and warns
about "leaked" segments), which is exactly the crash case these segments must
survive. Lifetime is instead managed explicitly, per job, with `cleanup_job`.

Names carry the job id (``deadpool.<job_id>.<kind>.r<rank>.<slot>``) and the
id's alphabet excludes the ``.`` separator, so two jobs sharing a host can
never open, overwrite or clean up each other's segments.

Trust (:mod:`.trust`): the job directory is created 0700 (`ensure_private_dir`) and segments 0600; both are
opened without following symbolic links (segments relative to their directory's descriptor), and an existing
one is adopted only if this user owns it and nobody else may write it: anything else is refused with
:class:`~.trust.UntrustedPathError`, one line naming it.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .trust import UntrustedPathError, check_adopted, ensure_private_dir

if TYPE_CHECKING:  # torch is imported where a tensor is made: the launcher's path helpers import no framework
    import torch

__all__ = [
    "SHM_ROOT",
    "ShmSegment",
    "ShmSpaceError",
    "UntrustedPathError",
    "cleanup_job",
    "ensure_private_dir",
    "list_segments",
    "segment_name",
]

SHM_ROOT = "/dev/shm"
PREFIX = "deadpool"

_ID_RE = re.compile(r"[A-Za-z0-9_-]+")
_PAGE = mmap.PAGESIZE


class ShmSpaceError(OSError):
    """Not enough free space in the shared-memory filesystem for a segment.

    Raised up front because running out of tmpfs space *while writing through
    a mapping* is not an exception but a SIGBUS that kills the process --
    mid-snapshot, on the hot path.
    """

    def __init__(self, path: str | os.PathLike[str], needed: int, available: int) -> None:
        super().__init__(
            errno.ENOSPC,
            f"not enough shared memory for segment: need {needed} bytes, {available} bytes available "
            f"(enlarge the tmpfs or lower the snapshot/replication size)",
            os.fspath(path),
        )
        self.needed = needed
        self.available = available


def job_shm_dir(root: str, job_id: str, node: str) -> str:
    """The directory of one node's snapshots of one job: a lost node's memory is exactly one directory.
    Create it with `ensure_private_dir` (0700, never through a symlink, refused if another user made it)."""
    _check_id("job_id", job_id)
    safe_node = "".join(c if c.isalnum() or c in "_-" else "_" for c in node)
    return os.path.join(root, f"deadpool.{job_id}.{safe_node}")


def _check_id(what: str, value: str) -> None:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(
            f"{what} must be a non-empty string of [A-Za-z0-9_-] (it becomes part of a file name "
            f"and '.' separates name fields), got {value!r}"
        )


def segment_name(job_id: str, kind: str, rank: int, slot: int | str) -> str:
    """The canonical segment name ``deadpool.<job_id>.<kind>.r<rank>.<slot>``."""
    _check_id("job_id", job_id)
    _check_id("kind", kind)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if isinstance(slot, bool) or not isinstance(slot, (int, str)):
        raise ValueError(f"slot must be a non-negative int or an id string, got {slot!r}")
    if isinstance(slot, int):
        if slot < 0:
            raise ValueError(f"slot must be a non-negative int or an id string, got {slot!r}")
    else:
        _check_id("slot", slot)
    return f"{PREFIX}.{job_id}.{kind}.r{rank}.{slot}"


def _segment_path(name: str, root: str | os.PathLike[str]) -> Path:
    # Names are joined onto a shared directory: anything that could escape it
    # or hide (path separators, dot-files) is rejected.
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name.startswith("."):
        raise ValueError(f"invalid segment name {name!r}: must be a plain file name without '/'")
    return Path(root) / name


_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_root(root: str | os.PathLike[str]) -> int:
    # The root itself is configured (a job directory made by ensure_private_dir, or a test's directory):
    # segments are opened relative to its descriptor, so the name is resolved in exactly that directory.
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_segment(name: str, dfd: int, path: Path, *, create: bool) -> tuple[int, bool]:
    """(descriptor, created) of segment ``name`` in the directory open as ``dfd``: created 0600 (with
    ``create``) or an existing one that passes `check_adopted`. Symbolic links are never followed."""
    try:
        if create:
            try:
                fd = os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                os.fchmod(fd, 0o600)
                return fd, True
            except FileExistsError:
                pass
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise UntrustedPathError(path, "it is not a regular file (symbolic links are never followed)") from None
        raise
    try:
        check_adopted(fd, path, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def _free_bytes(root: str | os.PathLike[str]) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


class ShmSegment:
    """A named, fixed-size, mmap'd file in a shared-memory directory.

    Lifetime: `close` unmaps this process's view; the data persists until
    `unlink` (or `cleanup_job`). Using the segment as a context manager closes
    it on exit but never unlinks -- surviving the process is the point.

    Views: `buf` and `tensor` are zero-copy. Drop them before `close`; a
    `close` while views are still alive defers the unmap until the last view
    is garbage-collected instead of unmapping memory that is still in use.
    """

    __slots__ = ("_name", "_path", "_nbytes", "_mm")

    def __init__(self, name: str, path: Path, mm: mmap.mmap, nbytes: int) -> None:
        # Use `create` / `open`; the constructor just adopts a mapping.
        self._name = name
        self._path = path
        self._mm: mmap.mmap | None = mm
        self._nbytes = nbytes

    @classmethod
    def create(
        cls,
        name: str,
        nbytes: int,
        *,
        root: str | os.PathLike[str] = SHM_ROOT,
        touch: bool = True,
    ) -> ShmSegment:
        """Create (or re-attach to and resize) segment ``name`` of ``nbytes``.

        An existing segment keeps its contents (up to the new size), so a
        restarted process can call `create` for its own segment without
        wiping the snapshot it is about to recover from.

        ``touch=True`` reserves the memory and pre-faults every page now, so
        neither allocation nor page faults happen on the snapshot hot path
        (an untouched 1 GiB tmpfs mapping copies ~20x slower on first write).
        It reads rather than writes each page, which keeps existing data
        intact. Raises `ShmSpaceError` if the filesystem lacks the space.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            # mmap cannot map zero bytes; a zero-size segment is always a bug.
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        path = _segment_path(name, root)
        dfd = _open_root(root)
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                already = st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0  # allocated, not apparent size
            except FileNotFoundError:
                already = 0
            needed = max(0, nbytes - already)
            available = _free_bytes(root)
            if needed > available:
                raise ShmSpaceError(path, needed, available)
            fd, created = _open_segment(name, dfd, path, create=True)
        finally:
            os.close(dfd)
        try:
            try:
                if os.fstat(fd).st_size != nbytes:
                    os.ftruncate(fd, nbytes)
                if touch:
                    _reserve(fd, nbytes, path, needed)
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                # mmap keeps its own dup of the descriptor.
                os.close(fd)
        except BaseException:
            if created:
                # Do not leave a half-made segment that a peer could mistake
                # for a valid (zero-filled) snapshot.
                _unlink_quiet(path)
            raise
        seg = cls(name, path, mm, nbytes)
        if touch:
            seg._prefault()
        return seg

    @classmethod
    def open(cls, name: str, *, root: str | os.PathLike[str] = SHM_ROOT) -> ShmSegment:
        """Map an existing segment at its current size."""
        path = _segment_path(name, root)
        try:
            dfd = _open_root(root)
            try:
                fd, _ = _open_segment(name, dfd, path, create=False)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"shared-memory segment {name!r} does not exist in {os.fspath(root)} "
                "(never created, already cleaned up, or written by a different job id)",
                os.fspath(path),
            ) from None
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes == 0:
                # The creator died between creating the file and sizing it.
                raise OSError(errno.EINVAL, f"shared-memory segment {name!r} is empty (incomplete create)",
                              os.fspath(path))
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, path, mm, nbytes)

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        return self._path

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._mm is None

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"shared-memory segment {self._name!r} is closed")
        return self._mm

    @property
    def buf(self) -> memoryview:
        """A writable, zero-copy memoryview of the whole segment."""
        return memoryview(self._mapping())

    def tensor(self, dtype: torch.dtype | None = None, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A 1-D zero-copy tensor over ``[offset, offset + nbytes)`` of the segment (``dtype``: uint8 if None)."""
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        mm = self._mapping()
        if nbytes is None:
            nbytes = self._nbytes - offset
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset < 0 or nbytes < 0 or offset + nbytes > self._nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside segment of {self._nbytes} bytes")
        if offset % itemsize or nbytes % itemsize:
            # Misaligned typed views break vectorised/DMA copies (e.g. pinned
            # host -> GPU), so insist on natural alignment.
            raise ValueError(f"offset {offset} and nbytes {nbytes} must be multiples of {dtype} size {itemsize}")
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        # Go through a memoryview: torch.frombuffer releases its buffer export
        # right away and only keeps the object alive, so a tensor made directly
        # from the mmap would not stop mmap.close() -> dangling pointer, crash
        # on access. The memoryview held by the tensor keeps the export open,
        # so close() sees it and defers.
        view = memoryview(mm)[offset : offset + nbytes]
        return torch.frombuffer(view, dtype=dtype)

    def _prefault(self) -> None:
        # One read per page maps every page into this process; on tmpfs a
        # shared writable mapping gets writable PTEs, so later writes do not
        # fault either. Reading (not zeroing) keeps existing snapshot data.
        t = self.tensor()
        int(t[::_PAGE].sum())
        del t

    def close(self) -> None:
        """Unmap this handle (idempotent). The segment itself persists."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            # Views (memoryviews/tensors) are still alive; unmapping now would
            # leave them pointing at freed memory. The views hold references
            # to the mmap object, so dropping ours lets the mapping be
            # unmapped when the last view is garbage-collected.
            pass

    def unlink(self) -> None:
        """Remove the segment's name (idempotent).

        Existing mappings, in this and other processes, stay valid until
        closed; the memory is freed after the last one goes.
        """
        _unlink_quiet(self._path)

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else "open"
        return f"ShmSegment(name={self._name!r}, nbytes={self._nbytes}, path={os.fspath(self._path)!r}, {state})"


def _reserve(fd: int, nbytes: int, path: Path, needed: int) -> None:
    # fallocate makes tmpfs allocate the pages now and fail cleanly with
    # ENOSPC, rather than SIGBUS on a later write; it also covers the race
    # where several ranks on the node passed the statvfs check together.
    # Allocating keeps existing data (mode 0 only fills holes).
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            available = _free_bytes(path.parent)
            raise ShmSpaceError(path, needed, available) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        # Filesystem without fallocate: the read pre-fault still allocates
        # tmpfs pages, just without the clean ENOSPC guarantee.


def _unlink_quiet(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def list_segments(job_id: str | None = None, *, root: str | os.PathLike[str] = SHM_ROOT) -> list[str]:
    """Names of deadpool segments in ``root`` (of one job if given), sorted."""
    if job_id is not None:
        _check_id("job_id", job_id)
        prefix = f"{PREFIX}.{job_id}."
    else:
        prefix = f"{PREFIX}."
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.name.startswith(prefix) and e.is_file(follow_symlinks=False))


def cleanup_job(job_id: str, *, root: str | os.PathLike[str] = SHM_ROOT) -> int:
    """Unlink every segment of ``job_id`` in ``root``; return how many this call removed.

    Safe to run concurrently from several ranks of one node: a segment removed
    by someone else in between is skipped, not an error.
    """
    return sum(_unlink_quiet(Path(root) / name) for name in list_segments(job_id, root=root))
