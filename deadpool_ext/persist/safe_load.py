"""Deserialising checkpoint files without running code: ``torch.load(weights_only=True)`` plus an allowlist.

A ``.pt`` file is a pickle, and unpickling runs whatever callable the file names. Every tier-3 read goes
through :func:`safe_load`: torch's weights-only unpickler (tensors, storages, containers, numbers, strings)
extended by *exactly* the classes the framework's checkpoints hold, listed in one table per framework
(``integrations/deepspeed/allowlist.py``, ``integrations/megatron/allowlist.py``; the RNG states of the client
state need :data:`NUMPY_RNG`). Anything else is refused with :class:`UntrustedCheckpointError` naming the class
and the file; the file's code never runs.

Third-party loaders that call ``torch.load(..., weights_only=False)`` themselves (DeepSpeed's ``zero_to_fp32``,
``ds_to_universal``, its universal-checkpoint loader; ``torch.distributed.checkpoint``'s byte items) run inside
:func:`only_weights`, which swaps ``torch.load`` for :func:`safe_load` with the allowlist for the duration of
the call (process-wide, serialised by a lock; no thread of ours loads checkpoints concurrently). Formats that
are plain pickle (``torch.distributed.checkpoint``'s ``.metadata``) are read with :class:`RestrictedUnpickler`,
which resolves only the ``module.name`` pairs of an explicit table.

:func:`scan` reads the names a ``.pt`` file's pickle refers to without unpickling it (torch's static
disassembly), so a resume can refuse a base on every rank together before anyone loads it.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import struct
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any, cast

import numpy as np
import torch

from .records import CheckpointTrustError, one_line

SafeGlobal = Callable[..., Any] | tuple[Callable[..., Any], str]
"""An allowlist entry as torch takes it: a class/function, or (it, "module.name") when the pickle names it
under another path (numpy 1 vs 2)."""

_TORCH_LOAD = torch.load
# numpy.(_)core.multiarray._reconstruct, whichever numpy this is
_NUMPY_RECONSTRUCT = cast(Callable[..., Any], np.ndarray.__reduce__(np.zeros(1))[0])

NUMPY_RNG: tuple[SafeGlobal, ...] = (
    # np.random.get_state(): ('MT19937', uint32 array, pos, has_gauss, cached_gaussian) in the client state
    (_NUMPY_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    (_NUMPY_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
)


class UntrustedCheckpointError(CheckpointTrustError):
    """A checkpoint file names a class outside the allowlist (or is no torch.save file we can read safely)."""


def global_name(entry: SafeGlobal) -> str:
    if isinstance(entry, tuple):
        return entry[1]
    return f"{entry.__module__}.{getattr(entry, '__qualname__', getattr(entry, '__name__', '?'))}"


def _describe(f: Any) -> str:
    if isinstance(f, str | os.PathLike):
        return os.fspath(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else f"an in-memory {type(f).__name__}"


_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")
_READ_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, KeyError, IndexError,
                AttributeError, OverflowError, struct.error, zipfile.BadZipFile, ImportError)


def _refusal(what: str, exc: BaseException) -> UntrustedCheckpointError:
    text = str(exc)
    m = _GLOBAL.search(text)
    if m:
        return UntrustedCheckpointError(f"{what}: refused to unpickle {m.group(1)}: not in the checkpoint allowlist "
                                        "(docs/tier3.md, 'What may be unpickled'); nothing in the file was run")
    return UntrustedCheckpointError(f"{what}: cannot be read as a weights-only torch.save file ({_cause(exc)})")


def _cause(exc: BaseException) -> str:
    """The useful part of torch's error (its weights-only message wraps the unpickler's in paragraphs)."""
    inner = exc.__context__ if isinstance(exc, pickle.UnpicklingError) and exc.__context__ is not None else exc
    text = str(inner).strip()
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
    first = text.splitlines()[0] if text else type(inner).__name__
    return one_line(first, 160)


def safe_load(f: Any, *, allow: Iterable[SafeGlobal], what: str | None = None, map_location: Any = None,
              mmap: bool | None = None) -> Any:
    """``torch.load(f, weights_only=True)`` with ``allow`` added to torch's safe globals for this call.
    Raises :class:`UntrustedCheckpointError` (one line naming ``what`` and the class) instead of torch's
    multi-paragraph error; I/O errors (a missing file) pass through."""
    label = what or _describe(f)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return _TORCH_LOAD(f, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError:
        raise
    except _READ_ERRORS as exc:
        raise _refusal(label, exc) from None


def scan(f: str | IO[bytes], *, allow: Iterable[SafeGlobal], what: str | None = None) -> None:
    """Refuse (:class:`UntrustedCheckpointError`) a ``torch.save`` file whose pickle names any global that
    neither torch's weights-only set nor ``allow`` holds, without unpickling it."""
    label = what or _describe(f)
    try:
        with torch.serialization.safe_globals(list(allow)):
            bad = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except OSError:
        raise
    except _READ_ERRORS as exc:
        raise UntrustedCheckpointError(f"{label}: not a plain torch.save file that can be checked "
                                       f"({_cause(exc)})") from None
    if bad:
        raise UntrustedCheckpointError(f"{label}: refers to {', '.join(sorted(bad)[:5])}: not in the checkpoint "
                                       "allowlist (docs/tier3.md, 'What may be unpickled'); refused unopened")


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def only_weights(allow: Iterable[SafeGlobal], *, opened: Callable[[str], None] | None = None,
                 refusals: list[CheckpointTrustError] | None = None) -> Iterator[None]:
    """Within the block, every ``torch.load`` call in this process is :func:`safe_load` with ``allow``,
    whatever ``weights_only`` or ``pickle_module`` the caller passed. ``opened(path)`` is called before each
    file is read (a caller may refuse paths it did not verify by raising there). Each refusal raised is also
    appended to ``refusals`` (for callers whose framework wraps exceptions in its own, to report ours)."""
    entries = list(allow)

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: bool | None = None,
             mmap: bool | None = None, **kwargs: Any) -> Any:
        del pickle_module, weights_only, kwargs  # never honoured: weights only, always
        try:
            if opened is not None and isinstance(f, str | os.PathLike):
                opened(os.fspath(f))
            return safe_load(f, allow=entries, map_location=map_location, mmap=mmap)
        except CheckpointTrustError as exc:
            if refusals is not None:
                refusals.append(exc)
            raise

    with _PATCH_LOCK:
        before = torch.load
        torch.load = load
        try:
            yield
        finally:
            torch.load = before


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only the ``module.name`` pairs in ``allow``; anything else (``os.system``,
    ``builtins.eval``, ...) is :class:`UntrustedCheckpointError` before it is looked up."""

    def __init__(self, fh: IO[bytes], allow: Mapping[str, Any], what: str) -> None:
        super().__init__(fh)
        self._allow = allow
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in self._allow:
            raise UntrustedCheckpointError(f"{self._what}: refused to unpickle {one_line(key, 100)}: not in the "
                                           "checkpoint allowlist (docs/tier3.md, 'What may be unpickled')")
        return self._allow[key]

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError(f"{self._what}: holds a persistent reference; not expected in this format")


def restricted_load(data: bytes | IO[bytes], allow: Mapping[str, Any], what: str) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; malformed input is :class:`UntrustedCheckpointError`."""
    fh = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return RestrictedUnpickler(fh, allow, what).load()
    except CheckpointTrustError:
        raise
    except OSError:
        raise
    except (*_READ_ERRORS, MemoryError, RecursionError) as exc:
        raise UntrustedCheckpointError(f"{what}: not a readable pickle of the expected kind "
                                       f"({one_line(exc, 120)})") from None


def allow_table(entries: Iterable[SafeGlobal]) -> dict[str, Any]:
    """``{"module.name": object}`` of allowlist entries (for :class:`RestrictedUnpickler`)."""
    return {global_name(e): (e[0] if isinstance(e, tuple) else e) for e in entries}
