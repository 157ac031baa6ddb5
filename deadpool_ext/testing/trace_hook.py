"""The call hook of ``testing.trace_modules``, installed in every process of a traced job.

``trace_boot/sitecustomize.py`` calls :func:`install` at interpreter start when ``DEADPOOL_TRACE_MODULES`` names a
folder; the hook records, per 50 ms bucket, which functions of the package ran in which thread and the nearest calling
module of the package, and writes ``<pid>.json`` into that folder once a second and at exit. The report that reads
these files is ``trace_modules.py``'s. A tool beside the product: nothing of the product imports it.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections import defaultdict
from types import FrameType
from typing import Any

__all__ = ["BOOT_DIR", "BUCKET_S", "ENV", "PKG_DIR", "REPO", "install", "module_of"]

ENV = "DEADPOOL_TRACE_MODULES"
"""The folder each traced process writes ``<pid>.json`` into (set by :func:`run` for the job)."""
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_boot")
"""Folder holding the ``sitecustomize`` that calls :func:`install` in every process of a traced job."""
BUCKET_S = 0.05
_NEWLOCALS = 0x2  # inspect.CO_NEWLOCALS: set for functions, not for module and class bodies
PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PKG_DIR)


def module_of(filename: str) -> str:
    """The dotted module of a source file of the package (``deadpool_ext.patches.*`` lives in ``patches/``);
    ``script:<path>`` for the repository's scripts; '' for anything else."""
    path = os.path.abspath(filename)
    if path.startswith(PKG_DIR + os.sep) and path.endswith(".py"):
        rel = os.path.relpath(path, REPO)[:-3]
    elif path.startswith(os.path.join(REPO, "patches") + os.sep) and path.endswith(".py"):
        rel = "deadpool_ext/" + os.path.relpath(path, REPO)[:-3]
    elif path.startswith(os.path.join(REPO, "scripts") + os.sep):
        return "script:" + os.path.relpath(path, REPO)
    else:
        return ""
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


# -- in every traced process -----------------------------------------------------------------------------------


class _Tracer:
    """The call hook and what it recorded; written as ``<pid>.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.start = time.time()
        self.modules: dict[str, str] = {}
        self.threads: dict[int, str] = {}
        self.calls: dict[tuple[str, str, str], dict[int, list[float]]] = defaultdict(dict)
        self.edges: dict[tuple[str, str, bool], set[int]] = defaultdict(set)
        self.imports: dict[str, int] = {}
        self.steps: list[tuple[int, int, float]] = []
        self.changed = True
        self.me = module_of(__file__)
        self._dumping = threading.Lock()  # the dump thread and atexit: one writer at a time

    def _module(self, filename: str) -> str:
        mod = self.modules.get(filename)
        if mod is None:
            mod = module_of(filename)
            mod = "" if mod == self.me or mod.startswith("deadpool_ext.testing.trace_boot") else mod
            self.modules[filename] = mod
        return mod

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        mod = self.modules.get(code.co_filename)
        if mod is None:
            mod = self._module(code.co_filename)
        if not mod:
            return None
        now = time.time()
        bucket = int(now / BUCKET_S)
        body = not code.co_flags & _NEWLOCALS  # a module's or a class's body: it is being imported
        if not body and code.co_name.startswith("<") and frame.f_back is not None:
            body = not frame.f_back.f_code.co_flags & _NEWLOCALS  # a comprehension in such a body
        if body:
            self.imports.setdefault(mod, bucket)
            self.changed = True
            return None
        ident = threading.get_ident()
        thread = self.threads.get(ident)
        if thread is None:
            thread = self.threads[ident] = threading.current_thread().name
        seen = self.calls[(mod, code.co_qualname, thread)]
        span = seen.get(bucket)
        if span is None:
            seen[bucket] = [now, now]
        else:
            span[1] = now
        self.changed = True
        caller = frame.f_back
        for depth in range(64):
            if caller is None:
                break
            cmod = self._module(caller.f_code.co_filename)
            if cmod:
                if cmod != mod:  # direct: called from that module's code, not through a library's (torch, a dataclass)
                    self.edges[(cmod, mod, depth == 0)].add(bucket)
                break
            caller = caller.f_back
        return None

    def after_step(self, step: int, rank: int, **_: object) -> None:
        self.steps.append((int(step), int(rank), time.time()))
        self.changed = True

    def dump(self) -> None:
        with self._dumping:
            self._dump()

    def _dump(self) -> None:
        from ..launcher.contract import WORKER_ID

        if not self.changed:
            return
        self.changed = False
        rec = {
            "pid": os.getpid(), "argv": sys.argv, "worker_id": os.environ.get(WORKER_ID),
            "start": self.start, "bucket_s": BUCKET_S, "steps": list(self.steps), "imports": dict(self.imports),
            "calls": [[m, f, t, sorted(b.values())] for (m, f, t), b in list(self.calls.items())],
            "edges": [[a, b, d, sorted(s)] for (a, b, d), s in list(self.edges.items())],
        }
        path = os.path.join(self.out_dir, f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh)
        os.replace(tmp, path)

    def dump_every(self, period_s: float) -> None:
        while True:
            time.sleep(period_s)
            try:
                self.dump()
            except OSError:
                pass


_tracer: _Tracer | None = None


def install(out_dir: str) -> None:
    """Trace this process's calls into the package (once). Called by ``trace_boot/sitecustomize.py``."""
    global _tracer
    if _tracer is not None:
        return
    os.makedirs(out_dir, exist_ok=True)
    _tracer = tracer = _Tracer(out_dir)
    threading.Thread(target=tracer.dump_every, args=(1.0,), name="trace-modules-dump", daemon=True).start()
    atexit.register(tracer.dump)
    from .. import hooks

    hooks.register(hooks.AFTER_STEP, tracer.after_step)
    threading.settrace(tracer.trace)  # type: ignore[arg-type]
    sys.settrace(tracer.trace)  # type: ignore[arg-type]
