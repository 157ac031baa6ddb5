"""Who read this process's rank while a spare built its engine ahead: what relabelling the engine cannot reach.

Why: a spare built ahead for rank r' may take another rank r of the same world in place (``rebuild/spare.py``
:func:`~deadpool_ext.rebuild.spare.takeover`): its process groups and DeepSpeed's engine are relabelled. What the
script itself read of its rank before ``deepspeed.initialize`` returned (``rank = dist.get_rank()``, a
``DistributedSampler``, ``int(os.environ["RANK"])``, a framework's process index) keeps r' and would make rank r
train on rank r''s data. Such a read is recorded here, with its place (file:line), and then blocks the relabel:
the spare starts again from its script's first line instead, and its start-up line says which read blocked it.

What is watched, from :func:`start` (``build_ahead``) to :func:`stop` (``await_assignment``): the rank answered by
every swappable group (``SwappableGroup.rank``, which ``dist.get_rank`` calls), and ``RANK`` / ``GROUP_RANK`` read
from ``os.environ`` (its class swapped for a recording subclass meanwhile, and swapped back at :func:`stop`). A read
whose first caller outside torch and the standard library is in DeepSpeed or deadpool_ext (but not its demo
training scripts) is not recorded: those are relabelled (``integrations/deepspeed/takeover.py``) or read the rank
again when used. Not seen: a read through a copy of the environment (``dict(os.environ)``, ``os.environ.copy()``,
then indexed), which cannot be told from a library scanning every variable; and a rank computed by native code.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from typing import Any

from .context import context

WATCHED_ENV = ("RANK", "GROUP_RANK")
"""The launcher's variables that differ between the shadowed rank and another (``LOCAL_RANK`` does not: a spare's
process i takes the rank of local index i)."""


def _dir_of(module: str) -> str | None:
    """The directory of the top-level package ``module``, imported or not (a spare's watch starts before the script
    imports DeepSpeed: found by its spec then, which runs none of its code); a namespace package (``megatron``) by
    its first location."""
    mod = sys.modules.get(module)
    path: str | None = getattr(mod, "__file__", None)
    if path is not None:
        return os.path.dirname(os.path.abspath(path)) + os.sep
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin not in (None, "namespace"):
        return os.path.dirname(os.path.abspath(spec.origin)) + os.sep
    places = list(getattr(mod, "__path__", None) or (spec.submodule_search_locations if spec is not None else None)
                  or [])
    return os.path.abspath(places[0]) + os.sep if places else None


def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(skipped: the standard library first, this file, torch; relabelled: DeepSpeed, deadpool_ext)."""
    here = os.path.abspath(__file__)
    pkg = os.path.dirname(os.path.dirname(here)) + os.sep
    skipped = tuple(p for p in (os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep, here,
                                _dir_of("torch")) if p)
    relabelled = tuple(p for p in (_dir_of("deepspeed"), pkg) if p)
    return skipped, relabelled


def caller_outside(frame: Any, skipped: tuple[str, ...], relabelled: tuple[str, ...],
                   user: tuple[str, ...]) -> str | None:
    """The place (``file:line``) of the first frame from ``frame`` outwards whose file is under no ``skipped`` root,
    or None when that frame is under a ``relabelled`` root and under no ``user`` root (pure over the frames)."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if frame.f_code.co_filename.startswith("<") or path.startswith(skipped):
            frame = frame.f_back
            continue
        if path.startswith(relabelled) and not path.startswith(user):
            return None
        return f"{path}:{frame.f_lineno}"
    return None


def note(frame: Any = None) -> None:
    """A read of the rank now, by ``frame`` (default: the caller of ``SwappableGroup.rank``): recorded once per
    place while the watch runs."""
    ctx = context()
    if ctx.rank_watch is None:
        return
    place = caller_outside(frame if frame is not None else sys._getframe(2), *ctx.rank_watch)
    if place is not None and place not in ctx.rank_reads:
        ctx.rank_reads.append(place)


_LOOKUPS = ("get", "getenv")
"""Standard-library frames a single lookup goes through (``os.environ.get``, ``os.getenv``); any other one reading
every variable (``os.environ.items()``, ``copy()``, a subprocess's environment) reads no rank."""


class _WatchedEnviron(os._Environ):  # type: ignore[type-arg]  # os.environ's own class, two methods more
    def keys(self) -> Any:
        # ``dict(os.environ)`` takes the keys, then reads every one from the same line (fsspec does at import):
        # a copy of the environment, not a read of the rank. The caller's (code, line) is kept on the instance.
        caller = sys._getframe(1)
        self._dp_bulk = (caller.f_code, caller.f_lineno)
        return super().keys()

    def __getitem__(self, key: Any) -> Any:
        ctx = context()
        if key in WATCHED_ENV and ctx.rank_watch is not None:
            frame: Any = sys._getframe(1)
            if (frame.f_code, frame.f_lineno) == getattr(self, "_dp_bulk", None):
                return super().__getitem__(key)
            stdlib = ctx.rank_watch[0][:1]  # _roots(): the standard library first
            while frame is not None and frame.f_code.co_name in _LOOKUPS and frame.f_code.co_filename.startswith(
                    ("<",) + stdlib):
                frame = frame.f_back
            if frame is not None and not frame.f_code.co_filename.startswith(("<",) + stdlib):
                note(frame)
        return super().__getitem__(key)


def start() -> None:
    """Watch reads of the rank (a spare building ahead). Idempotent."""
    ctx = context()
    skipped, relabelled = _roots()
    ctx.rank_watch = (skipped, relabelled, (relabelled[-1] + "training" + os.sep,))
    ctx.rank_reads.clear()
    if type(os.environ) is os._Environ:
        os.environ.__class__ = _WatchedEnviron


def stop(covers: tuple[str, ...] = ()) -> str | None:
    """End the watch; the blocker line for a relabel (None: nothing outside DeepSpeed and deadpool_ext read it).
    ``covers``: top-level packages whose reads the framework's relabel covers (``framework_takeover.py``)."""
    ctx = context()
    ctx.rank_watch = None
    if type(os.environ) is _WatchedEnviron:
        env: Any = os.environ
        env.__class__ = os._Environ
        env.__dict__.pop("_dp_bulk", None)
    reads, ctx.rank_reads = ctx.rank_reads, []
    covered = tuple(d for d in (_dir_of(m) for m in covers) if d)
    reads = [r for r in reads if not (covered and os.path.abspath(r).startswith(covered))]
    if not reads:
        return None
    more = f" (and {len(reads) - 3} more place(s))" if len(reads) > 3 else ""
    return f"the script read its rank before deepspeed.initialize returned, at {', '.join(reads[:3])}{more}"
