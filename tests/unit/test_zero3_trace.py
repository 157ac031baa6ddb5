"""ZeRO-3's recorded trace across an in-place hot-swap (``integrations/deepspeed/trace.py``): the survivors keep
theirs, the spare's fresh engine adopts it, so no rank records again after the swap. The decision is pure; the
rest runs on real ZeRO-3 engines in one process (a spare's engine is a second one of the same model)."""
from __future__ import annotations

import pytest
import torch

from deadpool_ext.integrations.deepspeed import trace
from tests.conftest import one_rank_gloo_world


def _entry(digest, fp="m"):
    return {"fp": fp, "digest": digest}


def test_every_rank_holding_the_same_trace_keeps_it():
    d = trace.decide([_entry("a"), _entry("a"), _entry("a")])
    assert (d.keep, d.source, d.digest) == (True, None, "a")


def test_the_ranks_without_one_receive_it_from_the_lowest_holder():
    d = trace.decide([_entry(None), _entry("a"), _entry("a")])
    assert (d.keep, d.source, d.digest) == (True, 1, "a")
    assert "from rank 1" in d.why


@pytest.mark.parametrize("entries,why", [
    ([_entry(None), _entry(None)], "no rank holds a complete trace"),
    ([_entry("a"), _entry("b"), _entry(None)], "different ones"),
    ([_entry("a"), _entry(None, fp="other")], "differ in structure"),
    ([], "no rank"),
])
def test_otherwise_every_rank_records_again(entries, why):
    d = trace.decide(entries)
    assert not d.keep and d.source is None and why in d.why


@pytest.mark.parametrize("bad", [None, [], {"modules": [0]}, {"modules": [0, 9], "params": []},
                                 {"modules": [0], "params": [[0]]}, {"modules": [0], "params": [[5, 0]]},
                                 {"modules": [0], "params": [[0, -1]]}, {"modules": ["0"], "params": []},
                                 {"modules": [True], "params": []}])
def test_a_received_trace_must_fit_the_model(bad):
    assert not trace.well_formed(bad, n_modules=3, n_params=4)
    assert trace.well_formed({"modules": [0, 2, 1], "params": [[3, 0], [0, 7]]}, n_modules=3, n_params=4)


# -- real ZeRO-3 engines ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    with one_rank_gloo_world():
        yield


def _engine():
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return eng


def _steps(eng, n: int) -> list[float]:
    out = []
    for i in range(n):
        loss = eng(torch.full((2, 4), float(i + 1))).pow(2).sum()
        eng.backward(loss)
        eng.step()
        out.append(loss.item())
    return out


@pytest.fixture
def trace_checks(monkeypatch):
    """Counts DeepSpeed's cross-rank trace checks, which only a step that records (or is about to) makes."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    calls = []
    real = ppc.assert_ints_same_as_other_ranks
    monkeypatch.setattr(ppc, "assert_ints_same_as_other_ranks", lambda ints: (calls.append(len(ints)), real(ints)))
    return calls


def test_a_fresh_engine_adopts_a_recorded_trace_and_never_records(world, trace_checks):
    survivor = _engine()
    _steps(survivor, 3)
    coord = trace.coordinator(survivor)
    held = trace.held(coord, survivor.module)
    assert held is not None and held["modules"] and held["params"]

    spare, fresh = _engine(), _engine()
    assert trace.held(trace.coordinator(spare), spare.module) is None
    assert trace.fingerprint(spare.module) == trace.fingerprint(survivor.module)
    trace.install(trace.coordinator(spare), spare.module, held)
    assert trace.held(trace.coordinator(spare), spare.module) == held
    trace_checks.clear()
    adopted = _steps(spare, 3)
    assert trace_checks == []  # every step started along the trace: no recording, no cross-rank check
    assert trace.coordinator(spare).is_complete_trace()
    recorded = _steps(fresh, 3)
    assert trace_checks  # an engine that records makes them (so the count above is no accident)
    assert adopted == recorded  # the trace orders fetches; the numbers are those of an engine that recorded


def test_abandon_keeps_a_complete_trace_and_drops_one_being_recorded(world):
    from deadpool_ext.integrations.deepspeed.runtime import abandon_step

    eng = _engine()
    _steps(eng, 3)
    before = trace.held(trace.coordinator(eng), eng.module)
    eng(torch.ones(2, 4)).sum()  # a step interrupted after its forward
    abandon_step(eng)
    assert trace.held(trace.coordinator(eng), eng.module) == before

    recording = _engine()
    _steps(recording, 1)
    assert trace.coordinator(recording).is_record_trace()
    abandon_step(recording)
    assert trace.coordinator(recording).is_invalid_trace()


def test_agree_keeps_it_and_says_why(world):
    eng = _engine()
    _steps(eng, 3)
    d = trace.agree(eng, None, rank=0)
    assert d is not None and d.keep and d.source is None and "every rank holds it" in d.why
    assert trace.coordinator(eng).is_complete_trace()


def test_below_stage_3_there_is_nothing_to_agree(world):
    import deepspeed

    model = torch.nn.Linear(4, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"torch_adam": True}}}
    eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    assert trace.coordinator(eng) is None and trace.agree(eng, None, rank=0) is None
