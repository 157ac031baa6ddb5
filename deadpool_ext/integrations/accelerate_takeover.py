"""What Accelerate and the HF Trainer keep of a spare's build-time rank, relabelled with its engine (issue 44).

Why: an HF Trainer job's spare builds its engine ahead for the node it shadows, like any DeepSpeed job's
(``rebuild/spare.py``), but Accelerate read the rank while the script built its ``TrainingArguments``, so the spare
assigned another node's ranks started again from the script's first line (4.5 s against 0.1 s). Relabelling
DeepSpeed's engine (``deepspeed/takeover.py``) is not enough: Accelerate and the Trainer hold copies of the rank.

What they keep from it (accelerate 1.x and transformers 5.x, read in ``accelerate/state.py``, ``data_loader.py`` and
``transformers/trainer.py``; each set below, or a reason in :func:`refusal`):

- ``PartialState`` and ``AcceleratorState``: ``process_index`` (``torch.distributed.get_rank()`` at the state's
  first construction; ``AcceleratorState`` copies the partial state's dict). Every property of the Accelerator and
  of ``TrainingArguments`` that answers from the rank (``process_index``, ``is_main_process``, ``should_save``, ...)
  reads it there, at each call;
- every prepared loader's ``BatchSamplerShard`` and ``IterableDatasetShard`` (``prepare_data_loader``: the shard of
  each batch this process takes), and a ``DistributedSampler``'s ``rank``; a Hugging Face ``datasets``
  ``IterableDataset`` is sharded into a copy per process, which cannot be relabelled;
- the Trainer's ``TrainerState.is_world_process_zero`` (``Trainer.__init__`` and ``init_training_references``).

What the spare's rank watch saw Accelerate and the Trainer read (``rebuild/rank_reads.py``) is then covered
(:data:`COVERS`). Only a Trainer's loop is covered: an Accelerate loop of the script's own may keep copies of the
process index the watch cannot see (``accelerator.process_index`` is a plain attribute), so its spare starts again.
Not seen either: a Trainer script's own copy of ``args.process_index`` made before ``trainer.train()``.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = ("1.0", "2.0")
"""Accelerate versions whose objects :func:`relabel` sets (>= first, < second). Tested with 1.15."""
COVERS = ("accelerate", "transformers")
"""The packages whose reads of the rank, seen by the spare's watch, :func:`relabel` covers."""


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


def find() -> Found | None:
    """The rank-holding objects of this process's Accelerate job; None: no Accelerate state was made."""
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is None or not state_mod.PartialState._shared_state:
        return None
    import accelerate
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard
    from torch.utils.data import DistributedSampler

    found = Found(version=accelerate.__version__)
    found.states = [s for s in (state_mod.PartialState._shared_state, state_mod.AcceleratorState._shared_state)
                    if "process_index" in s]
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    state_cls = getattr(sys.modules.get("transformers.trainer_callback"), "TrainerState", None)
    for obj in gc.get_objects():
        t = type(obj)  # not isinstance: a lazy module attribute's __class__ warns when read
        if issubclass(t, (BatchSamplerShard, IterableDatasetShard)):
            found.shards.append(obj)
        elif issubclass(t, DistributedSampler):
            found.samplers.append(obj)
        elif state_cls is not None and issubclass(t, state_cls):
            found.trainer_states.append(obj)
        elif trainer_cls is not None and issubclass(t, trainer_cls):
            found.trainers += 1
        elif issubclass(t, DataLoaderShard) and type(obj.dataset).__module__.split(".")[0] == "datasets":
            if hasattr(obj.dataset, "n_shards"):  # a datasets IterableDataset, sharded by prepare_data_loader
                found.sharded_copies.append(type(obj.dataset).__name__)
    return found


def refusal(found: Found) -> str | None:
    """Why this Accelerate job's objects cannot take another rank in place (None: they can). Pure."""
    from packaging.version import Version

    v = Version(found.version.split("+")[0])
    lo, hi = (Version(x) for x in SUPPORTED)
    if not lo <= v < hi:
        return f"Accelerate {v} (the relabel supports >={lo},<{hi})"
    if not found.trainers:
        return ("an Accelerate loop of the script's own (its copies of the process index are not seen; an HF "
                "Trainer's are relabelled)")
    if found.sharded_copies:
        return f"a datasets {found.sharded_copies[0]} sharded into a copy per process by Accelerate"
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


__all__ = ["COVERS", "Found", "find", "refusal", "relabel"]
