"""Runs at interpreter start in every process of a job traced by ``deadpool_ext.testing.trace_modules`` (this folder
is on the job's ``PYTHONPATH`` only then): installs the module tracer when ``DEADPOOL_TRACE_MODULES`` names a
folder, then runs the ``sitecustomize`` this file shadows, if the interpreter has one, so nothing else changes.
The product never reads that variable and holds no hook for it: with this folder off the path nothing runs."""
from __future__ import annotations

import importlib.util
import os
import sys


def _install() -> None:
    if os.environ.get("DEADPOOL_TRACE_MODULES"):
        from deadpool_ext.testing.trace_hook import install

        install(os.environ["DEADPOOL_TRACE_MODULES"])


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(os.path.dirname(candidate)) == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_deadpool_shadowed_sitecustomize", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


_install()
_chain()
