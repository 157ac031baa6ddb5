"""deadpool_ext: keeps DeepSpeed and Megatron-Core training jobs alive through failures.

The public API is what ``__all__`` lists; everything else is internal and may change::

    import deadpool_ext as dp

    engine, optimizer, _, scheduler = dp.initialize(model=model, config="ds_config.json", ...)  # or dp.register
    for step in dp.resilient_steps(engine, loader, max_steps=N):   # restores after a restart or a hot-swap
        with step as batch:
            ...

Launch with ``deadpool-run`` (spares and hot-swap), or ``torchrun ... -m deadpool_ext.run`` (restarts from
memory); ``import deadpool_ext.auto`` hooks DeepSpeed for other launches. Importing ``deadpool_ext`` itself hooks
nothing and loads no framework: the names below are imported on first use (the launcher and ``deadpool check``
start without torch). See docs/architecture.md.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .config import ConfigError, DeadpoolConfig  # noqa: E402  (no framework behind it)

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "initialize": "deadpool_ext.integrations.deepspeed",
    "register": "deadpool_ext.integrations.deepspeed",
    "DeadpoolRuntime": "deadpool_ext.integrations.deepspeed",
    "resilient_steps": "deadpool_ext.integrations.steps",
    "ResilientSteps": "deadpool_ext.integrations.steps",
    "ResilientLoop": "deadpool_ext.integrations.base",
    "MegatronRuntime": "deadpool_ext.integrations.megatron.runtime",
}

__all__ = ["__version__", "ConfigError", "DeadpoolConfig", "DeadpoolRuntime", "MegatronRuntime", "ResilientLoop",
           "ResilientSteps", "initialize", "register", "resilient_steps"]

if TYPE_CHECKING:
    from .integrations.base import ResilientLoop
    from .integrations.deepspeed import DeadpoolRuntime, initialize, register
    from .integrations.megatron.runtime import MegatronRuntime
    from .integrations.steps import ResilientSteps, resilient_steps


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deadpool_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__")})
