"""Pure resharding logic (recovery/reshard.py), the shrink of an assignment, the global-batch rule: no processes."""
from __future__ import annotations

import random

import pytest

from deadpool_ext.cluster.assignment import Assignment
from deadpool_ext.cluster.membership import NoSpareError, shrink_failed
from deadpool_ext.recovery.reshard import (
    PartitionLayout,
    ReshardError,
    check_compatible,
    covered,
    needed_sources,
    overlaps,
    piece,
    segments,
    with_rank,
)


def _flat_layouts(numels: list[list[int]], dp: int, align: int = 4) -> list[PartitionLayout]:
    groups, part, pid = [], [], 0
    for g in numels:
        groups.append(tuple((pid + i, n) for i, n in enumerate(g)))
        pid += len(g)
        total = sum(g)
        unit = align * dp
        part.append(-(-total // unit) * unit // dp)
    base = PartitionLayout(rule="flat", dp=dp, dp_rank=0, groups=tuple(groups), part=tuple(part), model="m")
    return [with_rank(base, dp, r, base.part) for r in range(dp)]


def _per_param_layouts(numels: list[list[int]], dp: int) -> list[PartitionLayout]:
    groups, part, pid = [], [], 0
    for g in numels:
        groups.append(tuple((pid + i, n) for i, n in enumerate(g)))
        pid += len(g)
        part.append(sum(piece(n, dp) for n in g))
    base = PartitionLayout(rule="per_param", dp=dp, dp_rank=0, groups=tuple(groups), part=tuple(part), model="m")
    return [with_rank(base, dp, r, base.part) for r in range(dp)]


def _partitions(layouts: list[PartitionLayout], whole: dict[int, list[float]]) -> list[list[list[float]]]:
    """Each rank's flat partitions of ``whole`` (padding 0)."""
    out = []
    for lay in layouts:
        flats = [[0.0] * p for p in lay.part]
        for g, runs in enumerate(segments(lay)):
            for r in runs:
                flats[g][r.offset:r.offset + r.length] = whole[r.pid][r.start:r.start + r.length]
        out.append(flats)
    return out


def _reshard(olds, news, old_parts):
    new_parts = [[[None] * p for p in lay.part] for lay in news]
    for n, new in enumerate(news):
        for o, old in enumerate(olds):
            for c in overlaps(old, new):
                dst = new_parts[n][c.dst_group]
                for i in range(c.length):
                    assert dst[c.dst_offset + i] is None, "an element written twice"
                    dst[c.dst_offset + i] = old_parts[o][c.src_group][c.src_offset + i]
    return new_parts


@pytest.mark.parametrize("rule", ["flat", "per_param"])
@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (3, 2), (2, 4), (4, 3), (5, 1), (1, 3)])
def test_reshard_is_element_exact(rule, old_dp, new_dp):
    rng = random.Random(f"{rule}{old_dp}{new_dp}")
    numels = [[rng.randint(1, 40) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    make = _flat_layouts if rule == "flat" else _per_param_layouts
    olds, news = make(numels, old_dp), make(numels, new_dp)
    whole = {pid: [rng.random() for _ in range(n)] for pid, n in olds[0].params().items()}
    got = _reshard(olds, news, _partitions(olds, whole))
    want = _partitions(news, whole)
    for n, new in enumerate(news):
        assert sum(1 for g in got[n] for x in g if x is not None) == sum(covered(new))
        for g in range(len(new.part)):
            assert [0.0 if x is None else x for x in got[n][g]] == want[n][g]  # padding stays zero


def test_shrink_4_to_2_draws_each_new_rank_from_two_old_ranks():
    olds, news = _flat_layouts([[16, 16]], 4, align=1), _flat_layouts([[16, 16]], 2, align=1)
    assert [needed_sources(olds, n) for n in news] == [[0, 1], [2, 3]]


def test_layout_json_round_trip_and_strictness():
    lay = _per_param_layouts([[3, 5]], 2)[1]
    assert PartitionLayout.from_json(lay.to_json()) == lay
    bad = lay.to_json()
    for change in ({"rule": "rows"}, {"dp_rank": 2}, {"groups": [[[0, -1]]]}, {"extra": 1}, {"part": "x"}):
        with pytest.raises(ReshardError):
            PartitionLayout.from_json({**bad, **change})
    with pytest.raises(ReshardError):
        PartitionLayout.from_json(None)


def test_incompatible_layouts_are_refused():
    a = _flat_layouts([[4, 4]], 2)[0]
    with pytest.raises(ReshardError, match="another model"):
        check_compatible(a, PartitionLayout(**{**_as_kw(a), "model": "other"}))
    with pytest.raises(ReshardError, match="ZeRO stage"):
        check_compatible(a, _per_param_layouts([[4, 4]], 2)[0])
    with pytest.raises(ReshardError, match="parameters differ"):
        check_compatible(a, _flat_layouts([[4, 5]], 2)[0])


def _as_kw(lay: PartitionLayout) -> dict:
    return {k: getattr(lay, k) for k in ("rule", "dp", "dp_rank", "groups", "part", "model")}


def _assignment(nodes: dict[str, list[str]]) -> Assignment:
    ranks, where, r = {}, {}, 0
    for node, workers in nodes.items():
        for w in workers:
            ranks[w], where[w] = r, node
            r += 1
    return Assignment(generation=3, world_size=r, ranks=ranks, nodes=where)


def test_shrink_renumbers_survivors_in_order():
    a = _assignment({"n0": ["a", "b"], "n1": ["c", "d"], "n2": ["e", "f"]})
    s = shrink_failed(a, {"n1"})
    assert s.generation == 4 and s.world_size == 4 and s.shrunk == ("n1",)
    assert s.ranks == {"a": 0, "b": 1, "e": 2, "f": 3}
    assert Assignment.from_json(s.to_json()) == s
    assert "shrunk" not in a.to_json()  # an ordinary generation's JSON is unchanged
    with pytest.raises(NoSpareError, match="no node is left"):
        shrink_failed(a, {"n0", "n1", "n2"})


def test_global_batch_kept_or_refused():
    from deadpool_ext.integrations.deepspeed.batch import BatchChangeRefused, BatchShape, rescale

    first = BatchShape(global_batch=8, micro=2, accumulation=1, dp=4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {}}
    assert rescale(cfg, first, 4, False) is cfg
    assert rescale(cfg, first, 2, False) == {"zero_optimization": {}, "train_batch_size": 8,
                                             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(BatchChangeRefused, match="cannot keep the global batch 8 at data-parallel size 3"):
        rescale(cfg, first, 3, False)
    assert rescale(cfg, first, 3, True)["train_batch_size"] == 6


class _Store:
    def __init__(self, value=None, broken=False):
        self.value, self.broken = value, broken

    def get(self, key):  # the raw bytes the launcher's bounded decoder reads (launcher/values.py)
        import json

        assert key == "config/no_spare_policy"
        if self.broken:
            raise OSError("store down")
        return None if self.value is None else json.dumps(self.value).encode()


def test_launcher_policy_flag_then_config_key_then_fail():
    from deadpool_ext.launcher.coordinator import job_policy
    from deadpool_ext.launcher.decide import Observation, Settings, policy_of
    from deadpool_ext.launcher.values import StoreValues

    def policy(flag, store):   # what the coordinator observes (the job's key, read without the flag) and decides
        s = Settings(detect_timeout_s=6, progress_timeout_s=0, store_outage_s=60, spare_wait_s=0, nproc_per_node=1,
                     policy_flag=flag)
        return policy_of(s, Observation(now=0.0, job_policy=None if flag else job_policy(StoreValues(store))))

    assert policy("wait", _Store("shrink")) == "wait"       # the flag, given, wins
    assert policy(None, _Store("shrink")) == "shrink"       # else the job's deadpool.elastic.no_spare_policy
    assert policy(None, _Store(None)) == "fail"
    assert policy(None, _Store("grow")) == "fail"           # a foreign value from the store is not obeyed
    assert policy(None, _Store(broken=True)) == "fail"


def test_grow_appends_the_node_with_the_next_ranks():
    from deadpool_ext.cluster.assignment import Worker
    from deadpool_ext.cluster.membership import grow_into

    a = shrink_failed(_assignment({"n0": ["a", "b"], "n1": ["c", "d"]}), {"n1"})
    workers = [Worker("c", "n1", 0), Worker("d", "n1", 1)]
    g = grow_into(a, workers, "n1")
    assert g.world_size == 4 and g.ranks == {"a": 0, "b": 1, "c": 2, "d": 3} and g.grown == ("n1",) and g.resized
    assert not Assignment.from_json({**a.to_json(), "shrunk": []}).resized
    with pytest.raises(ValueError, match="already in generation"):
        grow_into(g, workers, "n1")


# -- replicated layouts (Megatron-Core without the distributed optimizer) -----------------------------------------
def test_replicated_layout_json_is_strict():
    from deadpool_ext.recovery.reshard import ReplicatedLayout, layout_from_json

    lay = ReplicatedLayout(dp=2, dp_rank=1, shard="tp1of2.pp0of1", model="abc")
    assert layout_from_json(lay.to_json()) == lay
    for bad in ({**lay.to_json(), "extra": 1}, {**lay.to_json(), "dp_rank": 2}, {**lay.to_json(), "shard": 3},
                {**lay.to_json(), "dp": True}, {k: v for k, v in lay.to_json().items() if k != "model"}):
        with pytest.raises(ReshardError):
            layout_from_json(bad)


def test_replica_moves_take_each_shard_whole_from_one_old_rank_preferring_its_own_copy():
    from deadpool_ext.recovery.reshard import ReplicatedLayout, replica_moves

    def rl(dp, d, shard, model="m"):
        return ReplicatedLayout(dp=dp, dp_rank=d, shard=shard, model=model)

    # TP2 x DP2 -> TP2 x DP1: old ranks 0,1 (replica 0) and 2,3 (replica 1); new ranks 0,1 serve copies of 0,1.
    old = {0: rl(2, 0, "t0"), 1: rl(2, 0, "t1"), 2: rl(2, 1, "t0"), 3: rl(2, 1, "t1")}
    new = [rl(1, 0, "t0"), rl(1, 0, "t1")]
    assert replica_moves(old, new, {0: 0, 1: 1, 2: 1, 3: 0}) == [(0, 0), (1, 1)]
    # where a new rank serves another copy of its shard, that one: nothing moves
    assert replica_moves(old, new, {0: 1, 1: 0, 2: 0, 3: 1}) == [(2, 0), (3, 1)]
    # grow: the new replica's ranks take the lowest old rank of their shard
    assert replica_moves({0: rl(1, 0, "t0"), 1: rl(1, 0, "t1")}, new + [rl(2, 1, "t0"), rl(2, 1, "t1")],
                         {0: 0, 1: 1}) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    with pytest.raises(ReshardError, match="no old rank holds shard t2"):
        replica_moves(old, [rl(1, 0, "t2")], {})
    with pytest.raises(ReshardError, match="another model"):
        replica_moves(old, [rl(1, 0, "t0", model="other")], {})
