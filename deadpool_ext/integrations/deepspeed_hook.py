"""The zero-code path: every ``deepspeed.initialize`` whose config has a ``"deadpool"`` section attaches the
extension, whoever calls it (a raw call, Hugging Face Trainer through Accelerate, Accelerate's DeepSpeed plugin,
Lightning's ``DeepSpeedStrategy``).

Installed explicitly, never by importing the package: by ``python -m deadpool_ext.run`` and ``deadpool-run``
before the job's script starts, or by ``import deadpool_ext.auto`` for other launches. The replacement of
``deepspeed.initialize`` is the version-guarded patch ``deadpool_ext.patches.deepspeed_initialize_hook``; an
unsupported DeepSpeed refuses to install (one line naming the versions), it never half-applies.

What the hook does at each call (:func:`_hooked`):

1. find the config the call carries (``config=``, ``config_params=``, or ``args.deepspeed_config``): a dict or a
   JSON file;
2. no ``"deadpool"`` section: DeepSpeed as it is; but if a config named on the command line has a section
   (:func:`expect_sections`, the runner does it), the job would run unprotected: :class:`NotAttachedError`
   names the file and why;
3. a section: :func:`deadpool_ext.integrations.deepspeed.initialize` with the unpatched DeepSpeed function (the
   section split off, the process group on the attempt-prefixed store if none exists yet, the runtime
   registered as ``engine.deadpool``), logged with the caller.

Call order: :func:`install` (idempotent; with ``lazy=True`` only once ``deepspeed`` is imported) ->
the job runs -> :func:`report` (what was attached, for the runner's exit check).
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import SECTION, ConfigError
from .importhook import after_import

log = logging.getLogger("deadpool_ext")

MAX_CONFIG_BYTES = 16 << 20
"""A command-line argument naming a larger file is not read as a DeepSpeed config."""


class NotAttachedError(ConfigError):
    """A config with a ``"deadpool"`` section was named for this job, but the engine was built without it."""


@dataclass
class HookState:
    installed: bool = False
    pending: bool = False
    """Waiting for ``deepspeed`` to be imported (lazy install)."""
    expected: list[str] = field(default_factory=list)
    """Configs named on the command line that have a section."""
    attached: list[str] = field(default_factory=list)
    """One entry per engine the hook attached to (where the call came from)."""
    plain: int = 0
    """Calls without a section (passed to DeepSpeed unchanged)."""
    reuse: Any = None
    """An engine recovered in place that the next ``initialize`` of its module returns (:func:`reuse_engine`)."""


_state = HookState()


def state() -> HookState:
    return _state


def _patch() -> Any:
    from .. import patches  # type: ignore[attr-defined]  # patches/, mapped in at install (package_dir)

    return patches.get("deepspeed_initialize_hook")


def original_initialize() -> Callable[..., Any]:
    """``deepspeed.initialize`` as DeepSpeed defines it (bypassing the hook when it is installed)."""
    import deepspeed

    try:
        p = _patch()
    except ImportError:
        return deepspeed.initialize  # type: ignore[no-any-return]
    return p.original if p.applied and p.original is not None else deepspeed.initialize  # type: ignore[no-any-return]


def install(*, lazy: bool = False) -> None:
    """Route ``deepspeed.initialize`` through the hook. ``lazy``: if DeepSpeed is not imported yet, install when
    it is (a job that never imports DeepSpeed pays nothing). Raises ``UnsupportedVersionError`` (one line) for a
    DeepSpeed the patch was not written for."""
    if _state.installed or _state.pending:
        return
    if lazy and "deepspeed" not in sys.modules:
        _state.pending = True
        after_import("deepspeed", _install_now)
        log.debug("deepspeed_initialize_hook: installed once deepspeed is imported")
        return
    _install_now()


def _install_now() -> None:
    p = _patch()
    p.set_wrapper(_make_wrapper)
    p.apply()
    _state.installed, _state.pending = True, False
    import deepspeed

    log.info("deadpool_ext hook on deepspeed.initialize (DeepSpeed %s): every engine whose config has a "
             "\"deadpool\" section gets the extension", getattr(deepspeed, "__version__", "?"))


def _make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        return _hooked(original, args, kwargs)

    return initialize


def _caller() -> str:
    """``module:function`` of the first frame outside this module and DeepSpeed's (who built the engine)."""
    for fr in inspect.stack(context=0)[2:]:
        mod = fr.frame.f_globals.get("__name__", "?")
        if not mod.startswith(("deadpool_ext.integrations.deepspeed", "deepspeed")):
            return f"{mod}:{fr.function}"
    return "?"


