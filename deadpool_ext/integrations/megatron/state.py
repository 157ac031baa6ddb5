"""What one Megatron-Core rank's training state is, for the snapshot tiers.

A rank holds its shard of the model as Megatron laid it out (its TP slice of every layer of its PP stage;
with the distributed optimizer also its DP shard of the optimizer state) and nothing else, so every rank
snapshots exactly what it holds and a snapshot is only valid for the same (tp, pp, dp) coordinates, which
``restore`` checks: a spare restoring a lost rank's snapshot must have taken that rank's coordinates.

Tensors (live references, in a stable order):

- ``model.<chunk>.<name>``: every parameter of every model chunk (views into the DDP parameter buffer);
- ``main.<k>.<g>.<i>``: optimizer main parameters that are not the model parameters themselves (the fp32
  master copies of bf16/fp16 training; absent in fp32 training, where the optimizer steps the model
  parameters or views of them);
- ``optim.<k>.<g>.<i>.<key>``: the inner torch optimizer's per-parameter state (Adam: ``exp_avg``,
  ``exp_avg_sq``, ``step``), ``k`` the sub-optimizer of a chained optimizer, ``g``/``i`` group and index.

Meta: iteration, consumed samples, global batch, the parallel sizes (``parallel``) and coordinates, optimizer
param-group scalars, the LR scheduler, the grad scaler, RNG (Python, NumPy, torch, the tensor-parallel RNG
tracker), client state, and ``layout``: without the distributed optimizer a rank's state is its model-parallel
shard's, the same on every data-parallel rank of it (a ``ReplicatedLayout``), so an elastic restore onto
another data-parallel size gives each new rank one old rank's copy of its shard (``restore_resharded``).

Call order: as :class:`deadpool_ext.snapshot.state.RankStateAdapter` (``tensors``/``meta`` right after the
optimizer step, ``restore`` after agreement on a version).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

from ...snapshot.state import (
    RankStateAdapter,
    capture_rng,
    copy_into,
    plain_value,
    restore_optimizer_state,
    restore_rng,
)
from .layout import Coordinates, Layout


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers under a Megatron optimizer (chained optimizers hold one per parameter kind)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs]


class MegatronStateAdapter(RankStateAdapter):
    """Rank state of Megatron-Core model chunks + MegatronOptimizer (+ OptimizerParamScheduler).

    ``progress`` is the runtime's counter object with ``iteration`` and ``consumed_samples`` attributes."""

    def __init__(self, chunks: list[Any], optimizer: Any, scheduler: Any, layout: Layout, coords: Coordinates,
                 progress: Any, client_state: Callable[[], dict[str, Any]] | None = None,
                 restore_client_state: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.layout = layout
        self.coords = coords
        self.progress = progress
        self._client_state = client_state
        self._restore_client_state = restore_client_state
        self.global_batch: int | None = None  # samples per iteration (set by the runtime)
        self.allow_batch_change = False  # deadpool.elastic.allow_batch_change (set by the runtime)
        self._layout: dict[str, Any] | None = None
        model_storages = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        # Main params that alias the model's storage are already captured as model parameters.
        self._main = [[[(g, i, p) for i, p in enumerate(group["params"])
                        if p.untyped_storage().data_ptr() not in model_storages]
                       for g, group in enumerate(inner.param_groups)] for inner in inner_optimizers(optimizer)]

    # -- capture ---------------------------------------------------------------------------------
    def step(self) -> int:
        return int(self.progress.iteration)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for c, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                out.append((f"model.{c}.{name}", p.data))
        for k, inner in enumerate(inner_optimizers(self.optimizer)):
            for group_mains in self._main[k]:
                for g, i, p in group_mains:
                    out.append((f"main.{k}.{g}.{i}", p.data))
            for g, group in enumerate(inner.param_groups):
                for i, p in enumerate(group["params"]):
                    for key, value in sorted(inner.state.get(p, {}).items()):
                        if torch.is_tensor(value):
                            out.append((f"optim.{k}.{g}.{i}.{key}", value))
        return out

    def meta(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        inners = inner_optimizers(self.optimizer)
        scaler = getattr(self.optimizer, "grad_scaler", None)
        return {
            "iteration": int(self.progress.iteration),
            "consumed_samples": int(self.progress.consumed_samples),
            "parallel": self._parallel(),
            "coords": {"tp": self.coords.tp, "pp": self.coords.pp, "dp": self.coords.dp},
            "global_batch": self.global_batch,
            "layout": self.partition_layout(),
            "param_groups": [[{k: v for k, v in grp.items() if k != "params" and plain_value(v)}
                              for grp in inner.param_groups]
                             for inner in inners],
            "optim_scalars": {f"{k}.{g}.{i}": {key: v for key, v in inner.state.get(p, {}).items()
                                               if not torch.is_tensor(v)}
                              for k, inner in enumerate(inners) for g, grp in enumerate(inner.param_groups)
                              for i, p in enumerate(grp["params"])},
            "scheduler": ({k: v for k, v in self.scheduler.state_dict().items() if plain_value(v)}
                          if self.scheduler else None),
            "grad_scaler": {k: v.clone() if torch.is_tensor(v) else v for k, v in scaler.state_dict().items()}
            if scaler is not None else None,
            "rng": capture_rng(),
            "rng_tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
            "client": self._client_state() if self._client_state else {},
        }

    # -- restore ---------------------------------------------------------------------------------
    def _parallel(self) -> dict[str, int]:
        return {"world_size": self.layout.world_size, "tp": self.layout.tp, "pp": self.layout.pp}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        want_coords = {"tp": self.coords.tp, "pp": self.coords.pp, "dp": self.coords.dp}
        if meta["parallel"] != self._parallel() or meta["coords"] != want_coords:
            raise ValueError(f"snapshot of layout {meta['parallel']} at coordinates {meta['coords']} cannot be "
                             f"restored at layout {self._parallel()}, coordinates {want_coords}: in-memory restore "
                             "needs the rank's own (tp, pp, dp) shard")
        self._restore_tensors(tensors, meta)

    # -- elastic ------------------------------------------------------------------------------------------
    def partition_layout(self) -> dict[str, Any] | None:
        """A ``ReplicatedLayout``: this rank's state is its (tp, pp) shard's; None with the distributed optimizer
        (its state is cut along data parallelism: not resharded)."""
        if self._distributed():
            return None
        if self._layout is None:
            from ...recovery.reshard import ReplicatedLayout
            from .layout import shard_name

            shapes = [[name, list(t.shape), str(t.dtype)] for name, t in self.tensors() if name.startswith("model.")]
            fingerprint = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
            self._layout = ReplicatedLayout(dp=self.layout.dp, dp_rank=self.coords.dp,
                                            shard=shard_name(self.coords, self.layout), model=fingerprint).to_json()
        return self._layout

    def why_no_layout(self) -> str:
        return ("Megatron's distributed optimizer cuts its state along data parallelism, and resharding it is not "
                "built; run without --use-distributed-optimizer to shrink" if self._distributed() else "")

    def _distributed(self) -> bool:
        subs = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return any(type(o).__name__ == "DistributedOptimizer" for o in subs)

    def restore_resharded(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """One old rank's whole state of this rank's shard (another data-parallel size, the same tp and pp)."""
        from ...snapshot.plan import RecoveryError

        got = {k: meta["parallel"][k] for k in ("tp", "pp")}, {k: meta["coords"][k] for k in ("tp", "pp")}
        want = {"tp": self.layout.tp, "pp": self.layout.pp}, {"tp": self.coords.tp, "pp": self.coords.pp}
        if got != want:
            raise RecoveryError(f"elastic: a snapshot of shard {got} was handed to a rank of shard {want}")
        was = meta.get("global_batch")
        if was is not None and was != self.global_batch and not self.allow_batch_change:
            raise RecoveryError(f"elastic: the snapshots were taken at global batch {was}, this job's is "
                                f"{self.global_batch}; pass --global-batch-size {was} (kept across data-parallel "
                                "sizes), or set deadpool.elastic.allow_batch_change to true")
        self._restore_tensors(tensors, meta)

    def _restore_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, live in self.tensors():
                if name.startswith("optim."):
                    continue  # the state dict may not exist yet on a fresh optimizer; handled below
                copy_into(live, tensors[name], name)
            for k, inner in enumerate(inner_optimizers(self.optimizer)):
                for g, group in enumerate(inner.param_groups):
                    for i, p in enumerate(group["params"]):
                        prefix = f"optim.{k}.{g}.{i}."
                        state = inner.state.setdefault(p, {})
                        restore_optimizer_state(state, tensors, prefix, meta["optim_scalars"].get(f"{k}.{g}.{i}", {}))
        self.restore_meta(meta)

    # -- differential checkpoints (see deadpool_ext/snapshot/differential.py) ------------------------
    def inner_optimizer(self) -> Any:
        inners = inner_optimizers(self.optimizer)
        if len(inners) != 1 or type(self.optimizer).__name__ == "DistributedOptimizer":
            from ...snapshot.state import UnsupportedEngineError

            raise UnsupportedEngineError(
                f"differential checkpoints support one non-distributed Megatron optimizer; this job has "
                f"{type(self.optimizer).__name__} with {len(inners)} inner optimizer(s): "
                "turn deadpool.differential off")
        return inners[0]

    def masters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps, in param-group order."""
        return [p for group in self.inner_optimizer().param_groups for p in group["params"]]

    def sync_params_from_masters(self) -> None:
        # fp32: the optimizer steps the model parameters themselves; bf16/fp16: copy the fp32 mains back.
        copy = getattr(self.optimizer, "_copy_main_params_to_model_params", None)
        if copy is not None:
            copy()

    def restore_meta(self, meta: dict[str, Any]) -> None:
        """Param-group scalars, scheduler, grad scaler, counters, RNG (incl. the TP tracker), client state."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        for k, inner in enumerate(inner_optimizers(self.optimizer)):
            for group, saved in zip(inner.param_groups, meta["param_groups"][k]):
                group.update(saved)
        if meta["scheduler"] is not None and self.scheduler is not None:
            # Megatron's load_state_dict *adds* the saved step count (step(increment=num_steps)); restoring a
            # base and then a differential's meta would count twice, so start from zero.
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(meta["scheduler"])
        scaler = getattr(self.optimizer, "grad_scaler", None)
        if scaler is not None and meta["grad_scaler"]:
            scaler.load_state_dict(meta["grad_scaler"])
        self.progress.iteration = int(meta["iteration"])
        self.progress.consumed_samples = int(meta["consumed_samples"])
        restore_rng(meta["rng"])
        get_cuda_rng_tracker().set_states({name: s.clone() for name, s in meta["rng_tracker"].items()})
        if self._restore_client_state is not None:
            self._restore_client_state(meta.get("client", {}))
