"""Every file read from checkpoint storage is opened here: a regular file, or refused in one line without blocking.

Why: ``open()`` of a named pipe blocks until someone writes to it, so a FIFO put where a checkpoint file was
hangs the reader forever (``deadpool export``, ``verify``, ``--load``, the restore at launch, the private cache);
opening a device may have effects of its own, and a socket cannot be read as a file. The path is first looked
at with ``lstat`` (nothing but a regular file is ever opened), then opened ``O_NONBLOCK | O_NOFOLLOW`` (a name
swapped for a FIFO in between cannot block the open) and checked again with ``fstat``: the same inode, still a
regular file. The descriptor is set back to blocking before use.

Directories keep raising ``IsADirectoryError`` and symbolic links ``OSError(ELOOP)``, as callers expect.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import IO

from .records import UnsafePathError, one_line

__all__ = ["NotRegularFileError", "open_regular_file", "kind_of"]


class NotRegularFileError(UnsafePathError):
    """A path read from storage is a FIFO, a device or a socket (or was swapped while being opened)."""


def kind_of(mode: int) -> str:
    """What a file of `mode` is, in words."""
    for test, word in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return word
    return f"file of type {stat.S_IFMT(mode):o}"


def _refuse(shown: str, mode: int) -> NotRegularFileError:
    return NotRegularFileError(f"{one_line(shown, 300)}: a {kind_of(mode)}, not a regular file; checkpoint files are "
                               "read only from regular files (refused without reading it)")


def open_regular_file(path: str, shown: str | None = None) -> IO[bytes]:
    """`path` opened for binary reading, if it is a regular file (not through a symbolic link); `shown` is how
    messages name it (a storage URL). Raises `FileNotFoundError`, `IsADirectoryError`, ``OSError(ELOOP)`` for a
    link, or `NotRegularFileError` naming the kind of file; never blocks on the file's kind."""
    name = shown or path
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link (refused)", path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "not a regular file", path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(name, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise _refuse(name, now.st_mode)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise NotRegularFileError(f"{one_line(name, 300)}: replaced while being opened; refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
