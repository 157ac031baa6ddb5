"""``deepspeed.initialize`` routed through a wrapper the caller supplies (the extension's attach hook).

Why: jobs that never call the extension themselves (Hugging Face Trainer and Accelerate, Lightning's
``DeepSpeedStrategy``, scripts that call ``deepspeed.initialize`` directly) build their engine through
``deepspeed.initialize``, looked up on the module at call time (Accelerate: ``ds_initialize =
deepspeed.initialize``; Lightning: ``deepspeed.initialize(...)``). Replacing that one attribute lets
``deadpool_ext.auto`` / ``python -m deadpool_ext.run`` attach to every engine whose config has a ``"deadpool"``
section, without a change to the job. Code that bound the function earlier (``from deepspeed import initialize``
at its import, before the hook) keeps the original: the hook is installed before the job's script starts.

Call order: ``set_wrapper(make)`` (``make(original) -> replacement``), then ``apply()``; ``original`` is the
unpatched function for callers that must bypass the hook. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Patch

SUPPORTED_DEEPSPEED = ">=0.16,<0.20"


class InitializeHook(Patch):
    name = "deepspeed_initialize_hook"
    requires = {"deepspeed": SUPPORTED_DEEPSPEED}
    why = "deepspeed.initialize goes through the extension's attach hook (engines with a \"deadpool\" section)"

    def __init__(self) -> None:
        super().__init__()
        self._make: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
        self.original: Callable[..., Any] | None = None

    def set_wrapper(self, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_wrapper() after apply()")
        self._make = make

    def _apply(self) -> None:
        import deepspeed

        if self._make is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_wrapper()")
        self.original = deepspeed.initialize
        self._swap(deepspeed, "initialize", self._make(self.original))


PATCH = InitializeHook()
apply = PATCH.apply
revert = PATCH.revert
