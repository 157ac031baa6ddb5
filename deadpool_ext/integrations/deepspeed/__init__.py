"""DeepSpeed integration: one call turns the extension on for an existing DeepSpeed job.

Either replace ``deepspeed.initialize`` with :func:`initialize` (same arguments and return values; the
``"deadpool"`` section of the config is split off and applied), or keep ``deepspeed.initialize`` and call
:func:`register` on the engine with the section.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from ...config import DeadpoolConfig, split_deepspeed_config
from ...distributed import on_spare_wait
from ...logs import configure_logging
from ...persist.layout import use_file_names
from ...rebuild.context import context
from ...rebuild.spare import Relabel, await_assignment, publish_fast_paths
from ...rebuild.worker import on_teardown
from .names import deepspeed_file_names
from .rebuild import reset_deepspeed_comm_state
from .runtime import DeadpoolRuntime
from .warmup import warm_up_spare

log = logging.getLogger("deadpool_ext")

# What a hot-swap needs from DeepSpeed beyond the engine: its process-wide communicator caches reset at every
# teardown, and a spare's wait for an assignment used to warm DeepSpeed up. Registered here, so only jobs
# that use this integration run them (a Megatron-Core job never imports DeepSpeed for them).
on_teardown(reset_deepspeed_comm_state)
on_spare_wait(warm_up_spare)
# The file names a tier-3 base may hold: what the installed DeepSpeed's naming functions write (computed at the
# first check). Registered here for the same reason: the persist layer imports no framework.
use_file_names(deepspeed_file_names)


def register(engine: Any, config: DeadpoolConfig | dict[str, Any] | None = None) -> DeadpoolRuntime:
    """Attach the extension to an initialised DeepSpeed engine; returns the runtime (also ``engine.deadpool``)."""
    if getattr(engine, "deadpool", None) is not None:
        raise RuntimeError("deadpool_ext.register: this engine already has the extension attached")
    # No config argument: the defaults. A section read from a file goes through split_deepspeed_config, which
    # refuses "deadpool": null (from_dict(None) too) instead of reading it as "off" or as "defaults".
    cfg = (config if isinstance(config, DeadpoolConfig)
           else DeadpoolConfig() if config is None else DeadpoolConfig.from_dict(config))
    configure_logging(cfg.log_level)
    from .batch import record

    record(engine)
    if context().spare.built is not None:
        # a spare that built this engine ahead of any failure waits here for its assignment (rebuild/spare.py),
        # before the runtime exists: assigned another data-parallel rank, the engine is relabelled first
        # (takeover.py), so all the runtime reads from the rank (snapshots, placement, canary) is the new rank's
        from ...launcher.contract import worker_env
        from ...snapshot.manager import prepare_node
        from .. import framework_takeover as ft
        from ..base import placement_for
        from . import takeover

        found = ft.find()  # the HF Trainer's (Accelerate's) or Lightning's copies of the rank, relabelled with it
        # the in-place runtime made after the wait collects and freezes what exists (base.py): done here, before the
        # wait, that collection walks only what the wait made (0.25 s of an HF Trainer spare's swap otherwise)
        gc.collect()
        gc.freeze()

        def apply(rank: int) -> None:
            takeover.relabel(engine, rank)
            if found is not None:
                ft.relabel(found, rank)

        why = takeover.refusal(engine) or (ft.refusal(found) if found is not None else None)
        await_assignment(Relabel(why_not=why, apply=apply, covers=found.covers if found is not None else ()),
                         prepare=(lambda: prepare_node(cfg, placement_for(cfg, worker_env()))) if cfg.enabled else None)
    runtime = DeadpoolRuntime(engine, cfg)
    engine.deadpool = runtime
    return runtime


def initialize(*args: Any, config: Any = None, config_params: Any = None,
               _ds_initialize: Callable[..., Any] | None = None, **kwargs: Any):
    """Drop-in for ``deepspeed.initialize``: same arguments, same 4-tuple; the engine has ``.deadpool``
    (``None`` when the config has no ``"deadpool"`` section).

    With a section and no process group yet, the group is built first by
    :func:`deadpool_ext.distributed.init_distributed` (on the launcher's store under a per-attempt prefix, so a
    restarted attempt never reads the dead one's addresses: pytorch/pytorch#135712), with the section's
    ``hot_swap.collective_timeout_s``. ``_ds_initialize``: the DeepSpeed function to call (the hook passes the
    unpatched one)."""
    cfg_in = config if config is not None else config_params
    ns: Any = kwargs.get("args", args[0] if args else None)
    for attr in ("deepspeed_config", "deepscale_config"):
        if cfg_in is None and getattr(ns, attr, None) is not None:
            cfg_in = getattr(ns, attr)
    if cfg_in is None:
        raise ValueError("deadpool_ext.deepspeed.initialize needs a DeepSpeed config (config=PATH or dict)")
    args, kwargs = args_without_config(args, kwargs)
    call_ns: Any = kwargs.get("args", args[0] if args else None)
    ds_config, dp_config = split_deepspeed_config(cfg_in)
    if dp_config is not None and dp_config.enabled:
        import torch.distributed as dist

        if not dist.is_initialized():
            from ...distributed import init_distributed

            init_distributed(timeout_s=dp_config.hot_swap.collective_timeout_s, in_place=dp_config.hot_swap.in_place)
            log.info("process group created by deadpool_ext before deepspeed.initialize (per-attempt store prefix)")
        # spares that saw no config before their script learn the section's fast paths now, not after the build
        publish_fast_paths(dp_config, rank=dist.get_rank(), swaps_in_place=DeadpoolRuntime.swaps_in_place,
                           framework="DeepSpeed")
    if _ds_initialize is None:
        from ..deepspeed_hook import original_initialize

        _ds_initialize = original_initialize()
    if dp_config is not None and dp_config.enabled and isinstance(ds_config, dict):
        ds_config = _keep_global_batch(ds_config, dp_config, kwargs, args)
    _quiet_zero3_init()
    if dp_config is not None and dp_config.enabled:
        from .. import loaders

        loaders.process_tracker()  # the loaders DeepSpeed iterates while building (training_data=) tracked too
    import time

    context().spare.times.setdefault("engine_started_at", time.time())  # a spare's timeline: its engine build
    with _unsynced_if_every_rank_restores(ds_config, dp_config is not None):
        out = _ds_initialize(*args, config=ds_config, **kwargs)
    if call_ns is not ns and hasattr(ns, "local_rank") and hasattr(call_ns, "local_rank"):
        ns.local_rank = call_ns.local_rank  # DeepSpeed aligns args.local_rank to LOCAL_RANK (its compatibility rule)
    engine = out[0]
    import torch.distributed as dist

    if dist.is_initialized():  # the groups DeepSpeed made too: torn down while the interpreter is whole at exit
        from ...distributed import destroy_groups_at_exit

        destroy_groups_at_exit()
    if dp_config is None:
        engine.deadpool = None
        log.info("no \"deadpool\" section in the DeepSpeed config: extension not attached")
    else:
        register(engine, dp_config)
    return out


def args_without_config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the config taken off a copy of its ``args`` namespace (DeepSpeed refuses a config
    both there and in ``config=``): the caller's own namespace is never changed, so a rebuild factory that passes
    the same ``args`` again still carries its config. :func:`initialize` copies back the one attribute DeepSpeed
    writes, ``args.local_rank`` (aligned to ``LOCAL_RANK``, its compatibility rule)."""
    import copy

    in_kwargs = "args" in kwargs
    ns = kwargs.get("args") if in_kwargs else (args[0] if args else None)
    if not any(getattr(ns, a, None) is not None for a in ("deepspeed_config", "deepscale_config")):
        return args, kwargs
    ns = copy.copy(ns)
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(ns, attr, None) is not None:
            setattr(ns, attr, None)
    return ((args, {**kwargs, "args": ns}) if in_kwargs else ((ns, *args[1:]), kwargs))


def _keep_global_batch(ds_config: dict[str, Any], cfg: DeadpoolConfig, kwargs: dict[str, Any],
                       args: tuple[Any, ...] = ()) -> dict[str, Any]:
    """An engine rebuilt in this process on a world of another data-parallel size keeps the first engine's global
    batch (``batch.py``); the data-parallel size is the world over a ``PipelineModule``'s pipeline and model
    dimensions (``batch.data_parallel_size``); model parallelism given as an ``mpu`` is left to its framework."""
    import torch.distributed as dist

    from .batch import data_parallel_size, parallel_dims, recorded, rescale

    first = recorded()
    if first is None or kwargs.get("mpu") is not None or not dist.is_initialized():
        return ds_config
    pipe, model = parallel_dims(kwargs.get("model", args[1] if len(args) > 1 else None))
    return rescale(ds_config, first, data_parallel_size(dist.get_world_size(), pipe, model),
                   cfg.elastic.allow_batch_change)


def _patches() -> Any:
    try:
        from ... import patches  # type: ignore[attr-defined]  # patches/, mapped in at install (package_dir)
    except ImportError:  # run from a checkout that was never installed (patches/ maps in at install): plain DeepSpeed
        return None
    return patches


def _quiet_zero3_init() -> None:
    """``deadpool_ext.patches.deepspeed_zero3_quiet_init`` (``patches/`` in the repository) (0.2-0.3 s per rank
    and engine build), when it supports the installed DeepSpeed; otherwise DeepSpeed as it is (logged at debug
    level)."""
    p = _patches()
    if p is None:
        return
    try:
        p.get("deepspeed_zero3_quiet_init").apply()
    except p.UnsupportedVersionError as exc:
        log.debug("%s", exc)


def _unsynced_if_every_rank_restores(ds_config: Any, with_deadpool: bool) -> Any:
    """In a hot-swap rebuild where every rank restores its whole state from memory next (agreed by all, see
    ``rebuild.recover.every_rank_restores``), build the engine without DeepSpeed's initial weight
    broadcasts and gathers (``patches/deepspeed_unsynced_init.py``): 0.6 s of collectives for GPT small."""
    import contextlib

    from ...rebuild.recover import every_rank_restores

    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0) if isinstance(ds_config, dict) else 0
    p = _patches()
    if not with_deadpool or p is None or int(stage) not in (1, 2, 3):
        return contextlib.nullcontext()
    try:
        p.get("deepspeed_unsynced_init").check()
    except p.UnsupportedVersionError as exc:
        log.debug("%s", exc)
        return contextlib.nullcontext()
    if not every_rank_restores():
        return contextlib.nullcontext()
    log.info("hot-swap rebuild: every rank restores its state from memory next, so the engine is built without "
             "DeepSpeed's initial weight broadcast")
    from ...patches.deepspeed_unsynced_init import unsynced_weights

    return unsynced_weights()


__all__ = ["initialize", "register", "DeadpoolRuntime"]
