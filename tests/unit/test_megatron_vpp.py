"""A Megatron-Core job whose model is in virtual pipeline stages (more than one model chunk per rank) and whose
tier-3 bases are on is refused at start-up: a ``ConfigError`` in one line naming the keys to change, raised where
the runtime is built, before anything else is and before any collective (no process group exists here: a
collective would raise something else). The bases themselves still refuse a direct call with several chunks
(``tests/unit/test_megatron_layout.py::test_tier3_bases_refuse_virtual_pipeline_stages_before_any_collective``)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt installs it)")

TWO = [object(), object()]


@pytest.mark.parametrize("bases", ["--save", "--load", "persist.url"])
def test_virtual_pipeline_with_tier3_bases_is_refused_in_one_line_naming_the_keys(bases):
    from deadpool_ext.config import ConfigError
    from deadpool_ext.integrations.megatron.checkpoint import VPP_FLAG, refuse_virtual_pipeline

    with pytest.raises(ConfigError) as info:
        refuse_virtual_pipeline(TWO, bases)
    msg = str(info.value)
    assert "\n" not in msg and VPP_FLAG in msg and bases in msg and "change" in msg, msg
    assert info.value.key == VPP_FLAG


def test_one_chunk_or_no_bases_is_not_refused():
    from deadpool_ext.integrations.megatron.checkpoint import refuse_virtual_pipeline

    refuse_virtual_pipeline([object()], "--save")
    refuse_virtual_pipeline(TWO, None)
    refuse_virtual_pipeline(TWO, "")


@pytest.mark.parametrize("tier3,persist_url", [("--save", None), (None, "/tmp/bases")])
def test_the_runtime_refuses_at_start_up_before_anything_else(tmp_path, tier3, persist_url):
    from deadpool_ext.config import ConfigError, DeadpoolConfig
    from deadpool_ext.integrations.megatron.layout import Layout, coordinates
    from deadpool_ext.integrations.megatron.runtime import Built, MegatronRuntime

    config = DeadpoolConfig.from_dict({"persist": {"url": persist_url}} if persist_url else {})
    layout = Layout(world_size=2, tp=1, pp=2)
    built = Built(chunks=TWO, optimizer=None, scheduler=None, config=None)
    with pytest.raises(ConfigError, match="virtual pipeline stages") as info:
        MegatronRuntime(built, config, layout, coordinates(0, layout), seed=0, global_batch=8, micro_batch=2,
                        tier3=tier3)
    assert (tier3 or "persist.url") in str(info.value)
