"""The contract every patch module follows: declared versions, idempotent ``apply()``, exact ``revert()``.

Call order (one process; patches are process-wide state, so the main thread of every rank does this):

1. ``patch.check()`` (optional): raises :class:`UnsupportedVersionError` naming the installed and the
   supported versions; ``apply()`` calls it first, so a patch never half-applies to an unknown version.
2. ``patch.apply()`` before the patched code runs (for the Megatron-Core shims: before the model is built).
   Applying twice is a no-op.
3. ``patch.revert()`` puts every replaced attribute back, in reverse order. Reverting an unapplied patch is
   a no-op. If someone else replaced an attribute after us, revert refuses (restoring our original would
   silently drop their change).

Nothing is patched at import time: importing a patch module only defines it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
from abc import ABC, abstractmethod
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

log = logging.getLogger("deadpool_ext.patches")  # a child of the package logger: same handler and level


class UnsupportedVersionError(RuntimeError):
    """An installed package is outside the versions a patch was written and tested for."""


class PatchConflictError(RuntimeError):
    """An attribute we patched was replaced by someone else; reverting would drop their change."""


def installed_version(distribution: str) -> Version | None:
    """Version of an installed distribution (local labels such as ``+cpu`` dropped), or None if absent."""
    if distribution == "torch":
        import torch

        raw = torch.__version__
    else:
        try:
            raw = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
    return Version(Version(str(raw)).base_version)


class Patch(ABC):
    """One patched target. Subclasses set ``name``, ``requires`` and implement ``_apply`` with ``_swap``."""

    name: str = ""
    """Registry name, e.g. ``megatron_core_cpu_device``."""
    requires: dict[str, str] = {}
    """Distribution -> PEP 440 specifier the patch supports, e.g. ``{"megatron-core": "==0.16.*"}``."""
    why: str = ""
    """One line: what breaks without the patch."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, replacement)
        self.applied = False

    # -- versions ------------------------------------------------------------------------------------
    def check(self) -> None:
        for dist, spec in self.requires.items():
            found = installed_version(dist)
            if found is None:
                raise UnsupportedVersionError(f"patch {self.name}: needs {dist} {spec}, which is not installed")
            if found not in SpecifierSet(spec):
                raise UnsupportedVersionError(
                    f"patch {self.name}: supports {dist} {spec}, found {found}. The patched internals may differ in "
                    f"this version; check them and widen {type(self).__module__}.requires after testing")
        self._check_environment()

    def _check_environment(self) -> None:  # noqa: B027 - optional hook, a no-op unless a subclass overrides it
        """Extra preconditions (e.g. "no CUDA"); raise RuntimeError with the reason."""

    # -- apply / revert ------------------------------------------------------------------------------
    def apply(self) -> None:
        if self.applied:
            return
        self.check()
        try:
            self._apply()
        except BaseException:
            self._restore()  # never leave a half-applied patch behind
            raise
        self.applied = True
        log.info("patch %s applied (%s)", self.name, self.why)

    def revert(self) -> None:
        if not self.applied:
            return
        for owner, attr, _, replacement in self._saved:
            if getattr(owner, attr) is not replacement:
                raise PatchConflictError(
                    f"patch {self.name}: {_qualname(owner)}.{attr} was replaced by someone else after this patch; "
                    "revert their patch first")
        self._restore()
        self.applied = False
        log.info("patch %s reverted", self.name)

    @abstractmethod
    def _apply(self) -> None:
        """Replace attributes with ``self._swap``; runs only after the version check passed."""

    def _swap(self, owner: Any, attr: str, replacement: Any) -> None:
        if not hasattr(owner, attr):
            raise UnsupportedVersionError(f"patch {self.name}: {_qualname(owner)} has no attribute {attr!r}")
        self._saved.append((owner, attr, getattr(owner, attr), replacement))
        setattr(owner, attr, replacement)

    def _restore(self) -> None:
        for owner, attr, original, _ in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


def import_module(name: str) -> Any:
    return importlib.import_module(name)
