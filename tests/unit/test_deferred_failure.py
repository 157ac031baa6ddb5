"""A collective after a step's snapshot (a tier-3 base, a preemption drain's agreement) that fails because a peer
was lost: the step is taken and its snapshot scheduled, so a restore may resume right after it. Raised there, the
failure would skip the script's own bookkeeping of that step (its metrics line: the chaos suite saw "step 7
missing" after a restore of step 7). Under the in-place swap, in a loop that redoes a failed step and drains the
runtime at its end (``ResilientLoop``, ``resilient_steps``), it is raised at the framework's next call instead;
elsewhere at once. A real engine in one process; the lost peer is simulated (the drain's agreement raises
gloo's error), the rest is the wrapped ``engine.step`` / ``engine.forward`` as scripts call them."""
from __future__ import annotations

import pytest
import torch

from deadpool_ext.rebuild.context import context
from tests.conftest import one_rank_gloo_world

LOST = "[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"


@pytest.fixture(scope="module")
def world():
    with one_rank_gloo_world():
        yield


def _engine():
    import deepspeed

    from deadpool_ext.integrations.deepspeed import register

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return eng, register(eng, {"snapshot": {"background": False}, "recovery": {"restore_on_start": False}})


def _step(eng) -> None:
    loss = eng(torch.ones(2, 4)).sum()
    eng.backward(loss)
    eng.step()


@pytest.fixture
def lost_in_the_agreement(monkeypatch):
    from deadpool_ext.integrations.deepspeed import drain

    def agreement_with_a_lost_peer(runtime):
        raise RuntimeError(LOST)

    monkeypatch.setattr(drain, "at_boundary", agreement_with_a_lost_peer)
    st = context().drain
    monkeypatch.setattr(st, "armed", True)
    return st


@pytest.mark.parametrize("hot_swap,owner", [(True, "ResilientLoop"), (True, "resilient_steps"),
                                           (False, "ResilientLoop"), (True, None), (True, "hf_trainer")])
def test_a_failure_after_the_snapshot_is_raised_at_the_next_call_under_the_swap(world, lost_in_the_agreement,
                                                                               hot_swap, owner):
    """Deferred in the loops that redo a failed step and drain at their end; at once without the swap, in a plain
    loop (its redo knows a step call that failed after its update) and in the Trainer's (re-entered)."""
    eng, rt = _engine()
    try:
        rt._hot_swap = hot_swap  # what deadpool-run's membership and hot_swap.enabled set
        rt.loop_owner = owner
        if not hot_swap or owner not in ("ResilientLoop", "resilient_steps"):
            with pytest.raises(RuntimeError, match="Connection reset by peer"):
                _step(eng)
            return
        _step(eng)  # the step is done: the script's next line (its metrics) runs
        assert int(eng.global_steps) == 1
        assert rt._deferred is not None
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            eng(torch.ones(2, 4))  # the next step's first call: inside the loop's recovery scope
        lost_in_the_agreement.armed = False
        _step(eng)  # raised once
        assert int(eng.global_steps) == 2
    finally:
        rt.close()


def test_the_loops_last_step_raises_it_in_drain(world, lost_in_the_agreement):
    """``ResilientLoop`` drains the runtime after the last step, inside its recovery scope."""
    eng, rt = _engine()
    try:
        rt._hot_swap, rt.loop_owner = True, "ResilientLoop"
        _step(eng)
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            rt.drain()
        rt.drain()
    finally:
        rt.close()


def test_a_recovery_that_began_elsewhere_drops_the_kept_failure(world, lost_in_the_agreement):
    """Another call failed first (a collective of the script's own) and the recovery ran: the kept failure was the
    same lost peer, so the next call after the recovery must not raise it in the new generation."""
    eng, rt = _engine()
    try:
        rt._hot_swap, rt.loop_owner = True, "ResilientLoop"
        _step(eng)
        assert rt._deferred is not None
        rt._abandon_step()  # what the in-place recovery calls first (rebuild/recover.py)
        lost_in_the_agreement.armed = False
        _step(eng)
        assert int(eng.global_steps) == 2
    finally:
        rt.close()
