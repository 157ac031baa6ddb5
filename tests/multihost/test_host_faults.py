"""Real hosts (network namespaces with their own address and /dev/shm), one deadpool-run per host, a 3-member etcd
cluster: whole hosts lost, the coordinator's host included, and the job continues with the losses of a run without
failure, bit for bit."""
from __future__ import annotations

import pytest

from tests.multihost.jobs import run_hosts

pytestmark = pytest.mark.slow

_baseline: dict[int, float] = {}


def baseline(host_bed, tmp_path) -> dict[int, float]:
    if not _baseline:
        bed = host_bed(3)
        res = run_hosts(bed, tmp_path, name="base")
        assert res.rcs == [0, 0, 0], res.tails()
        _baseline.update(res.metrics)
        bed.close()
    return _baseline


def test_coordinator_host_lost(host_bed, tmp_path):
    """Host 0 (the coordinator's, with node0 and spare0 on it) SIGKILLed whole: another launcher takes the
    coordinator role over when host 0's lease lapses, gives node0's ranks to the spare on host 1, and the job
    finishes with identical losses."""
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    res = run_hosts(bed, tmp_path, name="coord", fault=lambda b, _: b.kill_host(0))
    assert res.rcs[1:] == [0, 0], res.tails()
    assert res.metrics == base, res.tails()
    leaders = [e for e in res.events if e.get("event") == "leader"]
    assert [e["host_rank"] for e in leaders][0] == 0 and leaders[-1]["host_rank"] in (1, 2), leaders
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node0"}, assigned
    assert assigned[0]["replaced"]["node0"] == "spare1"   # spare0 was on host 0 too


def test_follower_host_lost(host_bed, tmp_path):
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    res = run_hosts(bed, tmp_path, name="follower", fault=lambda b, _: b.kill_host(2))
    assert res.rcs[:2] == [0, 0], res.tails()
    assert res.metrics == base, res.tails()
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node2"}, assigned
