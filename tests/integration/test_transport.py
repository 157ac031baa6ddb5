"""Contract tests every tier-2 Transport implementation must pass, with real processes and a real gloo group
(replicate/transport.py states the guarantee: body first, MAGIC last; an interrupted transfer leaves a torn
buffer, never a complete-looking one)."""
from __future__ import annotations

import json

import pytest

from deadpool_ext.testing.launch import base_env, free_port, run_job, torchrun_cmd

WORKER = "tests/integration/workers/transport_pair.py"
IMPLEMENTATIONS = ["gloo"]


def _run(tmp_path, impl: str, case: str, ranks: tuple[int, ...]) -> dict[int, dict]:
    d = tmp_path / f"{impl}-{case}"
    d.mkdir()
    res = run_job(torchrun_cmd(2, WORKER, [impl, case, str(d)], port=free_port()), timeout_s=120, env=base_env())
    assert not res.timed_out, res.output[-3000:]
    return {r: json.loads((d / f"rank{r}.json").read_text()) for r in ranks}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_blobs_cross_both_ways_intact(tmp_path, impl):
    out = _run(tmp_path, impl, "both_ways", (0, 1))
    for r in (0, 1):
        assert out[r]["old_valid"]  # the buffer held a valid (older) blob before the round
        assert out[r]["intact"] and out[r]["why"] is None, out[r]
        assert out[r]["meta"]["rank"] == 1 - r and out[r]["meta"]["version"] == 7


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_interrupted_transfer_leaves_a_torn_buffer(tmp_path, impl):
    out = _run(tmp_path, impl, "torn", (1,))[1]
    assert out["old_valid"]
    assert out["raised"] == "RuntimeError", out
    assert out["magic_zero"] and out["meta"] is None and "torn" in out["why"], out
