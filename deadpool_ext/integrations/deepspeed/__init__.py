"""DeepSpeed integration: one call turns the extension on for an existing DeepSpeed job.

Either replace ``deepspeed.initialize`` with :func:`initialize` (same arguments and return values; the
``"deadpool"`` section of the config is split off and applied), or keep ``deepspeed.initialize`` and call
:func:`register` on the engine with the section.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from ...config import DeadpoolConfig, split_deepspeed_config
from .runtime import DeadpoolRuntime

log = logging.getLogger("deadpool_ext")


def register(engine: Any, config: DeadpoolConfig | dict[str, Any] | None = None) -> DeadpoolRuntime:
    """Attach the extension to an initialised DeepSpeed engine; returns the runtime (also ``engine.deadpool``)."""
    if getattr(engine, "deadpool", None) is not None:
        raise RuntimeError("deadpool_ext.register: this engine already has the extension attached")
    cfg = config if isinstance(config, DeadpoolConfig) else DeadpoolConfig.from_dict(config)
    _configure_logging(cfg.log_level)
    runtime = DeadpoolRuntime(engine, cfg)
    engine.deadpool = runtime
    return runtime


def initialize(*args: Any, config: Any = None, config_params: Any = None, **kwargs: Any):
    """Drop-in for ``deepspeed.initialize``: same arguments, same 4-tuple; the engine has ``.deadpool``
    (``None`` when the config has no ``"deadpool"`` section)."""
    import deepspeed

    cfg_in = config if config is not None else config_params
    if cfg_in is None and len(args) > 0 and hasattr(args[0], "deepspeed_config"):
        cfg_in = args[0].deepspeed_config
        args[0].deepspeed_config = None
    if cfg_in is None:
        raise ValueError("deadpool_ext.deepspeed.initialize needs a DeepSpeed config (config=PATH or dict)")
    ds_config, dp_config = split_deepspeed_config(cfg_in)
    out = deepspeed.initialize(*args, config=ds_config, **kwargs)
    engine = out[0]
    if dp_config is None:
        engine.deadpool = None
        log.info("no \"deadpool\" section in the DeepSpeed config: extension not attached")
    else:
        register(engine, dp_config)
    return out


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("deadpool_ext")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "?")
        handler.setFormatter(logging.Formatter(f"[deadpool r{rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


__all__ = ["initialize", "register", "DeadpoolRuntime"]
