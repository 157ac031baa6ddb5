"""THE tables of what a Megatron-Core tier-3 base (dist_checkpointing, torch_dist format) may make an unpickler
build. Found by saving real bases (Megatron-Core 0.16, GPT with the local layer spec, TP1/TP2, CPU) and listing
the globals their pickles name; ``tests/security/test_storage.py`` loads such a base through them.

=====================================  ==============================================================================
file                                   how it is read
=====================================  ==============================================================================
``.metadata``                          plain pickle (torch.distributed.checkpoint): :class:`~deadpool_ext.persist.
                                       safe_load.RestrictedUnpickler` with :func:`dcp_metadata_table` -
                                       ``torch.distributed.checkpoint`` metadata/planner dataclasses, ``torch.Size``,
                                       torch dtypes, ``torch.serialization._get_layout``, ``pathlib.PosixPath``
``common.pt``, byte items in           ``torch.load(weights_only=True)`` + :func:`megatron_globals` (torch's own
``__R_I.distcp``                       weights-only set suffices: iteration, counters, scheduler and optimizer
                                       param-group dicts of numbers and strings)
``metadata.json``                      JSON (Megatron's own reader)
=====================================  ==============================================================================
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterable
from typing import Any

import torch

from ...persist.safe_load import SafeGlobal, allow_table


def megatron_globals(extra: Iterable[SafeGlobal] = ()) -> list[SafeGlobal]:
    """Classes beyond torch's weights-only set that ``common.pt`` and the byte items may hold: none found."""
    return [*extra]


def dcp_metadata_table() -> dict[str, Any]:
    """``"module.name" -> object`` that ``torch.distributed.checkpoint``'s ``.metadata`` pickle may refer to."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as pl

    entries: list[SafeGlobal] = [
        md.Metadata, md.TensorStorageMetadata, md.ChunkStorageMetadata, md.BytesStorageMetadata,
        md.TensorProperties, md.MetadataIndex, md.StorageMeta, md._MEM_FORMAT_ENCODING,
        fs._StorageInfo,
        pl.SavePlan, pl.TensorWriteData, pl.WriteItem, pl.WriteItemType,
        (torch.Size, "torch.Size"),
        # StorageMeta.checkpoint_id when a caller passes a Path (torch.distributed.checkpoint's own save does)
        (pathlib.PosixPath, "pathlib.PosixPath"), (pathlib.PosixPath, "pathlib._local.PosixPath"),
        (torch.serialization._get_layout, "torch.serialization._get_layout"),
    ]
    table = allow_table(entries)
    for name, obj in list(vars(torch).items()):  # dtypes pickle as GLOBAL torch.<name> (torch.float32, ...)
        if isinstance(obj, torch.dtype):
            table[f"torch.{name}"] = obj
    return table
