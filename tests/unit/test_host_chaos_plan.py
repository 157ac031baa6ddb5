"""The host-level chaos planner (chaos/hostfaults.py) is pure and covers every fault in 6 consecutive trials."""
from __future__ import annotations

import pytest

from deadpool_ext.chaos.hostfaults import HOST_FAULTS, HostFault, plan_host_trial


def test_plan_is_deterministic_and_covers_every_fault():
    a = [plan_host_trial(3, t) for t in range(12)]
    assert a == [plan_host_trial(3, t) for t in range(12)]
    for start in (0, 5):
        assert {s.fault for s in a[start:start + len(HOST_FAULTS)]} == set(HOST_FAULTS)
    assert {s.layout for s in a} == {"zero1", "zero2", "zero3", "megatron"}


def test_victims_are_valid_for_their_fault():
    for t in range(60):
        s = plan_host_trial(1, t)
        if s.fault is HostFault.HOST_LOSS:
            assert s.host in (1, 2) and (s.layout != "megatron" or s.host == 1)   # megatron: 2 nodes, hosts 0, 1
        elif s.fault is HostFault.COORDINATOR_LOSS:
            assert s.host == 0
        elif s.fault is HostFault.STUCK:
            assert 0 <= s.rank < (4 if s.layout == "megatron" else 3)
        elif s.fault in (HostFault.ETCD_MEMBER, HostFault.ETCD_QUORUM):
            assert 0 <= s.member < 3 and s.expect_swaps == 0
        assert 3 <= s.step <= s.iters - 3
        assert s.reproduce().startswith(f"deadpool chaos --bed --seed 1 --trial {t}")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layouts on the bed"):
        plan_host_trial(0, 0, ["zero4"])
    with pytest.raises(ValueError, match="seed"):
        plan_host_trial(-1, 0)
    assert plan_host_trial(0, 4, faults=["stuck"]).fault is HostFault.STUCK
