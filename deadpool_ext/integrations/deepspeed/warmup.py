"""Work DeepSpeed does on its first ``deepspeed.initialize`` in a process, done ahead of time.

Why: a hot-swap spare builds its first engine after its assignment, while every survivor (which already paid
these costs in generation 0) waits for it in the new world's first collective. Measured on the 2-core CPU
host (GPT small, ZeRO-3, one process): ``deepspeed.initialize`` took 3.5 s cold, 1.3 s with the lazily
imported modules below already imported, 0.9 s with the import-time objects also frozen out of the cyclic
garbage collector (ZeRO-3's ``defragment`` runs ``gc.collect()``, which otherwise walks every object the
imports created). Loading the CPU shared-memory comm op (a JIT extension) cost a spare another ~1-2 s.

Call order: ``import_lazy_modules()`` once the script has imported DeepSpeed, then ``gc.freeze()`` (the
script's choice: :func:`deadpool_ext.training.pretrain.run` does it), then ``preload_comm_op()`` while
waiting for an assignment (:func:`warm_up_spare`, which the DeepSpeed integration registers with
``deadpool_ext.distributed.on_spare_wait``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import time

# Imported by deepspeed.initialize on first use (DeepSpeed 0.19: ZeRO's optimizer sanity check imports the
# Muon optimizer, whose module calls torch.compile, which imports inductor: ~2 s). Missing ones (other
# versions) are skipped.
LAZY_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer",)


def import_lazy_modules() -> float:
    """Import what ``deepspeed.initialize`` would import lazily; returns the seconds it took (0 when
    DeepSpeed is not in use in this process)."""
    if "deepspeed" not in sys.modules:
        return 0.0
    t0 = time.perf_counter()
    for name in LAZY_MODULES:
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
        except ImportError:
            continue  # another DeepSpeed/torch version: not imported there either
    return time.perf_counter() - t0


def preload_comm_op() -> float | None:
    """Load DeepSpeed's CPU shared-memory communication op now, before this process has a world.

    DeepSpeed keeps loaded ops per process, so ``deepspeed.initialize`` later gets this one. Returns the
    seconds it took, or None when the accelerator has no such op (e.g. CUDA: NCCL needs none) or DeepSpeed is
    not in use."""
    if "deepspeed" not in sys.modules:
        return None
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    builder.load(verbose=False)
    return time.perf_counter() - t0


def warm_up_spare() -> None:
    """A spare's wait for its assignment, put to use (registered with ``distributed.on_spare_wait`` by the
    DeepSpeed integration): lazy imports and the communication op, logged with their cost."""
    import logging

    imports_s, op_s = import_lazy_modules(), preload_comm_op()
    if op_s is not None or imports_s > 0.01:
        logging.getLogger("deadpool_ext").info(
            "spare: DeepSpeed warmed up while waiting (lazy imports %.2f s, comm op %s)", imports_s,
            "n/a" if op_s is None else f"{op_s:.2f} s")