def config_of_call(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The config a ``deepspeed.initialize`` call carries: ``config``, ``config_params`` or
    ``args.deepspeed_config`` (DeepSpeed's own order), else None."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    ns = kwargs.get("args", args[0] if args else None)
    return getattr(ns, "deepspeed_config", None)


def _has_section(cfg: Any) -> bool:
    if isinstance(cfg, dict):
        return SECTION in cfg
    if isinstance(cfg, (str, os.PathLike)):
        doc = read_json(os.fspath(cfg))
        return isinstance(doc, dict) and SECTION in doc
    return False


def reuse_engine(engine: Any) -> None:
    """The next ``deepspeed.initialize`` of ``engine.module`` returns ``engine`` (recovered in place) instead of
    building another: a framework that re-runs its set-up after a recovery (the HF Trainer's re-entered loop
    through Accelerate's ``prepare``) keeps the same engine, optimizer and scheduler."""
    _state.reuse = engine


def _hooked(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    kept = _state.reuse
    if kept is not None and kwargs.get("model", args[1] if len(args) > 1 else None) is kept.module:
        _state.reuse = None
        log.info("deadpool_ext: deepspeed.initialize by %s returns the engine recovered in place (no new engine)",
                 _caller())
        return kept, kept.optimizer, kept.training_dataloader, kept.lr_scheduler
    cfg = config_of_call(args, kwargs)
    if not _has_section(cfg):
        _state.plain += 1
        if _state.expected:
            what = "a dict" if isinstance(cfg, dict) else repr(os.fspath(cfg)) if isinstance(
                cfg, (str, os.PathLike)) else "no config"
            raise NotAttachedError(
                f"deadpool_ext: {', '.join(_state.expected)} (on the command line) has a \"{SECTION}\" section, but "
                f"the DeepSpeed engine built by {_caller()} got {what} without it: the framework or the script "
                "passed another config (or a copy that dropped the key), so the job would run unprotected. Pass "
                f"that file as the DeepSpeed config, or add the \"{SECTION}\" section to the config the script builds")
        return original(*args, **kwargs)
    from .deepspeed import initialize as attach_initialize

    who = _caller()
    log.info("deadpool_ext: attaching to the DeepSpeed engine built by %s (its config has a \"%s\" section)",
             who, SECTION)
    out = attach_initialize(*args, _ds_initialize=original, **kwargs)
    _state.attached.append(who)
    return out


def configs_with_section(argv: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """(path, parsed JSON) of every config named in ``argv`` (``x.json``, ``--flag=x.json``) whose ``"deadpool"``
    section is present and not ``enabled: false``."""
    found = []
    for arg in argv:
        path = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if not path.endswith(".json") or not os.path.isfile(path):
            continue
        doc = read_json(path)
        if isinstance(doc, dict) and isinstance(doc.get(SECTION), dict) and doc[SECTION].get("enabled", True):
            found.append((path, doc))
    return found


def expect_sections(paths: Sequence[str]) -> None:
    """Configs with a section named for this job (by the runner): an engine later built without the section is
    then a :class:`NotAttachedError` instead of an unprotected job."""
    _state.expected = list(paths)


def read_json(path: str) -> Any:
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
