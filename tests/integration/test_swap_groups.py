"""In-place communicator swap (rebuild/swap.py) under a real DeepSpeed ZeRO-3 engine, 2 ranks on gloo: the
engine keeps working, bit for bit, when every communicator beneath its process groups is replaced mid-run, and an
engine built *solo* (a spare's local build) trains identically once it goes live. The failure path (SIGKILL, a
spare, the restore) is test_hot_swap's: every hot-swap there swaps in place."""
import json

import pytest

from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, run_job

WORKER = "tests/integration/workers/swap_groups.py"


def _ranks(tmp_path, mode: str) -> dict[int, dict]:
    d = tmp_path / mode
    d.mkdir()
    job = Job(launcher="torchrun", script=WORKER, nproc_per_node=2, port=free_port(), args=(mode, str(d)))
    res = run_job(job.argv(), timeout_s=240, env=job.env())
    assert not res.timed_out and res.returncode == 0, res.output[-3000:]
    return {r: json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.full_matrix(covered_by="test_hot_swap (every hot-swap there swaps in place under a ZeRO-3 engine: engine "
                                    "kept, losses bit-identical); tests/unit/test_swap.py (groups swapped in place, "
                                    "a detached group refuses collectives)")
def test_swap_mid_run_keeps_the_engine_and_its_losses(tmp_path):
    plain, swapped = _ranks(tmp_path, "plain"), _ranks(tmp_path, "swap")
    assert swapped[0]["losses"] == plain[0]["losses"]  # floats compared exactly
    for r in (0, 1):
        assert swapped[r]["backend"] == "deadpool"
        assert swapped[r]["swapped"] >= 2  # the default group and DeepSpeed's own
        assert swapped[r]["engine_id_after"] == swapped[r]["engine_id"]
        assert swapped[r]["groups_after"] == swapped[r]["groups_before"]
        assert "generation ended" in swapped[r]["detached_error"]  # a detached group refuses collectives


@pytest.mark.full_matrix(covered_by="test_hot_swap (every spare there builds its engine solo while it waits for its "
                                    "assignment, then goes live; losses bit-identical to the uninterrupted run)")
def test_solo_built_engine_trains_like_a_live_one(tmp_path):
    plain, solo = _ranks(tmp_path, "plain"), _ranks(tmp_path, "solo")
    assert solo[0]["losses"] == plain[0]["losses"]
    assert solo[0]["groups_before"] == solo[1]["groups_before"]
