"""The simulator's no-spare behaviours (cluster.no_spare_policy fail / wait / shrink): exact expectations on
hand-written traces, then sampled traces. Pure: no processes, no torch."""
from __future__ import annotations

import argparse
import json

import pytest

from deadpool_ext.sim import elastic
from deadpool_ext.sim.costs import derive
from deadpool_ext.sim.engine import CATEGORIES, run_trial
from deadpool_ext.sim.failures import Failure, FailureKind
from deadpool_ext.sim.params import Params, SimParamError
from deadpool_ext.sim.policies import make_policy
from deadpool_ext.sim.report import text_report
from deadpool_ext.sim.sweep import Evaluator

IT = 10.0
HORIZON = 20_000.0


def _params(**flat):
    """8 nodes of 8 GPUs, 10 s iterations, no snapshot interference: wall time = iterations x 10 s."""
    base = {"cluster.gpus": 64, "cluster.spare_nodes": 0, "cluster.node_repair_h": 1.0, "workload.iteration_s": IT,
            "workload.params_b": 1.0, "costs.detect_s": 5.0, "costs.scheduler_s": 20.0, "costs.startup_s": 10.0,
            "costs.hotswap_fixed_s": 3.0, "costs.hotswap_unready_s": 3.0,
            "costs.restore_fixed_s": 1.0, "costs.snapshot_overhead_ratio": 1.0,
            "costs.persist_overhead_ratio": 1.0, "failure.cluster_outage_per_day": 0.0}
    return Params().with_overrides({**base, **flat})


def _check_sums(res, horizon=HORIZON):
    assert sum(res.breakdown[c] for c in CATEGORIES) == pytest.approx(horizon, rel=1e-9)
    assert res.breakdown["useful"] == pytest.approx(res.iterations * IT)


DEADPOOL = make_policy("deadpool", memory_interval=1, persist_interval=30)
LOSS = [Failure(1005.0, FailureKind.NODE_LOST, 3)]  # 100 iterations done, 5 s into the 101st


# -- parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flat, match", [
    ({"cluster.no_spare_policy": "grow"},
     r"^cluster\.no_spare_policy: must be one of fail, wait, shrink, got 'grow'$"),
    ({"cluster.no_spare_policy": 1}, r"^cluster\.no_spare_policy: must be one of fail, wait, shrink, got 1$"),
    ({"cluster.shrink_unit_nodes": 3}, r"cluster\.shrink_unit_nodes: must divide the 8 nodes into at least 2"),
    ({"cluster.shrink_unit_nodes": 8}, r"cluster\.shrink_unit_nodes: must divide the 8 nodes into at least 2"),
    ({"cluster.shrink_unit_nodes": 0}, r"cluster\.shrink_unit_nodes: must be >= 1"),
])
def test_bad_no_spare_values_are_rejected_naming_the_key(flat, match):
    with pytest.raises(SimParamError, match=match):
        _params(**flat)
    with pytest.raises(SimParamError, match=match):
        Params.from_dict({"cluster": {"gpus": 64, **{k.split(".")[1]: v for k, v in flat.items()}}})


def test_default_is_wait_and_values_round_trip():
    assert Params().cluster.no_spare_policy == "wait" and Params().cluster.shrink_unit_nodes == 1
    p = _params(**{"cluster.no_spare_policy": "shrink", "cluster.shrink_unit_nodes": 4})
    assert Params.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    d = derive(p)
    assert (d.no_spare_policy, d.shrink_unit_nodes, elastic.replicas(d)) == ("shrink", 4, 2)


# -- one node lost, no spare: the three behaviours, exactly ----------------------------------------------
def test_fail_stops_the_job_at_the_newest_persistent_version():
    d = derive(_params(**{"cluster.no_spare_policy": "fail"}))
    res = run_trial(DEADPOOL, d, LOSS + [Failure(3000.0, FailureKind.NODE_LOST, 5)], HORIZON)
    _check_sums(res)
    # Storage has version 90 (every 30 iterations); iterations 91..100 and the partial one are lost.
    assert res.iterations == 90 and res.breakdown["rework"] == pytest.approx(105.0)
    assert res.stopped_s == 1005.0 and res.breakdown["stopped"] == pytest.approx(HORIZON - 1005.0)
    assert res.failures == 1  # nothing happens to a stopped job
    assert res.capacity == pytest.approx(1005.0 / HORIZON) and res.goodput <= res.capacity
    assert res.restores == {"local": 0, "peer": 0, "storage": 0} and res.waits == 0


def test_wait_loses_the_repair_time():
    d = derive(_params())
    res = run_trial(DEADPOOL, d, LOSS, HORIZON)
    _check_sums(res)
    assert res.waits == 1 and res.breakdown["wait"] == pytest.approx(3600.0)
    assert res.stopped_s is None and res.shrinks == 0 and res.capacity == 1.0


