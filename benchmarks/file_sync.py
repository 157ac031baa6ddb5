"""A checkpoint's files made durable without touching anyone else's: ``fsync`` of each file under its folder and of
the folders themselves (issue 45: a machine-wide ``os.sync()`` at the end of a peer's window also waited for every
other process's dirty pages on a shared host, and charged them to the peer)."""
from __future__ import annotations

import os


def fsync_tree(directory: str) -> int:
    """fsync every regular file under ``directory``, then every folder (so new names are durable too); returns
    the files synced. Files that vanish meanwhile (another rank's housekeeping) are skipped."""
    n = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                n += 1
            finally:
                os.close(fd)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return n
