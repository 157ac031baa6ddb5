"""Runs at interpreter start in every process of a job the chaos harness or a test faults (this folder is on
its ``PYTHONPATH`` only then: ``deadpool_ext.chaos.at_step.harness_env``). Registers the faults named by
``DEADPOOL_INJECT`` / ``DEADPOOL_RESTORE_GATE`` on the product's hook points, then runs the ``sitecustomize``
this file shadows, if the interpreter has one (a distribution's), so nothing else changes."""
from __future__ import annotations

import importlib.util
import os
import sys


def _install() -> None:
    if os.environ.get("DEADPOOL_INJECT") or os.environ.get("DEADPOOL_RESTORE_GATE"):
        from deadpool_ext.chaos.at_step import install

        install()
    if os.environ.get("DEADPOOL_POISON"):
        from deadpool_ext.chaos.poison import install as install_poison

        install_poison()
    if os.environ.get("DEADPOOL_DUMP_STATE"):
        from deadpool_ext.chaos.dump import install as install_dump

        install_dump()


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
