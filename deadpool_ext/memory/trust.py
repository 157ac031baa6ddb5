"""What node-local memory may trust: directories and files that this user made, reached without symlinks.

The shared-memory root (``/dev/shm``) is writable by every user of the node. Anything found there may have been
put there by someone else: a directory or segment created in advance under a name we are about to use, a
symbolic link pointing elsewhere, a pid file naming a process that is not the launcher. The rules, applied to
everything node-local memory creates or adopts:

- directories are created 0700 and files 0600 (whatever the umask), opened with ``O_NOFOLLOW | O_CLOEXEC``
  (``O_DIRECTORY`` for directories), files relative to their directory's descriptor;
- an existing entry is adopted only if it is of the expected type, owned by this user (``st_uid ==
  os.getuid()``) and not writable by group or others; anything else is refused with one line naming it
  (:class:`UntrustedPathError`). An entry of ours that others can only *read* (directories of earlier versions
  were created 0755) is tightened to 0700 / 0600 with a warning, not refused;
- a pid is trusted only together with the start time of its process (``/proc/<pid>/stat``, field 22), so a
  pid reused by another process is never taken for the one recorded (:func:`process_start_time`).

No torch here: the node agent (a small detached process) uses this module.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
import time

log = logging.getLogger("deadpool_ext")

__all__ = [
    "UntrustedPathError", "ensure_private_dir", "open_private_dir", "check_adopted", "read_private_file",
    "write_private_file", "process_start_time", "user_key",
]

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
DIR_MODE = 0o700
FILE_MODE = 0o600


class UntrustedPathError(PermissionError):
    """A directory or file that is not this user's own, private, plain entry; the message names it and why."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        self.message = f"refusing {os.fspath(path)}: {why}"
        super().__init__(errno.EPERM, self.message)

    def __str__(self) -> str:
        return self.message


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    return "a device or special file"


def check_adopted(fd: int, path: str | os.PathLike[str], *, directory: bool) -> os.stat_result:
    """Refuse (raise :class:`UntrustedPathError`) an opened entry that another user owns, that is writable by
    group or others, that is not of the expected type or (a file) that has other hard links; tighten one of
    ours that others may read. Returns its stat."""
    st = os.fstat(fd)
    want_dir = stat.S_ISDIR(st.st_mode)
    if want_dir != directory or (not directory and not stat.S_ISREG(st.st_mode)):
        expected = "a directory" if directory else "a regular file"
        raise UntrustedPathError(path, f"it is {_kind(st)}, expected {expected}")
    me = os.getuid()
    if st.st_uid != me:
        raise UntrustedPathError(path, f"owned by uid {st.st_uid}, not by this user (uid {me}); another user "
                                       "created it: remove it or use another job id / local.shm_root")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UntrustedPathError(path, f"mode {mode:04o} lets group or others write into it (allowed: "
                                       f"{DIR_MODE if directory else FILE_MODE:04o}); remove it")
    if not directory and st.st_nlink != 1:
        raise UntrustedPathError(path, f"it has {st.st_nlink} hard links (allowed: 1)")
    want = DIR_MODE if directory else FILE_MODE
    if mode & 0o077:
        log.warning("%s was readable by group or others (mode %04o): set to %04o", os.fspath(path), mode, want)
        os.fchmod(fd, want)
    return st


def _refusal(path: str, exc: OSError, *, directory: bool) -> UntrustedPathError | None:
    """Why opening ``path`` without following symlinks failed, if it is a trust matter (a link, a non-directory)."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EISDIR):
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return UntrustedPathError(path, f"it is {_kind(st)}, expected {'a directory' if directory else 'a regular file'}"
                                    + (" (symbolic links are never followed)" if stat.S_ISLNK(st.st_mode) else ""))


def open_private_dir(path: str | os.PathLike[str], *, create: bool = False) -> int:
    """A descriptor of directory ``path``, this user's and private (``check_adopted``); with ``create``, made
    0700 if missing (its parent, the configured root, is created as needed and trusted as configured). The last
    component is never followed if it is a symbolic link. Raises FileNotFoundError if missing and not ``create``."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if create:
        os.makedirs(parent, exist_ok=True)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        made = False
        if create:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=pfd)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except OSError as exc:
            why = _refusal(path, exc, directory=True)
            if why is not None:
                raise why from None
            raise
    finally:
        os.close(pfd)
    try:
        if made:
            os.fchmod(fd, DIR_MODE)  # exactly 0700 whatever the umask
        check_adopted(fd, path, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: str | os.PathLike[str]) -> None:
    """Create directory ``path`` 0700, or adopt it if it exists and is this user's and private; refuse it
    (:class:`UntrustedPathError`) if another user owns it, others may write into it, or it is a symbolic link or
    not a directory. A directory of ours readable by others (0755, as earlier versions made them) is set to
    0700 with a warning."""
    os.close(open_private_dir(path, create=True))


