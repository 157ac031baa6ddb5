"""The restore planner of the memory tiers (snapshot/plan.py): which version, which copies, from where, for a
restore at the same size and an elastic one. Pure: plain reports and census entries, no processes."""
from __future__ import annotations

import pytest

from deadpool_ext.recovery.reshard import PartitionLayout, ReplicatedLayout
from deadpool_ext.snapshot.plan import (
    ElasticPlan,
    Fresh,
    KeepBase,
    NoCommonVersionError,
    RankReport,
    RecoveryError,
    RestorePlanner,
    SameSizePlan,
    choose_copies,
    plan_elastic,
    plan_same_size,
)

# -- same size ----------------------------------------------------------------------------------------------


def test_nothing_in_memory_is_a_fresh_start():
    assert plan_same_size([RankReport(rank=0), RankReport(rank=1)], None) == Fresh()


def test_every_rank_from_its_own_slot():
    reports = [RankReport(rank=0, local={4: 100, 5: 100}), RankReport(rank=1, local={4: 100, 5: 100})]
    got = plan_same_size(reports, None)
    assert isinstance(got, SameSizePlan) and got.version == 5 and got.plan.fetch == {}


def test_a_lost_rank_fetches_from_its_holder_and_the_version_is_the_newest_common_one():
    reports = [RankReport(rank=0, local={5: 100, 6: 100}, replicas={1: {5: 90}}), RankReport(rank=1)]
    got = plan_same_size(reports, None)
    assert isinstance(got, SameSizePlan) and got.version == 5 and got.plan.fetch == {1: (0, 90)}


def test_nothing_newer_than_the_tier3_base_keeps_the_base():
    reports = [RankReport(rank=0, local={6: 100}), RankReport(rank=1, local={6: 100})]
    assert plan_same_size(reports, 6) == KeepBase(version=6, tier3_base=6, world=2)
    assert isinstance(plan_same_size(reports, 5), SameSizePlan)


def test_state_without_a_common_version_is_refused_naming_what_each_rank_has():
    with pytest.raises(NoCommonVersionError, match="rank 1: own \\[3\\]"):
        plan_same_size([RankReport(rank=0, local={4: 1}), RankReport(rank=1, local={3: 1})], None)


# -- elastic ------------------------------------------------------------------------------------------------


