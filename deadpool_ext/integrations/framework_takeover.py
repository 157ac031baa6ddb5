"""What the HF Trainer (Accelerate) and Lightning keep of a spare's build-time rank, relabelled with its engine.

Why (issue 44): a spare builds its engine ahead for the node it shadows (``rebuild/spare.py``); assigned another
node's ranks, it relabels the engine in place (``deepspeed/takeover.py``). An HF Trainer or Lightning job read the
rank while the script set itself up, so its spare started again from the script's first line (4.5 s against 0.1 s
for the Trainer). These frameworks hold copies of the rank that the engine's relabel does not reach.

What they keep from it, each set by :func:`relabel` (or a reason in :func:`refusal`):

- Accelerate 1.x (``accelerate/state.py``, ``data_loader.py``): ``PartialState`` and ``AcceleratorState``'s
  ``process_index`` (``torch.distributed.get_rank()`` at the state's first construction; ``AcceleratorState``
  copies the partial state's dict), which every property of the Accelerator and of ``TrainingArguments`` that
  answers from the rank reads at each call; every prepared loader's ``BatchSamplerShard`` and
  ``IterableDatasetShard`` (the shard of each batch this process takes). A Hugging Face ``datasets``
  ``IterableDataset`` is sharded into a copy per process, which cannot be relabelled;
- transformers 5.x: ``TrainerState.is_world_process_zero`` (``Trainer.__init__``, ``init_training_references``);
- Lightning 2.x (``lightning/fabric/plugins/environments``, ``pytorch/strategies/ddp.py`` ``set_world_ranks``,
  ``lightning_utilities`` ``rank_zero_only``): each cluster environment's global rank (``set_global_rank``; the
  strategy, the trainer and the module answer from it) and ``rank_zero_only.rank`` (rank-zero-only logging, the
  loggers' experiments, seeded workers). Lightning builds its loaders and samplers after the engine;
- any ``DistributedSampler``'s ``rank``.

What the spare's rank watch saw these packages read (``rebuild/rank_reads.py``) is then covered
(:attr:`Found.covers`). Only a Trainer's Accelerate loop is covered: an Accelerate loop of the script's own may keep
copies of the process index the watch cannot see (``accelerator.process_index`` is a plain attribute), so its spare
starts again. Not seen either: a script's own copy of ``args.process_index`` or ``trainer.global_rank`` made before
the framework built its engine.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = ("1.0", "2.0")
"""Accelerate versions whose objects :func:`relabel` sets (>= first, < second). Tested with 1.15."""
SUPPORTED_LIGHTNING = ("2.0", "3.0")
"""Lightning versions whose objects :func:`relabel` sets. Tested with 2.6."""
ACCELERATE_COVERS = ("accelerate", "transformers")
LIGHTNING_COVERS = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities")
RANK_ZERO_MODULES = ("lightning_utilities.core.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.pytorch.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                     "pytorch_lightning.utilities.rank_zero")
"""Where Lightning's ``rank_zero_only`` (one function object, its ``rank`` an attribute) is imported from."""


@dataclass
class Found:
    """The rank-holding objects of an Accelerate job, collected before the spare's wait (off the critical path)."""

    states: list[Any] = field(default_factory=list)
    """The shared-state dicts holding ``process_index``."""
    shards: list[Any] = field(default_factory=list)
    """``BatchSamplerShard`` / ``IterableDatasetShard`` objects (``process_index``)."""
    samplers: list[Any] = field(default_factory=list)
    """``DistributedSampler`` objects (``rank``)."""
    trainer_states: list[Any] = field(default_factory=list)
    """``TrainerState`` objects (``is_world_process_zero``)."""
    trainers: int = 0
    sharded_copies: list[str] = field(default_factory=list)
    """The type names of datasets sharded into a copy per process."""
    version: str = ""
    """Accelerate's version ("" : no Accelerate state)."""
    cluster_envs: list[Any] = field(default_factory=list)
    """Lightning's cluster environments (``set_global_rank``)."""
    rank_zero: list[Any] = field(default_factory=list)
    """Lightning's ``rank_zero_only`` function objects (their ``rank``)."""
    lightning_version: str = ""

    @property
    def covers(self) -> tuple[str, ...]:
        """The packages whose reads of the rank :func:`relabel` covers."""
        return ((ACCELERATE_COVERS if self.version else ()) + (LIGHTNING_COVERS if self.lightning_version else ()))


