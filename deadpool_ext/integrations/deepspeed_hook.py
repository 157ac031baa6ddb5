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
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import SECTION, ConfigError
from ..recovery.timeline import write_event
from .importhook import after_import

log = logging.getLogger("deadpool_ext")

MAX_CONFIG_BYTES = 16 << 20
"""A command-line argument naming a larger file is not read as a DeepSpeed config."""


class NotAttachedError(ConfigError):
    """A config with a ``"deadpool"`` section was named for this job, but the engine was built without it."""

    def __init__(self, message: str, *, built_by: str) -> None:
        super().__init__(message)
        self.built_by = built_by
        """``module:function`` that called ``deepspeed.initialize`` without the section."""


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


_state = HookState()  # process-wide: deepspeed.initialize is patched once per process


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
    """The config a ``deepspeed.initialize`` call carries: ``config``, ``config_params``, ``args.deepspeed_config``
    or the deprecated ``args.deepscale_config`` (DeepSpeed's own order), else None."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    ns = kwargs.get("args", args[0] if args else None)
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(ns, attr, None) is not None:
            return getattr(ns, attr)
    return None


def load_config(cfg: Any) -> dict[str, Any] | None:
    """The config as DeepSpeed reads it (``load_ds_config``): a dict as it is; a path read as JSON, or as HJSON
    (DeepSpeed's own reader accepts comments and unquoted keys); any other string as base64-encoded (H)JSON.
    None when DeepSpeed could not read it either (DeepSpeed then names the problem itself)."""
    if isinstance(cfg, dict):
        return cfg
    if not isinstance(cfg, (str, os.PathLike)):
        return None
    text = os.fspath(cfg)
    if os.path.isfile(text):
        doc = read_json(text)
        if doc is None:
            doc = _read_hjson(text)
        return doc if isinstance(doc, dict) else None
    try:
        import base64

        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
        doc = json.loads(decoded)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _read_hjson(path: str) -> Any:
    try:
        import hjson  # DeepSpeed's dependency: present wherever DeepSpeed is
    except ImportError:
        return None
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            return None
        with open(path, encoding="utf-8") as fh:
            return hjson.load(fh)
    except (OSError, ValueError, RecursionError):
        return None


def _has_section(cfg: Any) -> bool:
    doc = load_config(cfg)
    return isinstance(doc, dict) and SECTION in doc


def engine_section(engine: Any) -> Any:
    """The ``"deadpool"`` section of the config a built engine holds (DeepSpeed keeps unknown keys in its
    parameter dict), else None: the check after the build, for a config the call did not show a section in."""
    params = getattr(getattr(engine, "_config", None), "_param_dict", None)
    return params.get(SECTION) if isinstance(params, dict) else None


def reuse_engine(engine: Any) -> None:
    """The next ``deepspeed.initialize`` of ``engine.module`` returns ``engine`` (recovered in place) instead of
    building another: a framework that re-runs its set-up after a recovery (the HF Trainer's re-entered loop
    through Accelerate's ``prepare``) keeps the same engine, optimizer and scheduler."""
    _state.reuse = engine


def _hooked(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    kept = _state.reuse
    if kept is not None and kwargs.get("model", args[1] if len(args) > 1 else None) is kept.module:
        _state.reuse = None
        who = _caller()
        log.info("deadpool_ext: deepspeed.initialize by %s returns the engine recovered in place (no new engine)", who)
        write_event(event="engine_reused", by=who)
        return kept, kept.optimizer, kept.training_dataloader, kept.lr_scheduler
    cfg = config_of_call(args, kwargs)
    if not _has_section(cfg):
        _state.plain += 1
        if _state.expected:
            who = _caller()
            what = "a dict" if isinstance(cfg, dict) else repr(os.fspath(cfg)) if isinstance(
                cfg, (str, os.PathLike)) else "no config"
            raise NotAttachedError(
                f"deadpool_ext: {', '.join(_where(p) for p in _state.expected)} has a \"{SECTION}\" section, but "
                f"the DeepSpeed engine built by {who} got {what} without it: the framework or the script "
                "passed another config (or a copy that dropped the key), so the job would run unprotected. Pass "
                f"that file as the DeepSpeed config, or add the \"{SECTION}\" section to the config the script builds",
                built_by=who)
        out = original(*args, **kwargs)
        late = engine_section(out[0]) if isinstance(out, tuple) and out else None
        if isinstance(late, dict) and late.get("enabled", True) and getattr(out[0], "deadpool", None) is None:
            # DeepSpeed read a section the call did not show us (a config form we do not parse): attach now rather
            # than train unprotected; the process group is the job's own (a torchrun restart may then fail in its
            # connect: pytorch/pytorch#135712), which the line says.
            from .deepspeed import register

            who = _caller()
            log.warning("deadpool_ext: the DeepSpeed engine built by %s has a \"%s\" section in its own config that "
                        "its call did not show; attached after the build (pass the config as a dict or a JSON file "
                        "so that the process group is built on the attempt-prefixed store)", who, SECTION)
            register(out[0], late)
            _state.attached.append(who)
        return out
    from .deepspeed import initialize as attach_initialize

    who = _caller()
    log.info("deadpool_ext: attaching to the DeepSpeed engine built by %s (its config has a \"%s\" section)",
             who, SECTION)
    write_event(event="attached", by=who)
    if not isinstance(cfg, dict):  # HJSON or base64: the attach path splits the section off a dict (and takes the
        # config off a copy of the caller's args, never the caller's own: integrations/deepspeed args_without_config)
        kwargs = {k: v for k, v in kwargs.items() if k != "config_params"}
        kwargs["config"] = load_config(cfg)
    out = attach_initialize(*args, _ds_initialize=original, **kwargs)
    _state.attached.append(who)
    return out


DEEPSPEED_CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepscale_config", "--deepspeed_config_file")
"""Flags whose value is a DeepSpeed config whatever its file name (HF ``TrainingArguments``, DeepSpeed's own
``add_config_arguments``, Accelerate's name)."""
ACCELERATE_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
"""Set by ``accelerate launch`` in every worker from ``--deepspeed_config_file`` or the config YAML's
``deepspeed_config_file``; Accelerate's ``DeepSpeedPlugin`` reads the DeepSpeed config from it."""


def named_configs(argv: Sequence[str], environ: dict[str, str] | None = None) -> list[tuple[str, str, bool]]:
    """(path, where, surely a DeepSpeed config) of every existing file this job names as a config before it runs:
    the value of a DeepSpeed flag (``--deepspeed ds``, ``--deepspeed_config=ds``; surely a config), any other
    ``x.json`` / ``--flag=x.json`` argument (maybe data), and ``ACCELERATE_DEEPSPEED_CONFIG_FILE``."""
    out: list[tuple[str, str, bool]] = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if arg.startswith("-") and eq:
            path, by_flag = value, flag in DEEPSPEED_CONFIG_FLAGS
        else:
            path, by_flag = arg, i > 0 and argv[i - 1] in DEEPSPEED_CONFIG_FLAGS
        if (by_flag or path.endswith(".json")) and os.path.isfile(path) and path not in {p for p, _, _ in out}:
            out.append((path, "on the command line", by_flag))
    env_path = (environ or {}).get(ACCELERATE_CONFIG_ENV, "")
    if env_path and env_path != "none" and os.path.isfile(env_path) and env_path not in {p for p, _, _ in out}:
        out.append((env_path, f"in {ACCELERATE_CONFIG_ENV}", True))
    return out


def _where(named: str) -> str:
    return named if named.endswith(")") else f"{named} (on the command line)"


def configs_with_section(argv: Sequence[str], environ: dict[str, str] | None = None
                         ) -> list[tuple[str, dict[str, Any]]]:
    """(path, parsed config) of every config :func:`named_configs` finds whose ``"deadpool"`` section is present
    and not ``enabled: false``. A file that is surely a DeepSpeed config and that neither JSON nor DeepSpeed's HJSON
    reads is a :class:`ConfigError` naming the file, line and column; other unreadable ``.json`` arguments are
    skipped (a script's data files)."""
    found = []
    for path, where, surely in named_configs(argv, environ):
        doc = read_json(path)
        if doc is None:
            doc = _read_hjson(path)
            if doc is None and surely:
                raise ConfigError(f"DeepSpeed config {path} ({where}): {_json_error(path)}")
        if isinstance(doc, dict) and isinstance(doc.get(SECTION), dict) and doc[SECTION].get("enabled", True):
            found.append((f"{path} ({where})" if where != "on the command line" else path, doc))
    return found


def _json_error(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            json.load(fh)
    except json.JSONDecodeError as exc:
        return f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    except (OSError, ValueError, RecursionError) as exc:
        return f"cannot read it: {getattr(exc, 'strerror', None) or exc}"
    return "larger than a config can be" if os.path.getsize(path) > MAX_CONFIG_BYTES else "not a JSON object"


def expect_sections(paths: Sequence[str]) -> None:
    """Configs with a section named for this job (by the runner): an engine later built without the section is
    then a :class:`NotAttachedError` instead of an unprotected job."""
    _state.expected = list(paths)


TORCH_EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"
"""Where torch builds and caches JIT-compiled extensions (DeepSpeed's CPU communication op among them)."""


def extensions_dir_default(environ: Mapping[str, str]) -> str:
    """``$XDG_CACHE_HOME/deadpool/torch_extensions`` (``~/.cache/...``): one cache per user that outlives jobs,
    checkouts and virtual environments (pure)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deadpool", "torch_extensions")


def default_extensions_dir(environ: MutableMapping[str, str]) -> None:
    """Set ``TORCH_EXTENSIONS_DIR`` for this process and its children when the user has not: torch reads it (only
    from the environment) when DeepSpeed JIT-builds its CPU communication op, and a per-user default outside any
    one launch means the op is compiled once (minutes on CPU) and reused by every later launch. Logged."""
    if environ.get(TORCH_EXTENSIONS_DIR):
        return
    path = extensions_dir_default(environ)
    environ[TORCH_EXTENSIONS_DIR] = path
    log.debug("TORCH_EXTENSIONS_DIR not set: DeepSpeed's compiled ops cached in %s", path)


def read_json(path: str) -> Any:
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
