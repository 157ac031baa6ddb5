"""deadpool_ext: keeps DeepSpeed and Megatron-Core training jobs alive through failures.

Entry points: :mod:`deadpool_ext.deepspeed` (``initialize`` / ``register``), the ``"deadpool"`` config section
(:class:`deadpool_ext.config.DeadpoolConfig`). See docs/architecture.md.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .config import ConfigError, DeadpoolConfig  # noqa: E402

__all__ = ["__version__", "ConfigError", "DeadpoolConfig"]