def test_shrink_runs_at_the_reduced_rate_until_the_repaired_node_returns():
    d = derive(_params(**{"cluster.no_spare_policy": "shrink"}))
    res = run_trial(DEADPOOL, d, LOSS, HORIZON)
    _check_sums(res)
    assert (res.shrinks, res.grows, res.waits, res.stopped_s) == (1, 1, 0, None)
    # Shrink: detect + survivors' process restart (not the 3 s hot-swap rebuild) + reshard onto 7 of 8 nodes.
    reshard7 = 1.0 + d.peer_fetch_s * 8 / 7
    assert elastic.reshard_s(d, 7) == pytest.approx(reshard7)
    shrunk_from = 1005.0 + 5.0 + 10.0 + reshard7
    slow = IT * 8 / 7
    grow_at = 1005.0 + 3600.0
    n_slow = int((grow_at - shrunk_from) / slow)
    # Grow at the repair: restart + live state to host + reshard onto 8 nodes; the iteration in flight is redone.
    grow_cost = 10.0 + d.d2h_s + 1.0 + d.peer_fetch_s
    n_full = int((HORIZON - grow_at - grow_cost) / IT)
    assert res.iterations == 100 + n_slow + n_full
    assert res.breakdown["detect"] == pytest.approx(5.0) and res.breakdown["restart"] == pytest.approx(20.0)
    assert res.breakdown["load"] == pytest.approx(reshard7 + d.d2h_s + 1.0 + d.peer_fetch_s)
    assert res.breakdown["shrunk"] == pytest.approx(n_slow * (slow - IT))
    assert res.breakdown["rework"] == pytest.approx(5.0 + (grow_at - shrunk_from) - n_slow * slow)
    assert res.breakdown["wait"] == 0.0
    # One of 8 replicas out for 3,600 s; goodput cannot exceed the live fraction.
    assert res.capacity == pytest.approx(1.0 - 3600.0 / 8 / HORIZON)
    assert res.goodput <= res.capacity
    assert res.restores == {"local": 0, "peer": 1, "storage": 0}  # the grow is not a restore
    wait = run_trial(DEADPOOL, derive(_params()), LOSS, HORIZON)
    assert res.goodput > wait.goodput + 0.15


def test_shrink_ignores_failures_of_slots_out_of_the_job():
    d = derive(_params(**{"cluster.no_spare_policy": "shrink"}))
    res = run_trial(DEADPOOL, d, LOSS + [Failure(2000.0, FailureKind.NODE_LOST, 3)], HORIZON)
    _check_sums(res)
    assert res.failures == 1 and res.shrinks == 1


def test_shrink_of_a_multi_node_replica_frees_its_healthy_nodes_as_spares():
    # 4 nodes per replica: losing node 3 idles replica 0 (nodes 0-3); its 3 healthy nodes hot-swap the next
    # losses elsewhere, and failures of nodes 0-3 no longer touch the job.
    d = derive(_params(**{"cluster.no_spare_policy": "shrink", "cluster.shrink_unit_nodes": 4,
                          "cluster.node_repair_h": 100.0}))
    trace = LOSS + [Failure(3000.0, FailureKind.NODE_LOST, 6), Failure(4000.0, FailureKind.NODE_LOST, 1)]
    res = run_trial(DEADPOOL, d, trace, HORIZON)
    _check_sums(res)
    assert (res.shrinks, res.grows, res.failures) == (1, 0, 2)
    assert res.restores["peer"] == 2
    assert res.capacity == pytest.approx(1.0 - (HORIZON - 1005.0) / 2 / HORIZON)
    assert res.breakdown["restart"] == pytest.approx(10.0 + 3.0)  # the shrink, then a hot-swap


def test_shrink_keeps_one_replica_and_then_waits():
    d = derive(_params(**{"cluster.gpus": 16, "cluster.no_spare_policy": "shrink"}))  # 2 nodes
    trace = [Failure(1005.0, FailureKind.NODE_LOST, 0), Failure(2005.0, FailureKind.NODE_LOST, 1)]
    res = run_trial(DEADPOOL, d, trace, HORIZON)
    _check_sums(res)
    assert res.shrinks == 1 and res.waits == 1 and res.grows == 1


def test_shrink_keeps_a_whole_job_restart_priced_as_the_policy_prices_it():
    d = derive(_params(**{"cluster.no_spare_policy": "shrink"}))
    res = run_trial(make_policy("ckpt_sync", persist_interval=30), d, LOSS, HORIZON)
    _check_sums(res)
    # The failure's restart (scheduler + start-up) already restarts every process; the grow costs a start-up.
    assert res.breakdown["restart"] == pytest.approx(30.0 + 10.0)
    assert res.breakdown["load"] == pytest.approx(d.storage_read_s + d.d2h_s + 1.0 + d.peer_fetch_s)


