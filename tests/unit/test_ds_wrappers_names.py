"""The file names a DeepSpeed checkpoint may hold come from the installed DeepSpeed's naming functions
(``integrations/deepspeed/names.py``): every name those functions return for ZeRO 0-3, bf16, pipeline and MoE
layouts, at real rank/layer/expert numbers, is accepted; traversal and anything else is refused in one line."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from deadpool_ext.persist.records import UnsafeNameError

RANKS = (0, 1, 7, 12, 123, 4095)


def _engine_like(partitioned: bool, mp_rank: int):
    from deepspeed.runtime.engine import DeepSpeedEngine

    class Eng:  # what DeepSpeed's naming methods read from self (names.py derives from the same methods)
        checkpoint_mp_rank = mp_rank
        _get_zero_ckpt_prefix = DeepSpeedEngine._get_zero_ckpt_prefix
        _get_rank_zero_ckpt_name = DeepSpeedEngine._get_rank_zero_ckpt_name
        _get_ckpt_name = DeepSpeedEngine._get_ckpt_name
        _get_optimizer_ckpt_name = DeepSpeedEngine._get_optimizer_ckpt_name

        def zero_optimization_partition_weights(self):
            return partitioned

    return Eng()


def deepspeed_writes() -> dict[str, list[str]]:
    """The names DeepSpeed's own functions return for each layout, at several real numbers."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    out: dict[str, list[str]] = {"zero0-2 model": [], "zero3 model": [], "zero optim": [], "bf16 optim": [],
                                 "pipeline": [], "pipeline+tensor": [], "moe": []}
    for mp in RANKS[:4]:
        out["zero0-2 model"].append(_engine_like(False, mp)._get_ckpt_name("d", "global_step3"))
        for dp in RANKS:
            out["zero3 model"].append(_engine_like(True, mp)._get_ckpt_name("d", "t", pp_placeholder=str(dp)))
            out["zero optim"].append(_engine_like(False, mp)._get_rank_zero_ckpt_name("d", "t", mp, dp, False))
            out["bf16 optim"].append(_engine_like(False, mp)._get_rank_zero_ckpt_name("d", "t", mp, dp, True))
            out["moe"].append(_engine_like(False, mp)._get_optimizer_ckpt_name("d", "t", dp))
            for layer in (-1, 0, 3, 17):
                out["moe"].append(DeepSpeedEngine._get_expert_ckpt_name("d", layer, dp, "t", checkpoint_mp_rank=mp))
    for key, topo in (("pipeline", PipeDataParallelTopology(num_pp=2, num_dp=3)),
                      ("pipeline+tensor", PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2))):
        for rank in range(topo.world_size()):
            for start, local in ((0, 0), (0, 5), (9, 3), (100, 7)):
                module = SimpleNamespace(_local_start=start, _grid=SimpleNamespace(_topo=topo), global_rank=rank)
                out[key].append(PipelineModule.ckpt_layer_path(module, "d", local))
    return {k: [os.path.basename(p) for p in v] for k, v in out.items()}


def test_every_name_deepspeed_writes_is_accepted():
    from deadpool_ext.integrations.deepspeed.names import deepspeed_file_names
    from deadpool_ext.persist.layout import FALLBACK_NAMES

    rule = deepspeed_file_names()
    written = deepspeed_writes()
    assert "layer_00-model_states.pt" in written["pipeline"]  # the name the hand-written list refused
    assert "layer_05-model_01-model_states.pt" in written["pipeline+tensor"]
    assert any(n.startswith("bf16_zero_pp_rank_") for n in written["bf16 optim"])
    for layout, names in written.items():
        assert names, layout
        for name in names:
            assert rule.check(name, layout) == name
            # the fallback (a process without the integration: deadpool verify) accepts them too
            assert FALLBACK_NAMES.check(name, layout) == name


def test_the_persist_layer_uses_deepspeeds_names_once_the_integration_is_imported():
    import deadpool_ext.integrations.deepspeed  # noqa: F401  (registers the rule)
    from deadpool_ext.integrations.deepspeed.names import deepspeed_file_names
    from deadpool_ext.persist.layout import check_file_name, file_names

    assert file_names() is deepspeed_file_names()
    assert check_file_name("layer_00-model_states.pt", "x") == "layer_00-model_states.pt"
    assert "layer_N-model_states.pt" in file_names().allowed


@pytest.mark.parametrize("name", [
    "../mp_rank_00_model_states.pt", "/etc/passwd", "sub/mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt/",
    "..", ".", "", "latest", "zero_to_fp32.py", "mp_rank_00_model_states.pt.evil", "mp_rank_00_model_states.py",
    "mp_rank__model_states.pt", "mp_rank_1234567890_model_states.pt", "mp_rank_\u0660\u0660_model_states.pt",
    "mp_rank_00_model_states.pt\n", "layer_00-model_states.pt\x00", "layer_ab-model_states.pt",
    "layer_00-pipe_01-model_states.pt", "layer_00-model_01-data_00-model_states.pt", "deadpool_commit.json",
    "bf16_zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt~",
    "..\\mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt ", 7, None,
])
def test_anything_else_is_refused_in_one_line(name):
    from deadpool_ext.integrations.deepspeed.names import deepspeed_file_names

    with pytest.raises(UnsafeNameError) as info:
        deepspeed_file_names().check(name, "base/deadpool_commit.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("base/deadpool_commit.json")


def test_patterns_are_one_path_component_of_digits_and_deepspeeds_literals():
    """Each pattern's only variable part is a bounded ASCII digit run: nothing a name could use to escape."""
    from deadpool_ext.integrations.deepspeed.names import DIGITS, deepspeed_file_names

    for p in deepspeed_file_names().patterns:
        literal = p.pattern[1:-1].replace(DIGITS, "")
        assert "[" not in literal and "*" not in literal and "/" not in literal and "(" not in literal, p.pattern