def _open_file(dir_fd: int, name: str, flags: int, where: str) -> int:
    try:
        return os.open(name, flags | _NOFOLLOW | os.O_NONBLOCK, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise UntrustedPathError(os.path.join(where, name), "it is not a regular file (symbolic links are "
                                                                "never followed)") from None
        raise


def read_private_file(dir_fd: int, name: str, *, limit: int, where: str = "") -> bytes | None:
    """The first ``limit`` bytes of file ``name`` in the directory open as ``dir_fd``, None if there is none.
    Never follows a symlink, never blocks (a FIFO is refused), refuses a file that is not this user's or that
    others may write. ``where``: the directory's path, for messages."""
    _check_name(name)
    try:
        fd = _open_file(dir_fd, name, os.O_RDONLY, where)
    except FileNotFoundError:
        return None
    try:
        check_adopted(fd, os.path.join(where, name), directory=False)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def write_private_file(dir_fd: int, name: str, data: bytes) -> None:
    """Replace file ``name`` in the directory open as ``dir_fd`` atomically (a 0600 temporary file created
    exclusively, without following links, then renamed over it: a reader sees the old or the new content)."""
    _check_name(name)
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, FILE_MODE)
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def _check_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"invalid file name {name!r}: a plain name without '/' is allowed")


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat`` field 22), or None if there is
    no such live process (or it is a zombie). With the pid it identifies one process: a reused pid has another
    start time."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read(4096)
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # Field 2 is "(comm)" and comm may hold spaces or ')': the fields after it start at the LAST ')'.
    rest = raw[raw.rfind(b")") + 1:].split()
    try:
        state, start = rest[0], int(rest[19])  # fields 3 and 22
    except (IndexError, ValueError):
        return None
    return None if state in (b"Z", b"X", b"x") else start


# -- the per-user key behind default job ids ---------------------------------------------------------------
KEY_NAME = "job-key"
_KEY_HEX = 64


def _key_dirs() -> list[str]:
    home = os.path.expanduser("~")
    dirs = [os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "deadpool")]
    dirs.append(os.path.join(tempfile.gettempdir(), f"deadpool-{os.getuid()}"))
    return dirs


def user_key(directory: str | None = None) -> bytes:
    """This user's secret key (32 random bytes, made once, kept in a private file): the material default job
    ids are derived from, so another user of the node cannot compute the name of a job's shared memory.

    ``directory`` (tests) or, in order, ``$XDG_CACHE_HOME/deadpool`` (``~/.cache/deadpool``) and
    ``<tmp>/deadpool-<uid>``; the first that can be used. Raises :class:`UntrustedPathError` (a directory or
    key file that is not this user's) or OSError naming the places tried."""
    tried: list[str] = []
    for d in [directory] if directory is not None else _key_dirs():
        try:
            return _load_key(d)
        except UntrustedPathError:
            raise
        except OSError as exc:
            tried.append(f"{d} ({exc.strerror or exc})")
    raise OSError(errno.EACCES, "no place for this user's deadpool key (it names job memory): tried "
                  + "; ".join(tried) + "; set the config's job_id or DEADPOOL_JOB_ID instead")


def _load_key(directory: str) -> bytes:
    dfd = open_private_dir(directory, create=True)
    try:
        try:
            # Several ranks of a node may get here together: one creates the file, the others read it.
            fd = os.open(KEY_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, FILE_MODE, dir_fd=dfd)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, FILE_MODE)
                os.write(fd, secrets.token_hex(_KEY_HEX // 2).encode())
            finally:
                os.close(fd)
        deadline = time.monotonic() + 5.0
        while True:
            raw = read_private_file(dfd, KEY_NAME, limit=_KEY_HEX + 2, where=directory) or b""
            if len(raw) >= _KEY_HEX or time.monotonic() > deadline:
                break
            time.sleep(0.01)  # its creator is between creating and writing it
    finally:
        os.close(dfd)
    key = raw.strip()
    if len(key) != _KEY_HEX or any(c not in b"0123456789abcdef" for c in key):
        raise UntrustedPathError(os.path.join(directory, KEY_NAME), f"expected {_KEY_HEX} hex digits (a key made by "
                                                                    "deadpool); remove it to make a new one")
    return bytes.fromhex(key.decode())


def derive_id(key: bytes, public: str, *, prefix: str = "j", nchars: int = 24) -> str:
    """``prefix`` + the first ``nchars`` hex digits of HMAC-SHA256(key, public): stable for one key and one
    ``public``, unknown to anyone without the key."""
    return prefix + hmac.new(key, public.encode(), hashlib.sha256).hexdigest()[:nchars]
