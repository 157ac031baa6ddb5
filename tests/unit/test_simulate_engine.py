"""The simulator's discrete-event engine on hand-written failure traces (exact expectations, no sampling)."""
from __future__ import annotations

import pytest

from deadpool_ext.sim.costs import derive
from deadpool_ext.sim.engine import CATEGORIES, END, FAILURE, RECOVERY_DONE, REPAIR, EventQueue, Segment, run_trial
from deadpool_ext.sim.failures import Failure, FailureKind
from deadpool_ext.sim.params import Params
from deadpool_ext.sim.policies import Track, make_policy


def test_event_queue_orders_by_time_then_kind_then_insertion():
    q = EventQueue()
    q.push(5.0, END)
    q.push(5.0, FAILURE, "f1")
    q.push(5.0, RECOVERY_DONE, 1)
    q.push(5.0, REPAIR)
    q.push(1.0, FAILURE, "early")
    q.push(5.0, FAILURE, "f2")
    got = [(e.time_s, e.kind, e.payload) for e in (q.pop() for _ in range(len(q)))]
    assert got == [(1.0, FAILURE, "early"), (5.0, REPAIR, None), (5.0, RECOVERY_DONE, 1), (5.0, FAILURE, "f1"),
                   (5.0, FAILURE, "f2"), (5.0, END, None)]
    with pytest.raises(ValueError, match="unknown event kind"):
        q.push(1.0, "explode")
    with pytest.raises(ValueError, match="finite"):
        q.push(float("nan"), FAILURE)


def test_segment_maps_wall_time_to_iterations_and_versions():
    tracks = [Track("memory", 2, 0.5, 1.0, durable=False), Track("storage", 5, 3.0, 0.0, durable=True)]
    seg = Segment(100.0, 3, tracks, 10.0)       # starts after iteration 3
    # iteration 4 ends at 10 + 0.5 (memory version 4), 5 at 23.5 (+3 storage), 6 at 34.0 (+0.5)
    assert seg.wall(1) == pytest.approx(10.5) and seg.wall(2) == pytest.approx(23.5)
    assert seg.wall(3) == pytest.approx(34.0)
    assert seg.done(23.4) == 1 and seg.done(23.5) == 2 and seg.done(0.0) == 0
    assert seg.latest(tracks[0], 1, 11.0) is None       # version 4 commits at 10.5 + 1.0
    assert seg.latest(tracks[0], 1, 11.5) == 4
    assert seg.latest(tracks[1], 2, 23.5) == 5
    assert seg.latest(tracks[1], 1, 20.0) is None        # the carried version applies


def _params(**flat):
    base = {"cluster.gpus": 64, "cluster.spare_nodes": 2, "workload.iteration_s": 10.0, "workload.params_b": 1.0,
            "costs.detect_s": 5.0, "costs.scheduler_s": 20.0, "costs.startup_s": 10.0, "costs.hotswap_fixed_s": 3.0,
            "costs.hotswap_unready_s": 3.0,
            "costs.restore_fixed_s": 1.0, "costs.snapshot_overhead_ratio": 1.0, "costs.persist_overhead_ratio": 1.0,
            "failure.cluster_outage_per_day": 0.0}
    return Params().with_overrides({**base, **flat})


def _check_sums(res, horizon):
    assert sum(res.breakdown[c] for c in CATEGORIES) == pytest.approx(horizon, rel=1e-9)
    assert res.breakdown["useful"] == pytest.approx(res.iterations * 10.0)


def test_one_node_loss_hot_swap_loses_the_in_flight_iteration():
    d = derive(_params())
    policy = make_policy("deadpool", memory_interval=1, persist_interval=1000)
    res = run_trial(policy, d, [Failure(1005.0, FailureKind.NODE_LOST, 3)], 10_000.0)
    _check_sums(res, 10_000.0)
    assert res.restores == {"local": 0, "peer": 1, "storage": 0} and res.waits == 0
    # 100 iterations done at 1000 s, version 100 committed; 5 s of iteration 101 lost.
    assert res.breakdown["rework"] == pytest.approx(5.0)
    assert res.breakdown["detect"] == pytest.approx(5.0) and res.breakdown["restart"] == pytest.approx(3.0)
    assert res.breakdown["load"] == pytest.approx(1.0 + d.peer_fetch_s)


