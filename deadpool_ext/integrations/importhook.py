"""Run a function right after a module is first imported (how the runner hooks frameworks a job may never import:
a job that does not use them pays nothing)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


def after_import(name: str, fn: Callable[[], None]) -> None:
    """``fn()`` once ``name`` is imported: now if it already is, else right after its module code ran."""
    if name in sys.modules:
        fn()
        return
    sys.meta_path.insert(0, _AfterImport(name, fn))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``fn()`` right after module ``name`` is first imported (one shot; then removes itself)."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, fn = loader.exec_module, self.fn

        def run_then_hook(module: Any) -> None:
            exec_module(module)
            fn()

        loader.exec_module = run_then_hook
        return spec
