"""Run a function right after a module is first imported (how the runner hooks frameworks a job may never import:
a job that does not use them pays nothing).

Frameworks probe for each other before importing them: ``importlib.util.find_spec("deepspeed")`` (Accelerate's
and transformers' ``is_deepspeed_available()``, Lightning's ``package_available``), ``importlib.metadata``
(versions). A probe asks the import system's finders, ours too, but never runs the module: the hook therefore
stays in place through any number of probes and fires (then leaves) only when the module's code has actually run.
``importlib.metadata`` never asks a finder's ``find_spec`` (it asks ``find_distributions``, which this finder
does not have), so it cannot reach the hook at all.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import Any


def after_import(name: str, fn: Callable[[], None]) -> None:
    """``fn()`` once ``name`` is imported: now if it already is, else right after its module code ran."""
    if name in sys.modules:
        fn()
        return
    sys.meta_path.insert(0, _AfterImport(name, fn))


def pending(name: str) -> bool:
    """A hook for ``name`` is still waiting for its import (for tests and the runner's diagnostics)."""
    return any(isinstance(f, _AfterImport) and f.name == name and not f.fired for f in sys.meta_path)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``fn()`` right after module ``name``'s code ran for the first time (one shot; then removes itself).

    Every ``find_spec`` for ``name`` gets a spec whose loader runs ``fn`` after ``exec_module``: the import that
    really executes the module fires it, a probe that only looks at the spec (and drops it) changes nothing. A
    module whose code raised is not imported; the hook then waits for the next attempt."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        self.name, self.fn = name, fn
        self.fired = False
        self._lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self.fired:
            return None
        spec = self._spec_from_the_others(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def run_then_hook(module: Any) -> None:
            exec_module(module)
            self._fire()

        loader.exec_module = run_then_hook
        return spec

    def _spec_from_the_others(self, fullname: str, path: Any, target: Any) -> Any:
        """The spec the finders after this one give, asked as importlib asks them (``importlib.util.find_spec``
        here would ask this finder again)."""
        finders = list(sys.meta_path)
        after = finders[finders.index(self) + 1:] if self in finders else finders
        for finder in after:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _fire(self) -> None:
        with self._lock:  # two threads importing at once: fn runs once
            if self.fired:
                return
            self.fired = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        self.fn()