def test_restart_from_storage_rolls_back_to_the_last_complete_checkpoint():
    d = derive(_params())
    policy = make_policy("ckpt_sync", persist_interval=10)
    blocking = policy.tracks(d)[0].blocking_s
    # Iterations 1..10 end at 100 + blocking; the failure at 150 + blocking lands as iteration 15 ends.
    res = run_trial(policy, d, [Failure(150.0 + blocking, FailureKind.TRANSIENT, 0)], 5_000.0)
    _check_sums(res, 5_000.0)
    assert res.restores["storage"] == 1
    assert res.breakdown["rework"] == pytest.approx(50.0)       # iterations 11..15 recomputed
    assert res.breakdown["restart"] == pytest.approx(30.0)


def test_no_spare_left_waits_for_the_repaired_node():
    p = _params(**{"cluster.spare_nodes": 0, "cluster.node_repair_h": 1.0})
    d = derive(p)
    res = run_trial(make_policy("deadpool", memory_interval=1, persist_interval=1000), d,
                    [Failure(500.0, FailureKind.NODE_LOST, 1)], 20_000.0)
    _check_sums(res, 20_000.0)
    assert res.waits == 1 and res.breakdown["wait"] == pytest.approx(3600.0)


def test_losing_the_replica_holder_during_recovery_falls_back_to_storage():
    d = derive(_params())
    policy = make_policy("deadpool", memory_interval=1, persist_interval=50)
    # Node 3's state lives on node 4 (ring successor) until re-replicated; node 4 dies 1 s later.
    trace = [Failure(2000.5, FailureKind.NODE_LOST, 3), Failure(2001.5, FailureKind.NODE_LOST, 4)]
    res = run_trial(policy, d, trace, 10_000.0)
    _check_sums(res, 10_000.0)
    assert res.restores == {"local": 0, "peer": 0, "storage": 1}
    # Another node (not the holder) dying at the same moment keeps memory.
    trace = [Failure(2000.5, FailureKind.NODE_LOST, 3), Failure(2001.5, FailureKind.NODE_LOST, 10)]
    assert run_trial(policy, d, trace, 10_000.0).restores == {"local": 0, "peer": 1, "storage": 0}


def test_cluster_outage_restores_from_storage_and_transient_from_local_memory():
    d = derive(_params())
    gemini = make_policy("gemini", memory_interval=1, persist_interval=100)
    res = run_trial(gemini, d, [Failure(3000.5, FailureKind.TRANSIENT, 2), Failure(6000.5, FailureKind.CLUSTER, -1)],
                    20_000.0)
    _check_sums(res, 20_000.0)
    assert res.restores == {"local": 1, "peer": 0, "storage": 1}


def test_tiercheck_replays_differentials_since_the_base():
    d = derive(_params(**{"costs.replay_s_per_diff": 0.5}))
    res = run_trial(make_policy("tiercheck", base_interval=20), d, [Failure(355.0, FailureKind.NODE_LOST, 0)],
                    5_000.0)
    _check_sums(res, 5_000.0)
    # ~35 iterations done, base at 20: 15 differentials replayed.
    assert res.breakdown["replay"] == pytest.approx(15 * 0.5, abs=0.5)
    assert res.restores["peer"] == 1


def test_a_swap_costs_the_built_ahead_share_of_nodes_at_the_ready_price():
    """Each spare builds its engine for one node's ranks: a failure of one of those nodes costs the ready swap, any
    other the unready one, so the model charges the expectation over which node fails."""
    from dataclasses import replace

    d = replace(derive(_params()), hotswap_fixed_s=0.5, hotswap_unready_s=4.5)
    for spares, nodes, share in ((1, 4, 0.25), (2, 4, 0.5), (8, 4, 1.0), (0, 4, 0.0)):
        dd = replace(d, spares=spares, nodes=nodes)
        assert dd.built_ahead_fraction == share
        assert dd.hotswap_s == pytest.approx(share * 0.5 + (1 - share) * 4.5)
