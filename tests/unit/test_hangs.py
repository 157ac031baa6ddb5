"""The coordinator's hang-by-progress rule and heartbeat parsing (launcher/hangs.py), pure."""
from __future__ import annotations

from deadpool_ext.launcher.hangs import not_formed, parse_heartbeat, stalled


def beat(step=5, step_at=100.0, coll=False, still_s=0.0):
    return {"t": 200.0, "step": step, "step_at": step_at, "coll": coll, "still_s": still_s}


def test_the_rank_standing_still_outside_a_collective_is_the_hung_one():
    progress = {"a": beat(coll=True, still_s=20), "b": beat(coll=True, still_s=20), "c": beat(still_s=20)}
    failed, all_in = stalled(progress, {"a", "b", "c"}, now=120.0, limit_s=10)
    assert list(failed) == ["c"] and not all_in
    assert failed["c"].startswith("no progress: step 5") and "2 rank(s) wait" in failed["c"]


def test_no_verdict_while_steps_progress_or_before_the_first_step_or_when_off():
    progress = {"a": beat(coll=True, still_s=20), "c": beat(still_s=20)}
    assert stalled(progress, {"a", "c"}, now=105.0, limit_s=10) == ({}, False)      # a step 5 s ago
    assert stalled({**progress, "s": beat(step=-1)}, {"a", "c", "s"}, 120.0, 10) == ({}, False)  # a fresh spare
    assert stalled(progress, {"a", "c"}, 120.0, 0) == ({}, False)                   # off
    # the stuck rank still computing (its frames change): nothing to blame yet
    assert stalled({"a": beat(coll=True, still_s=20), "c": beat(still_s=1)}, {"a", "c"}, 120.0, 10) == ({}, False)


def test_everyone_inside_a_collective_is_left_to_the_collective_timeout():
    progress = {w: beat(coll=True, still_s=30) for w in "abc"}
    assert stalled(progress, set("abc"), 130.0, 10) == ({}, True)


def test_heartbeat_parsing():
    assert parse_heartbeat(b"123.5")["t"] == 123.5
    assert parse_heartbeat(b'{"t": 1, "step": 2, "step_at": 3, "coll": true, "still_s": 0.5}')["coll"] is True
    for bad in (b"x", b"[]", b'{"t": 1}', b'{"t": true, "step": 2, "step_at": 3, "coll": true, "still_s": 0}'):
        assert parse_heartbeat(bad) is None


def test_every_heartbeat_stale_at_once_is_a_store_stall_not_a_hang():
    from deadpool_ext.launcher.hangs import store_stalled

    now = 100.0
    assert store_stalled({"node0.0": 92.0, "node1.0": 92.5, "spare0.0": 92.4}, now, 6.0)   # nobody could write
    assert not store_stalled({"node0.0": 92.0, "node1.0": 99.5, "spare0.0": 99.6}, now, 6.0)  # node0 alone: a hang
    assert not store_stalled({"node0.0": 92.0}, now, 6.0)   # nothing to compare with: the plain rule
    assert not store_stalled({}, now, 6.0)


def test_a_generation_has_formed_once_every_rank_stepped_since_it_was_published():
    ranks = {"a": 0, "b": 1, "c": 2}   # an assignment's ranks: iterated for the worker ids
    progress = {"a": beat(step_at=101.0), "b": beat(step_at=99.0), "c": None}
    assert not_formed(ranks, progress, since=100.0) == ["b", "c"]   # b stepped before; c has no sample
    assert not_formed(ranks, {}, since=0.0) == []                    # no sample reads as step_at 0
    assert not_formed(ranks, {w: beat(step_at=100.0) for w in ranks}, since=100.0) == []
