"""A hot-swap rebuild builds its engine without DeepSpeed's initial weight synchronisation only when every rank
restores its state next (agreed by all), and the patch really skips it: real DeepSpeed ZeRO-3 engines on a
2-rank gloo world. That the restored run is then bit-identical is test_hot_swap's (every hot-swap there takes
this path)."""
import json

import pytest

from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, run_job

WORKER = "tests/integration/workers/unsynced_init.py"


MODES = ("agree_yes", "agree_no", "synced", "unsynced")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """mode -> rank -> what the worker recorded: every mode in one 2-rank job (one process start-up, not four)."""
    d = tmp_path_factory.mktemp("unsynced")
    job = Job(launcher="torchrun", script=WORKER, nproc_per_node=2, port=free_port(), args=(",".join(MODES), str(d)))
    res = run_job(job.argv(), timeout_s=240, env=job.env())
    assert not res.timed_out and res.returncode == 0, res.output[-3000:]
    return {m: {r: json.loads((d / f"{m}.rank{r}.json").read_text()) for r in (0, 1)} for m in MODES}


@pytest.mark.parametrize("mode, expected", [("agree_yes", True), ("agree_no", False)])
def test_every_rank_must_say_it_restores(ranks, mode, expected):
    out = ranks[mode]
    assert [out[r]["every_rank_restores"] for r in (0, 1)] == [expected, expected]


def test_unsynced_engine_keeps_each_ranks_own_values_and_trains(ranks):
    synced, unsynced = ranks["synced"], ranks["unsynced"]
    for r in (0, 1):
        assert synced[r]["partition_is_rank0_slice"], synced[r]  # DeepSpeed broadcast rank 0's weights
        assert unsynced[r]["partition_is_own_slice"], unsynced[r]  # no broadcast: this rank's own values
        assert unsynced[r]["patch_reverted"] and synced[r]["patch_reverted"]
        assert unsynced[r]["step_loss_finite"] and synced[r]["step_loss_finite"]
    # The control can fail: rank 1's own values differ from rank 0's, so only a broadcast makes them equal.
    assert not unsynced[1]["partition_is_rank0_slice"]
    assert not synced[1]["partition_is_own_slice"]