def test_shrink_plan_prices():
    d = derive(_params())
    hot = DEADPOOL.restore(d, FailureKind.NODE_LOST, {"memory": 10, "storage": 0}, True)
    s = elastic.shrink(hot, d, 7)
    assert s.version == 10 and s.source == "peer" and s.phases["detect"] == d.detect_s
    assert s.phases["restart"] == d.startup_s and s.phases["load"] == pytest.approx(elastic.reshard_s(d, 7))
    lost = DEADPOOL.restore(d, FailureKind.NODE_LOST, {"memory": 10, "storage": 0}, False)
    assert elastic.shrink(lost, d, 7).phases == {**lost.phases, "restart": d.restart_s}  # storage: as it was
    assert elastic.iteration_s(d, 4) == pytest.approx(2 * IT)


# -- sampled traces --------------------------------------------------------------------------------------
def _toy(**flat) -> Params:
    """64 nodes, a node lost every ~1.5 h, repairs in 3 h, 4 simulated days."""
    base = {"cluster.gpus": 512, "workload.params_b": 70.0, "workload.iteration_s": 5.0,
            "failure.rate_per_gpu_hour": 1.3e-3, "failure.node_lost_fraction": 1.0, "cluster.node_repair_h": 3.0,
            "failure.cluster_outage_per_day": 0.0, "sim.trials": 6, "sim.horizon_days": 4.0}
    return Params().with_overrides({**base, **flat})


def _evaluate(policy_name, **flat):
    return Evaluator(_toy(**flat)).evaluate(make_policy(policy_name, memory_interval=1, persist_interval=100))


def test_enough_spares_make_the_three_behaviours_identical():
    for name in ("deadpool", "gemini"):
        runs = {ns: _evaluate(name, **{"cluster.spare_nodes": 1000, "cluster.no_spare_policy": ns}).to_dict()
                for ns in ("fail", "wait", "shrink")}
        assert runs["fail"] == runs["wait"] == runs["shrink"]
        assert runs["wait"]["shrinks_mean"] == 0 and runs["wait"]["stopped_share"] == 0


def test_no_spares_fail_ends_wait_loses_repairs_shrink_keeps_most_goodput():
    s = {ns: _evaluate("deadpool", **{"cluster.spare_nodes": 0, "cluster.no_spare_policy": ns})
         for ns in ("fail", "wait", "shrink")}
    assert s["fail"].stopped_share == 1.0 and s["fail"].stopped_day_mean < 0.5
    assert s["fail"].goodput_mean < 0.1 and s["fail"].breakdown["stopped"] > 0.9
    assert s["wait"].breakdown["wait"] > 0.5 and s["wait"].goodput_mean < 0.5
    assert s["shrink"].breakdown["wait"] == 0 and s["shrink"].shrinks_mean > 20
    assert s["shrink"].goodput_mean > 0.8 > s["wait"].goodput_mean > s["fail"].goodput_mean
    # Bounded by the live fraction (below 1 here: about 2 of 64 nodes are under repair at a time).
    assert s["shrink"].capacity_mean < 0.99
    assert s["shrink"].goodput_mean <= s["shrink"].capacity_mean
    assert s["shrink"].breakdown["shrunk"] > 0.01


def test_shrink_goodput_never_exceeds_the_live_fraction_per_trial():
    ev = Evaluator(_toy(**{"cluster.spare_nodes": 2, "cluster.no_spare_policy": "shrink",
                           "cluster.shrink_unit_nodes": 4}))
    for trace in ev.traces:
        res = run_trial(DEADPOOL, ev.d, trace, ev.horizon_s)
        assert sum(res.breakdown[c] for c in CATEGORIES) == pytest.approx(ev.horizon_s, rel=1e-9)
        assert res.shrinks > 0 and res.goodput <= res.capacity < 1.0


# -- command ---------------------------------------------------------------------------------------------
def _cli(argv):
    from deadpool_ext.commands import simulate

    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    return simulate.run(p.parse_args(argv))


def test_command_takes_the_no_spare_policy(capsys):
    argv = ["--gpus", "512", "--trials", "2", "--horizon-days", "1", "--no-calibrate", "--policies", "deadpool",
            "--spare-nodes", "0", "--set", "failure.cluster_outage_per_day=0",
            "--set", "failure.rate_per_gpu_hour=1e-3"]
    assert _cli([*argv, "--no-spare-policy", "shrink", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["cluster"]["no_spare_policy"] == "shrink"
    assert out["policies"]["deadpool"]["shrinks_mean"] > 0
    text = text_report(out)  # what the command prints without --json (test_simulate: bad values refused)
    assert "no spare left: shrink" in text and "shrunk (fewer replicas)" in text
