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
        rank = worker_env().rank
        handler.setFormatter(logging.Formatter(f"[deadpool r{'?' if rank is None else rank}] %(levelname)s "
                                               "%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
