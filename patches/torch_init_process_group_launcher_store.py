"""A script's own ``torch.distributed.init_process_group()`` (env://) builds the group the way the runner does.

Why: under ``python -m deadpool_ext.run`` the runner builds the default group itself before the script starts
when it can see a ``"deadpool"`` section then (a config named on the command line or by ``accelerate launch``).
A section it cannot see before the start (a config dict built in code) attaches later, at
``deepspeed.initialize``, but by then the framework has built the group its own way (Accelerate's
``PartialState``, the HF ``TrainingArguments``): on torchrun's agent store as torch does it, where a restarted
attempt's gloo connect hangs (pytorch/pytorch#135712). With this patch the script's own env:// call goes through
the caller-supplied ``init(backend, timeout_s)`` (the runner passes the extension's ``init_distributed``: the
launcher's store under a per-attempt prefix, rank 0 serving it on MASTER_ADDR only), with the backend and timeout
the script asked for. A call with its own store, init method, ``pg_options`` or ``device_id``, or a rank or world
size other than the launcher's (DeepSpeed's ``init_distributed`` passes the launcher's explicitly), is torch's
own, as is any call once a group exists.

Call order: ``set_init(fn, rank=, world_size=)``, then ``apply()`` before the script runs (the runner does it
under a launcher); ``revert()`` restores torch's function. This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")

_ENV_INIT_DEFAULTS = {"init_method": (None, "env://"), "store": (None,), "pg_options": (None,),
                      "device_id": (None,), "group_name": ("", None)}
"""Arguments a plain env:// call leaves at these values; any other value: the call is torch's own."""


class InitProcessGroupOnLauncherStore(Patch):
    name = "torch_init_process_group_launcher_store"
    requires = {"torch": ">=2.4,<2.14"}
    why = ("a script's own env:// init_process_group builds its group on the launcher's store under a per-attempt "
           "prefix (a torchrun restart reconnects)")

    def __init__(self) -> None:
        super().__init__()
        self._init: Callable[[str | None, float | None], None] | None = None
        self._launcher: dict[str, tuple[Any, ...]] = {}

    def set_init(self, fn: Callable[[str | None, float | None], None], *, rank: int, world_size: int) -> None:
        """``fn(backend, timeout_s)`` builds the default group; ``rank`` / ``world_size``: the launcher's (a call
        passing exactly these is still a plain env:// call)."""
        if self.applied:
            raise RuntimeError(f"patch {self.name}: set_init() after apply()")
        self._init = fn
        self._launcher = {"rank": (-1, None, rank), "world_size": (-1, None, world_size)}

    def _apply(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if self._init is None:
            raise RuntimeError(f"patch {self.name}: apply() before set_init()")
        original, init = c10d.init_process_group, self._init
        plain = {**_ENV_INIT_DEFAULTS, **self._launcher}
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # torch names the problem itself
                return original(*args, **kwargs)
            given = bound.arguments
            own = [k for k, allowed in plain.items() if k in given and given[k] not in allowed]
            if dist.is_initialized() or own or set(given) - set(plain) - {"backend", "timeout"}:
                return original(*args, **kwargs)
            timeout = given.get("timeout")
            backend = given.get("backend")
            init(backend, timeout.total_seconds() if timeout is not None else None)
            log.info("init_process_group(backend=%s): built by deadpool_ext on the launcher's store under a "
                     "per-attempt prefix (a torchrun restart reconnects)", backend)
            return None

        self._swap(c10d, "init_process_group", init_process_group)
        self._swap(dist, "init_process_group", init_process_group)


PATCH = InitProcessGroupOnLauncherStore()
apply = PATCH.apply
revert = PATCH.revert
