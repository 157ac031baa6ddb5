"""The simulator's straggler and preemption model (deadpool_ext/sim/stragglers.py): the policies on one trace."""
from __future__ import annotations

import argparse
import json

import pytest

from deadpool_ext.commands import simulate as command
from deadpool_ext.sim.costs import derive
from deadpool_ext.sim.params import Params, SimParamError
from deadpool_ext.sim.stragglers import (
    PreemptionModel,
    StragglerModel,
    _union,
    preemption_cost_s,
    simulate,
    straggler_trial,
    swap_s,
)

DAY = 86_400.0


def params(**over) -> Params:
    return Params().with_overrides({"sim.trials": 4, "sim.horizon_days": 10.0, **over})


def test_no_stragglers_is_full_goodput_either_way():
    r = simulate(params(), StragglerModel(rate_per_node_day=0.0), PreemptionModel(rate_per_day=0.0))
    assert r["stragglers"]["goodput_keep"] == r["stragglers"]["goodput_evict"] == 1.0
    assert r["preemption"]["goodput_kill"] == r["preemption"]["goodput_drain"] == 1.0


def test_one_kept_episode_slows_its_span_and_an_evicted_one_costs_a_window_and_a_swap():
    p = params()
    d = derive(p)
    m = StragglerModel(slowdown=2.0, factor=2.0, detect_s=30.0)
    eps = [(1000.0, 1000.0 + 3600.0)]
    keep = straggler_trial(eps, DAY, m, d, repair_s=86_400.0, evict=False)
    evict = straggler_trial(eps, DAY, m, d, repair_s=86_400.0, evict=True)
    assert keep["useful_s"] == pytest.approx(DAY - 3600.0 / 2)
    assert evict["useful_s"] == pytest.approx(DAY - 30.0 / 2 - swap_s(d))
    assert evict["evictions"] == 1


def test_below_the_factor_nothing_is_evicted():
    r = simulate(params(), StragglerModel(slowdown=1.5, factor=2.0), PreemptionModel())
    s = r["stragglers"]
    assert s["evictions"] == 0 and s["goodput_evict"] == s["goodput_keep"] < 1.0


def test_no_spare_no_eviction_and_a_pool_that_runs_dry_limits_the_gain():
    none = simulate(params(**{"cluster.spare_nodes": 0}), StragglerModel(), PreemptionModel())["stragglers"]
    assert none["evictions"] == 0 and none["goodput_evict"] == none["goodput_keep"]
    few = simulate(params(**{"cluster.spare_nodes": 2}), StragglerModel(rate_per_node_day=0.01),
                   PreemptionModel())["stragglers"]
    many = simulate(params(**{"cluster.spare_nodes": 200}), StragglerModel(rate_per_node_day=0.01),
                    PreemptionModel())["stragglers"]
    assert few["kept_no_spare"] > 0 and few["gained"] < many["gained"]
    assert many["goodput_evict"] > many["goodput_keep"]


def test_one_eviction_per_window():
    d = derive(params())
    m = StragglerModel(detect_s=30.0)
    eps = [(1000.0, 5000.0), (1001.0, 5000.0)]   # two nodes slow at once: the second waits a window
    out = straggler_trial(eps, DAY, m, d, repair_s=86_400.0, evict=True)
    assert out["evictions"] == 2
    assert out["slowed_s"] == pytest.approx(60.0)   # slowed from 1000 s until the second eviction at 1060 s


def test_union():
    assert _union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]


def test_drain_costs_less_than_losing_half_a_base_interval():
    d = derive(params())
    p = PreemptionModel(persist_interval_min=30.0)
    assert preemption_cost_s(d, p, drain=True) < preemption_cost_s(d, p, drain=False)
    assert preemption_cost_s(d, p, drain=False) - preemption_cost_s(d, p, drain=True) == pytest.approx(
        900.0 - p.drain_fixed_s - d.storage_write_s)


@pytest.mark.parametrize("bad", [{"slowdown": 0.5}, {"rate_per_node_day": -1}, {"detect_s": float("nan")}])
def test_model_values_are_checked(bad):
    with pytest.raises(SimParamError, match="stragglers."):
        StragglerModel(**bad)


def test_deadpool_simulate_stragglers(capsys):
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    args = p.parse_args(["--stragglers", "--json", "--no-calibrate", "--trials", "2", "--horizon-days", "5",
                         "--set", "stragglers.slowdown=3", "--set", "preemption.rate_per_day=2"])
    assert command.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stragglers"]["slowdown"] == 3 and out["preemption"]["rate_per_day"] == 2
    assert out["stragglers"]["gained"] > 0 and out["preemption"]["gained"] > 0
    args = p.parse_args(["--stragglers", "--no-calibrate", "--set", "stragglers.nope=1"])
    assert command.run(args) == 2


def test_detection_is_calibrated_from_the_measured_straggler_benchmark(tmp_path):
    from deadpool_ext.sim.stragglers import calibrated

    m = StragglerModel(detect_s=30.0)
    assert calibrated(m, str(tmp_path)) == (m, m and calibrated(m, None)[1])   # no file: the default, said
    (tmp_path / "straggler.json").write_text(json.dumps({"summary": {"named_s": 3.5}, "args": {"window": 5.0}}))
    got, source = calibrated(m, str(tmp_path))
    assert got.detect_s == pytest.approx(21.0) and "straggler.json" in source
