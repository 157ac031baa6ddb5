"""The restore planner's same-size rule (snapshot/plan.py choose_version): the newest version every rank can obtain,
and who fetches what."""
import pytest

from deadpool_ext.snapshot.plan import RankReport, RecoveryError, choose_version


def rep(rank, local=(), replicas=None):
    return RankReport(rank=rank, local={v: 100 for v in local}, replicas=replicas or {})


def test_fresh_start():
    assert choose_version([rep(0), rep(1)]) is None


def test_newest_common_version():
    plan = choose_version([rep(0, (4, 5)), rep(1, (4,))])
    assert plan.version == 4 and plan.fetch == {}


def test_lost_rank_fetches_from_holder():
    plan = choose_version([rep(0, (6, 7), {1: {7: 123, 6: 120}}), rep(1)])
    assert plan.version == 7 and plan.fetch == {1: (0, 123)}


def test_replica_older_than_locals_rolls_everyone_back():
    # rank 1's memory is gone; its replica holds 6, rank 0 has 6 and 7 -> everyone restores 6
    plan = choose_version([rep(0, (6, 7), {1: {6: 50}}), rep(1)])
    assert plan.version == 6 and plan.fetch == {1: (0, 50)}


def test_state_but_no_common_version_is_an_error():
    with pytest.raises(RecoveryError) as err:
        choose_version([rep(0, (5,)), rep(1)])
    assert "rank 1: own none" in str(err.value)


def test_reports_must_cover_world():
    with pytest.raises(ValueError):
        choose_version([rep(0), rep(2)])


def test_older_replica_used_when_survivor_lacks_newest():
    # rank 0's newest local copy was torn (only 6 left); rank 1 is lost, its holder has 6 and 7
    plan = choose_version([rep(0, (6,), {1: {6: 10, 7: 11}}), rep(1)])
    assert plan.version == 6 and plan.fetch == {1: (0, 10)}
