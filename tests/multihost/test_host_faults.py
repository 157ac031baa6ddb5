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
    res = run_hosts(bed, tmp_path, name="coord", fault=lambda b, _: b.kill_host(0), launch="hostfile")
    assert res.rcs[1:] == [0, 0], res.tails()
    for h in range(3):   # one command line everywhere; each launcher found its own line of the hostfile
        assert f"hostfile {tmp_path}/coord.hostfile: host {h} of 3 ({bed.addr(h)})" in res.log(h), res.log(h)[:2000]
    assert res.metrics == base, res.tails()
    leaders = [e for e in res.events if e.get("event") == "leader"]
    assert [e["host_rank"] for e in leaders][0] == 0 and leaders[-1]["host_rank"] in (1, 2), leaders
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node0"}, assigned
    assert assigned[0]["replaced"]["node0"] == "spare1"   # spare0 was on host 0 too


def test_follower_host_lost(host_bed, tmp_path):
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    res = run_hosts(bed, tmp_path, name="follower", fault=lambda b, _: b.kill_host(2), launch="slurm")
    assert res.rcs[:2] == [0, 0], res.tails()
    assert f"SLURM job follower: host 1 of 3 ({bed.addr(1)})" in res.log(1), res.log(1)[:2000]
    assert res.metrics == base, res.tails()
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node2"}, assigned


def _times(events, name):
    return [e["time"] for e in events if e.get("event") == name]


def test_follower_host_partitioned(host_bed, tmp_path):
    """Host 2's link cut (its processes alive): its launcher stops its workers before its lease can lapse, and
    only then does the coordinator give node2's ranks to a spare; healed afterwards, the host cannot rejoin."""
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)

    def partition(b, _timeline):
        b.cut(2)

    res = run_hosts(bed, tmp_path, name="part", fault=partition)
    bed.heal(2)
    assert res.rcs == [0, 0, 3], res.tails()
    assert "host 2 lost contact with the store" in res.log(2)
    assert res.metrics == base, res.tails()
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node2"}, assigned
    # no two processes ever trained as rank 2: host 2's workers were stopped before the spare got the rank
    assert _times(res.events, "self_fenced")[0] < assigned[0]["published_at"]


def test_coordinator_host_partitioned(host_bed, tmp_path):
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    res = run_hosts(bed, tmp_path, name="cpart", fault=lambda b, _: b.cut(0))
    bed.heal(0)
    assert res.rcs == [3, 0, 0], res.tails()
    assert res.metrics == base, res.tails()
    assigned = [e for e in res.events if e.get("event") == "assignment"]
    assert len(assigned) == 1 and set(assigned[0]["replaced"]) == {"node0"}, assigned
    assert _times(res.events, "self_fenced")[0] < assigned[0]["published_at"]
    assert [e["host_rank"] for e in res.events if e.get("event") == "leader"][-1] in (1, 2)


def test_etcd_member_lost(host_bed, tmp_path):
    """One of the three etcd members SIGKILLed mid-run: every client fails over to another member, nothing is
    detected as failed, and the losses are those of the run without failure."""
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    res = run_hosts(bed, tmp_path, name="etcd1", fault=lambda b, _: b.etcd.kill_member(0))
    assert res.rcs == [0, 0, 0], res.tails()
    assert res.metrics == base, res.tails()
    assert not [e for e in res.events if e.get("event") in ("failure", "assignment", "self_fenced")], res.events
