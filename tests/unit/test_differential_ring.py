"""Pure logic of differential checkpoints: chains, the version every rank can rebuild, and the watermark GC
that never frees the newest recoverable version."""
import pytest

from deadpool_ext.snapshot.differential import DiffRing, GCError
from deadpool_ext.snapshot.plan import RankReport, RecoveryError, choose_version, reachable


def test_reachable_follows_unbroken_chains_from_the_newest_base():
    assert reachable({4: 10, 8: 10}, {5: 1, 6: 1, 7: 1, 9: 1, 11: 1}) == {4: 4, 5: 4, 6: 4, 7: 4, 8: 8, 9: 8}
    assert reachable({}, {1: 1, 2: 1}) == {}


def test_plan_replays_local_chain_and_fetches_a_peer_chain():
    r0 = RankReport(rank=0, local={4: 100}, local_diffs={5: 30, 6: 30}, replicas={1: {4: 101}},
                    replica_diffs={1: {5: 31, 6: 31}})
    r1 = RankReport(rank=1)  # lost its node's memory
    plan = choose_version([r0, r1])
    assert plan.version == 6 and plan.base == {0: 4, 1: 4}
    assert plan.fetch == {1: (0, 101)} and plan.fetch_diffs == {1: {5: 31, 6: 31}}
    assert plan.diffs(0) == [5, 6] and plan.replays


def test_a_missing_differential_on_one_rank_lowers_the_version_for_all():
    r0 = RankReport(rank=0, local={4: 1}, local_diffs={5: 1, 6: 1, 7: 1})
    r1 = RankReport(rank=1, local={4: 1}, local_diffs={5: 1, 7: 1})  # 6 corrupt: 7 unreachable
    plan = choose_version([r0, r1])
    assert plan.version == 5 and plan.diffs(1) == [5]


def test_a_full_snapshot_needs_no_replay():
    plan = choose_version([RankReport(rank=0, local={8: 1}, local_diffs={5: 1}), RankReport(rank=1, local={8: 1})])
    assert plan.version == 8 and not plan.replays and plan.diffs(0) == []


def test_no_common_version_is_an_error_naming_differentials():
    with pytest.raises(RecoveryError, match="differentials"):
        choose_version([RankReport(rank=0, local={4: 1}, local_diffs={5: 1}), RankReport(rank=1, local={8: 1})])


def test_ring_skips_base_versions():
    ring = DiffRing(4)
    assert ring.size == 3 and [ring.index(v) for v in (5, 6, 7, 9)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="always a base"):
        ring.index(8)


def test_gc_frees_a_differential_only_once_a_newer_base_is_committed_everywhere():
    ring = DiffRing(4)
    for v in (5, 6, 7):
        ring.check_reuse(v, committed_base=4)
        ring.stored(v)
    ring.check_reuse(9, committed_base=8)  # base 8 is on every rank: differential 5 may go
    with pytest.raises(GCError, match="still needed"):
        ring.check_reuse(9, committed_base=4)  # base 8 failed somewhere: 5..7 are the newest chain
    with pytest.raises(GCError):
        ring.check_reuse(10, committed_base=None)
