"""What "a rank's whole training state" is, for each kind of training engine.

A :class:`RankStateAdapter` names the live tensors a rank owns and the small non-tensor state around them,
and puts a captured copy back in place. The snapshot machinery never needs to know about ZeRO stages or
optimizers: it copies ``tensors()`` and stores ``meta()``.

Call order (every rank, main thread):

1. ``tensors()`` and ``meta()`` right after an optimizer step (the snapshot point). ``tensors()`` returns
   references to live storage, not copies: they stay valid, and unchanged, until the next optimizer step.
   That is the window the background copy has.
2. ``restore(tensors, meta)`` on a fresh or surviving engine of the same layout, after all ranks agreed on
   the version to restore. Copies into the live storage in place and resets the counters around it.
3. Differential mode only (``differential.enabled``): ``inner_optimizer()`` and ``masters()`` when the
   snapshot manager is built (the gradient tap); after a restore that replays differentials,
   ``sync_params_from_masters()`` (every rank equally often) and ``restore_meta(meta)`` of the last one.

Implementations: ``integrations/deepspeed/state.py`` (``DeepSpeedStateAdapter``, ZeRO 0-3) and
``integrations/megatron/state.py`` (``MegatronStateAdapter``, one TP/PP/DP shard).

A snapshot copies ``captured()``, which is ``tensors()`` less ``derived()``: live tensors that are a pure
function of captured ones (DeepSpeed's low-precision parameters are the fp32 masters cast to their dtype after
every step). ``restore`` re-derives them; the snapshot manager records their checksums at capture time and
checks the re-derived bytes against them, so a derivation that is not exact is caught, never trained on.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch


class UnsupportedEngineError(RuntimeError):
    """The engine/optimizer combination has no state adapter yet; the message says which."""


class RankStateAdapter(ABC):
    """Maps one rank's training state to named tensors plus JSON-able metadata (see module docstring)."""

    @abstractmethod
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Live tensors of this rank, in a stable order; names are unique."""

    @abstractmethod
    def meta(self) -> dict[str, Any]:
        """Small state: counters, scheduler, RNG, data position. Must be encodable by the snapshot format."""

    @abstractmethod
    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Put a captured state back in place."""

    @abstractmethod
    def step(self) -> int:
        """The optimizer-step counter: the version a snapshot taken now would carry."""

    @abstractmethod
    def restore_meta(self, meta: dict[str, Any]) -> None:
        """Only the small state of ``meta`` (counters, scheduler, RNG, client state): called after a replay of
        differentials, whose last one carries the metadata of the restored step."""

    def derived(self) -> list[tuple[str, torch.Tensor]]:
        """Live tensors that ``restore`` rebuilds from the captured ones (not copied). Default: none."""
        return []

    # -- differential checkpoints (TierCheck): optional; called only with ``differential.enabled`` ---------
    def inner_optimizer(self) -> Any:
        """The torch optimizer that updates ``masters()`` (what a differential taps and replays)."""
        raise UnsupportedEngineError(f"{type(self).__name__} does not support differential checkpoints "
                                     "(set deadpool.differential.enabled to false)")

    def masters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates, in snapshot order (``master.<i>``)."""
        raise UnsupportedEngineError(f"{type(self).__name__} does not support differential checkpoints "
                                     "(set deadpool.differential.enabled to false)")

    def sync_params_from_masters(self) -> None:
        """After the masters were changed outside a step (a replay), make the training parameters follow, as
        the engine's own step does (may be collective: every rank calls it equally often)."""
        raise UnsupportedEngineError(f"{type(self).__name__} does not support differential checkpoints "
                                     "(set deadpool.differential.enabled to false)")

    # -- elastic (resharding to another data-parallel size): optional ----------------------------------------
    def partition_layout(self) -> dict[str, Any] | None:
        """This rank's :class:`deadpool_ext.recovery.reshard.PartitionLayout` (or ``ReplicatedLayout``) as JSON
        (captured in every snapshot's metadata as ``layout``), or ``None``: this state cannot be resharded."""
        return None

    def restore_resharded(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Put a state assembled from another data-parallel size in place: ``tensors`` hold this rank's new
        partitions (``master.<g>``, ``optim.<g>.<key>``; parameters are derived from the masters), or, for a
        replicated layout, the whole state of one old rank of this rank's shard; ``meta`` the small state of one
        old rank. Collective where deriving the parameters is (ZeRO-1/2)."""
        raise UnsupportedEngineError(f"{type(self).__name__} cannot restore a resharded state")

    def captured(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors a snapshot copies: ``tensors()`` without ``derived()`` (:func:`captured_of`)."""
        return captured_of(self.tensors(), self.derived())


def captured_of(tensors: list[tuple[str, torch.Tensor]],
                derived: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``tensors`` without the ``derived`` ones (pure): what a snapshot copies. The snapshot manager calls it with
    the ``derived()`` it also checksums, so an adapter's ``derived()`` runs once per base."""
    skip = {name for name, _ in derived}
    return [(name, t) for name, t in tensors if name not in skip]


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])


def _as_tuple(x: Any) -> Any:
    # random.setstate insists on tuples all the way down.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def plain_value(v: Any) -> bool:
    """A JSON-able scalar or a list of them (what metadata may carry besides tensors)."""
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(plain_value(x) for x in v))


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy a captured tensor into live storage, refusing a shape or dtype mismatch by name."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"snapshot tensor {name}: {tuple(src.shape)}/{src.dtype} does not match live "
                         f"{tuple(dst.shape)}/{dst.dtype}")
    dst.copy_(src)


def restore_optimizer_state(state: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str,
                            scalars: dict[str, Any]) -> None:
    """Make one parameter's optimizer ``state`` dict what was captured: the tensors named ``<prefix><key>`` in
    place where a live tensor of that shape exists, else created as captured (a freshly built optimizer has no
    state until its first step, and torch's Adam keeps even ``step`` as a tensor), the plain ``scalars``, and no
    other key: state made after the snapshot (moments created by the first step that was not skipped, when the
    snapshot's steps all overflowed) would otherwise survive the restore and change the redone steps."""
    captured = {name[len(prefix):]: src for name, src in tensors.items() if name.startswith(prefix)}
    for key in [k for k in state if k not in captured and k not in scalars]:
        del state[key]
    for key, src in captured.items():
        if key in state and torch.is_tensor(state[key]) and state[key].shape == src.shape:
            copy_into(state[key], src, prefix + key)
        else:
            state[key] = src.clone()
    state.update(scalars)
