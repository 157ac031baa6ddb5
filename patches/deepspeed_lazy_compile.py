"""DeepSpeed: ``deepspeed.runtime.compiler.compile()`` defers ``torch.compile`` to a function's first call.

Why: every ZeRO engine build imports DeepSpeed's Muon optimizer module (the ZeRO 1-3 optimizers check whether
the optimizer is a ``MuonWithAuxAdam``: ``stage3.py``, ``stage_1_and_2.py``), and ``original_muon.py``
decorates three functions with ``@compiler.compile()``, which is ``torch.compile(fn)`` at import time.
``torch.compile`` imports TorchDynamo and Inductor: 2-3 s of CPU per process on a 2-core host, paid by every
worker at start, by a hot-swap spare and by every restarted process, though nothing calls those functions unless
the job trains with Muon.

With the patch, ``compiler.compile()`` returns a decorator that keeps the function and calls
``torch.compile(fn)`` on its first call. ``torch.compile`` itself only wraps a function until its first call,
so a job that trains with Muon compiles exactly as before, and any other job never imports TorchDynamo for it.
Nothing else changes: the decorated functions are the same functions, called with the same arguments.
Applied with the extension's other DeepSpeed start-up patch (``deadpool_ext.integrations.deepspeed.warmup``),
before DeepSpeed imports the Muon module, and left applied. A module that already ran its decorators (Muon
imported before the patch) keeps what it has.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from .base import Patch

SUPPORTED_DEEPSPEED = ">=0.16,<0.20"


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def lazy_compile() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """What ``deepspeed.runtime.compiler.compile()`` returns under the patch: a decorator whose function is
    handed to ``torch.compile`` the first time it is called (DeepSpeed's own fallback, the function unchanged,
    where torch has no ``compile``)."""
    import torch

    if not hasattr(torch, "compile"):
        return _identity

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: list[Callable[..., Any]] = []
        lock = threading.Lock()

        @functools.wraps(fn)
        def compiled_on_first_call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(torch.compile(fn))
            return compiled[0](*args, **kwargs)

        compiled_on_first_call.__deadpool_lazy_compile__ = True  # type: ignore[attr-defined]
        return compiled_on_first_call

    return decorate


class LazyCompile(Patch):
    name = "deepspeed_lazy_compile"
    requires = {"deepspeed": SUPPORTED_DEEPSPEED}
    why = "DeepSpeed's Muon module called torch.compile at import (TorchDynamo and Inductor imported by every ZeRO " \
          "process): now on the decorated function's first call"

    def _apply(self) -> None:
        from deepspeed.runtime import compiler

        self._swap(compiler, "compile", lazy_compile)


PATCH = LazyCompile()
apply = PATCH.apply
revert = PATCH.revert
