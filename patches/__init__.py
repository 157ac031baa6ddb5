"""Explicit, version-guarded patches of third-party code (see README.md).

Nothing is patched by importing this package. Use::

    from deadpool_ext import patches
    patches.apply_all(patches.MEGATRON_CORE_CPU)      # the CPU shims, before building a Megatron model
    ...
    patches.revert_all(patches.MEGATRON_CORE_CPU)

Every patch module exposes ``PATCH`` (a :class:`deadpool_ext.patches.base.Patch`), ``apply()`` and ``revert()``.
Dependencies point one way: patches may import third-party packages, never ``deadpool_ext``'s core.
"""
from __future__ import annotations

import importlib

from .base import Patch, PatchConflictError, UnsupportedVersionError

REGISTRY: dict[str, str] = {
    "megatron_core_cpu_device": "megatron_core_cpu_device",
    "megatron_core_cpu_rng": "megatron_core_cpu_rng",
    "megatron_core_cpu_factories": "megatron_core_cpu_factories",
    "megatron_core_cpu_clip_grads": "megatron_core_cpu_clip_grads",
    "megatron_core_cpu_synchronize": "megatron_core_cpu_synchronize",
    "megatron_lm_hooks": "megatron_lm_hooks",
    "deepspeed_zero3_quiet_init": "deepspeed_zero3_quiet_init",
    "deepspeed_unsynced_init": "deepspeed_unsynced_init",
    "deepspeed_initialize_hook": "deepspeed_initialize_hook",
    "torch_init_process_group_once": "torch_init_process_group_once",
    "torch_init_process_group_launcher_store": "torch_init_process_group_launcher_store",
    "torch_solo_broadcast_object": "torch_solo_broadcast_object",
    "torch_dataloader_position": "torch_dataloader_position",
    "transformers_trainer_resume": "transformers_trainer_resume",
    "transformers_trainer_logs": "transformers_trainer_logs",
    "transformers_trainer_hot_swap": "transformers_trainer_hot_swap",
    "transformers_trainer_flops": "transformers_trainer_flops",
    "lightning_fit_loop": "lightning_fit_loop",
    "lightning_deepspeed_cpu": "lightning_deepspeed_cpu",
}
"""Patch name -> module of this package. Modules are imported only when a patch is requested."""

MEGATRON_CORE_CPU: tuple[str, ...] = ("megatron_core_cpu_device", "megatron_core_cpu_rng",
                                       "megatron_core_cpu_factories", "megatron_core_cpu_clip_grads",
                                       "megatron_core_cpu_synchronize")
"""What Megatron-Core needs to train and checkpoint on a machine without CUDA."""


def get(name: str) -> Patch:
    if name not in REGISTRY:
        raise KeyError(f"no patch named {name!r}; known patches: {sorted(REGISTRY)}")
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").PATCH


def apply_all(names: tuple[str, ...] | list[str]) -> list[Patch]:
    """Apply ``names`` in order, all or nothing: the version check of every patch runs before any is applied,
    and if one fails to apply the ones applied by this call are reverted."""
    todo = [get(n) for n in names]
    for p in todo:
        p.check()
    done: list[Patch] = []
    try:
        for p in todo:
            if not p.applied:
                p.apply()
                done.append(p)
    except BaseException:
        for p in reversed(done):
            p.revert()
        raise
    return todo


def revert_all(names: tuple[str, ...] | list[str]) -> None:
    for n in reversed(list(names)):
        get(n).revert()


__all__ = ["Patch", "PatchConflictError", "UnsupportedVersionError", "REGISTRY", "MEGATRON_CORE_CPU", "get",
           "apply_all", "revert_all"]