def _flat(dp: int, dp_rank: int, numel: int = 64) -> PartitionLayout:
    return PartitionLayout(rule="flat", dp=dp, dp_rank=dp_rank, groups=(((0, numel),),), part=(numel // dp,),
                           model="m")


def _copy(fname: str, rank: int, world: int, version: int, tier: int = 1) -> dict:
    return {"file": fname, "tier": tier, "rank": rank, "world": world, "version": version, "nbytes": 1000,
            "layout": _flat(world, rank).to_json()}


def _census_of_two_nodes(version: int = 8) -> list[list[dict]]:
    """A world of 2 ranks, one per node; each node also holds the other rank's replica."""
    return [[_copy("deadpool.j.snap.r0.0", 0, 2, version), _copy("deadpool.j.replica.r1.h0b0", 1, 2, version, 2)],
            [_copy("deadpool.j.snap.r1.0", 1, 2, version), _copy("deadpool.j.replica.r0.h1b0", 0, 2, version, 2)]]


def test_shrink_to_one_rank_draws_both_old_ranks_from_their_slots():
    census = [_census_of_two_nodes()[0]]  # node 1 lost with its directory: the new world is one rank on node 0
    got = plan_elastic(census, set(), world_new=1, new_layout=_flat(1, 0).to_json(), news_replicated=None,
                       newer_than=None)
    assert isinstance(got, ElasticPlan) and not got.replicated
    assert (got.version, got.world_old, got.world_new) == (8, 2, 1)
    assert got.moves == [(0, 0), (1, 0)]
    assert {r: (p, b["tier"]) for r, (p, b) in got.providers.items()} == {0: (0, 1), 1: (0, 2)}
    assert got.news[0].part == (64,) and got.tiers() == [1, 2]


def test_a_tier1_slot_is_preferred_to_a_replica_then_the_lowest_provider():
    world, version, providers = choose_copies(_census_of_two_nodes(), set())
    assert (world, version) == (2, 8)
    assert {r: (p, b["tier"]) for r, (p, b) in providers.items()} == {0: (0, 1), 1: (1, 1)}


def test_a_refused_copy_is_replaced_by_the_next_one():
    census = _census_of_two_nodes()
    three = PartitionLayout(rule="flat", dp=3, dp_rank=0, groups=(((0, 64),),), part=(22,), model="m")
    got = plan_elastic(census, {(1, "deadpool.j.snap.r1.0")}, world_new=3, new_layout=three.to_json(),
                       news_replicated=None, newer_than=None)
    assert isinstance(got, ElasticPlan)
    assert got.providers[1][0] == 0 and got.providers[1][1]["tier"] == 2  # rank 1's replica on node 0


def test_every_copy_of_the_newest_version_refused_falls_back_to_an_older_complete_version():
    census = [c + [_copy(f"old{i}", i, 2, 4)] for i, c in enumerate(_census_of_two_nodes())]
    refused = {(0, "deadpool.j.snap.r0.0"), (1, "deadpool.j.replica.r0.h1b0")}
    world, version, _ = choose_copies(census, refused)
    assert (world, version) == (2, 4)


def test_the_same_world_is_the_same_size_plan_and_an_empty_memory_is_none():
    census = _census_of_two_nodes()
    assert plan_elastic(census, set(), world_new=2, new_layout=_flat(2, 0).to_json(), news_replicated=None,
                        newer_than=None) is None
    assert plan_elastic([[], []], set(), world_new=2, new_layout=_flat(2, 0).to_json(), news_replicated=None,
                        newer_than=None) is None


def test_elastic_keeps_a_tier3_base_that_is_not_older():
    got = plan_elastic([_census_of_two_nodes()[0]], set(), world_new=1, new_layout=_flat(1, 0).to_json(),
                       news_replicated=None, newer_than=8)
    assert got == KeepBase(version=8, tier3_base=8, world=2)


def test_an_engine_that_cannot_reshard_is_refused_with_its_reason():
    with pytest.raises(RecoveryError, match="taken by a world of 2 ranks, this one has 1.*\\(no layout here\\)"):
        plan_elastic([_census_of_two_nodes()[0]], set(), world_new=1, new_layout=None, news_replicated=None,
                     newer_than=None, why_no_layout="no layout here")


def test_another_model_cannot_be_resharded():
    other = PartitionLayout(rule="flat", dp=1, dp_rank=0, groups=(((0, 64),),), part=(64,), model="other")
    with pytest.raises(RecoveryError, match="cannot reshard step 8 from 2 to 1 ranks"):
        plan_elastic([_census_of_two_nodes()[0]], set(), world_new=1, new_layout=other.to_json(),
                     news_replicated=None, newer_than=None)


def test_a_replicated_layout_takes_one_old_copy_whole_preferring_its_own():
    def rep(dp: int, r: int, shard: str) -> ReplicatedLayout:
        return ReplicatedLayout(dp=dp, dp_rank=r, shard=shard, model="m")

    # old world of 4: tp=2 x dp=2 (ranks 0,1 shard a/b on node 0; ranks 2,3 on node 1); new world of 2 (dp=1)
    shards = ["a", "b", "a", "b"]
    census = [[{"file": f"s{r}", "tier": 1, "rank": r, "world": 4, "version": 3, "nbytes": 10,
                "layout": rep(2, r // 2, shards[r]).to_json()} for r in (0, 1)],
              [{"file": f"s{r}", "tier": 1, "rank": r, "world": 4, "version": 3, "nbytes": 10,
                "layout": rep(2, r // 2, shards[r]).to_json()} for r in (2, 3)]]
    news = [rep(1, 0, "a"), rep(1, 0, "b")]
    got = plan_elastic(census, set(), world_new=2, new_layout=news[0].to_json(), news_replicated=news,
                       newer_than=None)
    assert isinstance(got, ElasticPlan) and got.replicated
    assert got.moves == [(0, 0), (3, 1)]  # new rank 1 serves old rank 3's copy itself: nothing moves for it


def test_the_planner_plans_elastic_only_when_shrinking_is_allowed():
    census = [_census_of_two_nodes()[0]]
    off = RestorePlanner(world=1, new_layout=_flat(1, 0).to_json())
    on = RestorePlanner(world=1, elastic_allowed=True, new_layout=_flat(1, 0).to_json())
    assert off.elastic(census, set()) is None
    assert isinstance(on.elastic(census, set()), ElasticPlan)
    assert on.same_size([RankReport(rank=0)]) == Fresh()
