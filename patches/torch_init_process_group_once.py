"""``torch.distributed.init_process_group`` becomes a logged no-op once a default group exists.

Why: under ``python -m deadpool_ext.run`` / ``deadpool-run`` the extension builds the default process group
before the job's script starts (on the launcher's store under a per-attempt prefix, pytorch/pytorch#135712;
under deadpool-run from the hot-swap membership). Frameworks check ``is_initialized()`` first (DeepSpeed,
Accelerate, Lightning); a hand-written script that calls ``init_process_group`` unconditionally would fail with
"trying to initialize the default process group twice!". With the patch that call returns, logging that the
group already exists, so the script runs unchanged. Any call made before a group exists is torch's own.

Call order: ``apply()`` once the group exists (the runner does it); ``revert()`` restores torch's function.
This module imports no ``deadpool_ext``.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from .base import Patch

log = logging.getLogger("deadpool_ext.patches")


class InitProcessGroupOnce(Patch):
    name = "torch_init_process_group_once"
    requires = {"torch": ">=2.4,<2.14"}
    why = "a script's own init_process_group returns when the runner already built the default group"

    def _apply(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = c10d.init_process_group

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if dist.is_initialized():
                log.info("init_process_group(): the default process group already exists (built by deadpool_ext "
                         "before the script started, %d ranks, backend %s); nothing to do",
                         dist.get_world_size(), dist.get_backend())
                return None
            return original(*args, **kwargs)

        self._swap(c10d, "init_process_group", init_process_group)
        self._swap(dist, "init_process_group", init_process_group)


PATCH = InitProcessGroupOnce()
apply = PATCH.apply
revert = PATCH.revert
