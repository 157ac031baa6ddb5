"""The ``deadpool_ext`` logger's one set-up, shared by every integration: ``[deadpool r<rank>] LEVEL message``
on stderr, not propagated to the root logger (frameworks configure that their own way)."""
from __future__ import annotations

import logging

from .launcher.contract import worker_env


def configure_logging(level: str) -> None:
    """Set the level (the section's ``log_level``); add the handler once per process."""
    logger = logging.getLogger("deadpool_ext")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = _current_rank()
        handler.setFormatter(logging.Formatter(f"[deadpool r{'?' if rank is None else rank}] %(levelname)s "
                                               "%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def _current_rank() -> int | None:
    """The global rank now: the process group's (under deadpool-run the launcher hands no RANK; the rank comes
    with the assignment), else the launcher's variable, else unknown."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return worker_env().rank
