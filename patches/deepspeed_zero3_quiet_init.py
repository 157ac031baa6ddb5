"""DeepSpeed ZeRO-3: the optimizer's constructor no longer formats every parameter's values for nothing.

Why: ``DeepSpeedZeroOptimizer_Stage3.__init__`` (DeepSpeed 0.19) starts with
``print_rank_0(f"initialized ... with args: {locals()}", force=False)``. The f-string is evaluated on every
rank before ``print_rank_0`` decides not to print it, and ``locals()`` holds the engine's ``param_names``
(a dict keyed by the parameters themselves), so ``repr`` formats the values of every parameter: 0.2-0.3 s
of CPU per rank for GPT small (76 parameters) on this 2-core host, and one device-to-host copy per parameter
on a GPU. It is paid at every engine build, including the rebuild of a hot-swap, where it is on the
critical path.

The patch wraps the constructor and hands it ``param_names`` as a dict whose ``repr`` names the parameters
by count instead of by value. Lookups, iteration and equality are those of a plain dict; nothing else
changes. Harmless in every setting, so :func:`deadpool_ext.deepspeed.initialize` applies it (when the
installed DeepSpeed is one it was written for) and leaves it applied.
"""
from __future__ import annotations

import functools
from typing import Any

from .base import Patch

SUPPORTED_DEEPSPEED = ">=0.16,<0.20"


class QuietParamNames(dict):
    """``param_names`` with a cheap ``repr`` (the values of the keys are never formatted)."""

    def __repr__(self) -> str:
        return f"<{len(self)} parameter names>"

    __str__ = __repr__


class Zero3QuietInit(Patch):
    name = "deepspeed_zero3_quiet_init"
    requires = {"deepspeed": SUPPORTED_DEEPSPEED}
    why = "ZeRO-3's optimizer constructor formatted every parameter's values into a debug message it never prints"

    def _apply(self) -> None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls

        original = cls.__init__

        @functools.wraps(original)
        def __init__(opt: Any, module: Any, init_optimizer: Any, param_names: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(param_names, dict) and not isinstance(param_names, QuietParamNames):
                param_names = QuietParamNames(param_names)
            original(opt, module, init_optimizer, param_names, *args, **kwargs)

        self._swap(cls, "__init__", __init__)


PATCH = Zero3QuietInit()
apply = PATCH.apply
revert = PATCH.revert