def find() -> Found | None:
    """The rank-holding objects of this process's HF Trainer / Accelerate or Lightning job; None: neither made any."""
    state_mod = sys.modules.get("accelerate.state")
    accelerate_on = state_mod is not None and bool(state_mod.PartialState._shared_state)
    env_mod = sys.modules.get("lightning.fabric.plugins.environments.cluster_environment") or sys.modules.get(
        "lightning_fabric.plugins.environments.cluster_environment")
    if not accelerate_on and env_mod is None:
        return None
    from torch.utils.data import DistributedSampler

    found = Found()
    kinds: list[tuple[type, list[Any]]] = [(DistributedSampler, found.samplers)]
    loader_cls: Any = None
    if accelerate_on:
        import accelerate
        from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard

        found.version = accelerate.__version__
        found.states = [s for s in (state_mod.PartialState._shared_state,  # type: ignore[union-attr]
                                    state_mod.AcceleratorState._shared_state)  # type: ignore[union-attr]
                        if "process_index" in s]
        kinds += [(BatchSamplerShard, found.shards), (IterableDatasetShard, found.shards)]
        loader_cls = DataLoaderShard
        state_cls = getattr(sys.modules.get("transformers.trainer_callback"), "TrainerState", None)
        if state_cls is not None:
            kinds.append((state_cls, found.trainer_states))
    if env_mod is not None:
        import lightning_utilities  # noqa: F401  (Lightning's dependency: its version below)

        lightning = sys.modules.get("lightning") or sys.modules.get("lightning_fabric")
        found.lightning_version = str(getattr(lightning, "__version__", "0"))
        kinds.append((env_mod.ClusterEnvironment, found.cluster_envs))
        for name in RANK_ZERO_MODULES:
            fn = getattr(sys.modules.get(name), "rank_zero_only", None)
            if fn is not None and all(fn is not f for f in found.rank_zero):
                found.rank_zero.append(fn)
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    for obj in gc.get_objects():
        t = type(obj)  # not isinstance: a lazy module attribute's __class__ warns when read
        for cls, into in kinds:
            if issubclass(t, cls):
                into.append(obj)
                break
        else:
            if trainer_cls is not None and issubclass(t, trainer_cls):
                found.trainers += 1
            elif (loader_cls is not None and issubclass(t, loader_cls)
                  and type(obj.dataset).__module__.split(".")[0] == "datasets" and hasattr(obj.dataset, "n_shards")):
                found.sharded_copies.append(type(obj.dataset).__name__)  # sharded by prepare_data_loader
    return found


def refusal(found: Found) -> str | None:
    """Why this job's framework objects cannot take another rank in place (None: they can). Pure."""
    from packaging.version import Version

    if found.version:
        v = Version(found.version.split("+")[0])
        lo, hi = (Version(x) for x in SUPPORTED)
        if not lo <= v < hi:
            return f"Accelerate {v} (the relabel supports >={lo},<{hi})"
        if not found.trainers:
            return ("an Accelerate loop of the script's own (its copies of the process index are not seen; an HF "
                    "Trainer's are relabelled)")
        if found.sharded_copies:
            return f"a datasets {found.sharded_copies[0]} sharded into a copy per process by Accelerate"
    if found.lightning_version:
        v = Version(found.lightning_version.split("+")[0])
        lo, hi = (Version(x) for x in SUPPORTED_LIGHTNING)
        if not lo <= v < hi:
            return f"Lightning {v} (the relabel supports >={lo},<{hi})"
    return None


def relabel(found: Found, rank: int) -> None:
    """Sets every object :func:`find` collected to ``rank`` (the process's groups and the engine already answer it)."""
    for s in found.states:
        s["process_index"] = rank
    for shard in found.shards:
        shard.process_index = rank
    for sampler in found.samplers:
        sampler.rank = rank
    for st in found.trainer_states:
        st.is_world_process_zero = rank == 0
    for env in found.cluster_envs:
        env.set_global_rank(rank)
    for fn in found.rank_zero:
        fn.rank = rank


__all__ = ["Found", "find", "refusal", "relabel"]
