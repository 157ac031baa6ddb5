"""The file names a DeepSpeed checkpoint may hold, derived from the installed DeepSpeed's own naming functions.

Nothing here is a hand-written list of names: each pattern is what one of DeepSpeed's functions returns, with
every rank, layer and expert number it formats replaced by a digit run. The functions are called with a stand-in
``self`` carrying only what they read, and with sentinel numbers that cannot occur elsewhere in a name:

=============================================  ===================================================================
DeepSpeed function                             writes
=============================================  ===================================================================
``DeepSpeedEngine._get_ckpt_name``             ``mp_rank_NN_model_states.pt``; ZeRO-3 ``zero_pp_rank_R_mp_rank_NN_
                                               model_states.pt``
``DeepSpeedEngine._get_rank_zero_ckpt_name``   ZeRO optimizer partitions, plain and bf16 (``bf16_zero_pp_rank_...``)
``DeepSpeedEngine._get_optimizer_ckpt_name``   MoE optimizer states (``expp_rank_R_mp_rank_NN_optim_states.pt``)
``DeepSpeedEngine._get_expert_ckpt_name``      MoE experts, old (layer -1) and new (``layer_L_expert_E_...``) style
``PipelineModule.ckpt_layer_path``             pipeline layers, for DeepSpeed's topologies: ``layer_LL-model_states.pt``
                                               (pipe x data), ``layer_LL-model_MM-model_states.pt`` (pipe x data x
                                               model)
=============================================  ===================================================================

A DeepSpeed that renames its files changes the patterns with it; one whose function no longer takes the
arguments used here fails :func:`deepspeed_file_names` loudly (``tests/unit/test_ds_wrappers_names.py``), never
silently falls back. The rule is handed to the persist layer (:func:`deadpool_ext.persist.layout.use_file_names`)
when this package is imported, and to the checkpoint engine's manifest reader directly.
"""
from __future__ import annotations

import functools
import os
import re
from types import SimpleNamespace
from typing import Any

from ...persist.layout import FileNames

DIGITS = "[0-9]{1,9}"
# Sentinels: distinct, 7 digits (so a ``:02d`` leaves them as they are), none a substring of another.
_MP, _DP, _LAYER, _EXPERT, _EP, _MODEL, _LOCAL = (7100003, 7200005, 7300007, 7400009, 7500011, 7600013, 7700017)
_SENTINELS = (_MP, _DP, _LAYER, _EXPERT, _EP, _MODEL, _LOCAL)


def _pattern(path: str) -> str:
    """The regex of one name DeepSpeed returned: its basename, every sentinel a digit run, the rest literal."""
    name = os.path.basename(path)
    out = re.escape(name)
    for s in _SENTINELS:
        out = out.replace(str(s), DIGITS)
    if re.search(r"7[0-9]00", re.sub(re.escape(DIGITS), "", out)):
        raise RuntimeError(f"DeepSpeed formatted a sentinel number in {name!r} in a way not recognised")
    return out


def _engine_names() -> list[str]:
    from deepspeed.runtime.engine import DeepSpeedEngine

    class Names:  # only what DeepSpeed's naming methods read from ``self``
        checkpoint_mp_rank = _MP
        _get_zero_ckpt_prefix = DeepSpeedEngine._get_zero_ckpt_prefix
        _get_rank_zero_ckpt_name = DeepSpeedEngine._get_rank_zero_ckpt_name
        _get_ckpt_name = DeepSpeedEngine._get_ckpt_name
        _get_optimizer_ckpt_name = DeepSpeedEngine._get_optimizer_ckpt_name

        def __init__(self, partition_weights: bool) -> None:
            self._partition = partition_weights

        def zero_optimization_partition_weights(self) -> bool:
            return self._partition

    out = []
    for partitioned in (False, True):  # ZeRO 0-2 model states; ZeRO-3 per-rank model states
        out.append(Names(partitioned)._get_ckpt_name("", "t", pp_placeholder=str(_DP)))
    for bf16 in (False, True):  # ZeRO optimizer partitions
        out.append(Names(False)._get_rank_zero_ckpt_name("", "t", _MP, _DP, bf16))
    out.append(Names(False)._get_optimizer_ckpt_name("", "t", _EP))  # MoE: per expert-parallel rank
    for layer in (-1, _LAYER):  # MoE experts: old style (no layer) and per layer
        out.append(DeepSpeedEngine._get_expert_ckpt_name("", layer, _EXPERT, "t", checkpoint_mp_rank=_MP))
    return out


def _pipeline_names() -> list[str]:
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import (
        PipeDataParallelTopology,
        PipeModelDataParallelTopology,
        ProcessTopology,
    )

    out = []
    for topology in (PipeDataParallelTopology, PipeModelDataParallelTopology):
        axes = _axes(topology)
        coord = SimpleNamespace(**{a: _MODEL for a in axes})
        topo: Any = SimpleNamespace(get_axis_names=lambda axes=axes: list(axes), get_coord=lambda rank, c=coord: c)
        topo.get_rank_repr = functools.partial(ProcessTopology.get_rank_repr, topo)
        module: Any = SimpleNamespace(_local_start=_LOCAL - _LAYER, _grid=SimpleNamespace(_topo=topo), global_rank=0)
        out.append(PipelineModule.ckpt_layer_path(module, "", _LAYER))
    return out


def _axes(topology: type) -> list[str]:
    """The axis names of one of DeepSpeed's topology classes (built with every dimension 1)."""
    import inspect

    n = len(inspect.signature(topology).parameters)
    return list(topology(*([1] * n)).get_axis_names())


@functools.cache
def deepspeed_file_names() -> FileNames:
    """Every file name the installed DeepSpeed writes into a checkpoint tag directory, as patterns."""
    raw = _engine_names() + _pipeline_names()
    patterns = tuple(dict.fromkeys(_pattern(p) for p in raw))
    shown = ", ".join(p.replace(DIGITS, "N").replace("\\", "") for p in patterns)
    return FileNames(patterns=tuple(re.compile(f"^{p}$", re.ASCII) for p in patterns),
                     allowed=f"the file names the installed DeepSpeed writes: {shown}")


__all__ = ["deepspeed_file_names"]
