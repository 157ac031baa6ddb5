"""The ``deadpool_ext`` logger's one set-up, shared by every integration: ``[deadpool r<rank> <node>] LEVEL message``
on stderr, not propagated to the root logger (frameworks configure that their own way). The rank and node are
read at each line, so they appear once known (under deadpool-run the rank comes with the assignment, and a spare
that takes a node's place shows its new rank) and the lines of a survivor and a spare can be told apart."""
from __future__ import annotations

import logging
import sys

from .launcher.contract import worker_env


def configure_logging(level: str) -> None:
    """Set the level (the section's ``log_level``); add the handler once per process."""
    logger = logging.getLogger("deadpool_ext")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_WorkerFormatter("[deadpool %(deadpool_where)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class _WorkerFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.deadpool_where = where()
        return super().format(record)


_last_rank: int | None = None  # process-wide, for log lines only: the last rank known (a rank's, not a generation's)


def where() -> str:
    """``r<rank>`` (``spare`` for a deadpool-run spare not assigned yet, ``r?`` when unknown), then the node under
    deadpool-run. The last rank known is kept while a hot-swap has no process group."""
    global _last_rank
    rank = _current_rank()
    if rank is not None:
        _last_rank = rank
    env = worker_env()
    hs = env.hot_swap
    who = (f"r{_last_rank}" if _last_rank is not None
           else "spare" if hs is not None and hs.role == "spare" else "r?")
    return f"{who} {hs.node}" if hs is not None else who


def _current_rank() -> int | None:
    """The global rank now: the process group's (under deadpool-run the launcher hands no RANK; the rank comes
    with the assignment), else the launcher's variable, else unknown."""
    if "torch.distributed" not in sys.modules:  # no group without it; a line never imports torch
        return worker_env().rank
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a group being torn down (a hot-swap): the last rank known stands
        return None
    return worker_env().rank
