"""A spare's life as one state machine (``rebuild/spare.py``: :class:`SpareLife`, :data:`NEXT`): its transitions,
what each call of the spare path moves it to, and how ``deadpool timeline`` prints it (pure and in-process; the
whole life under deadpool-run is asserted in tests/integration/test_hot_swap.py)."""
from __future__ import annotations

import json

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment, replace_failed
from deadpool_ext.launcher import contract
from deadpool_ext.rebuild.fastpaths import FastPaths
from deadpool_ext.rebuild.spare import (
    NEXT,
    SpareState,
    SpareStateError,
    assigned,
    build_ahead,
    joined,
    life,
    refusal,
)
from deadpool_ext.recovery.timeline import read_events, spare_lines

S = SpareState


@pytest.fixture
def timeline(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(contract.TIMELINE, str(path))
    contract.reset_worker_env()
    yield path
    contract.reset_worker_env()


def _reachable(start: SpareState) -> set[SpareState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in NEXT[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_starting_and_only_joined_and_failed_end_a_life():
    assert _reachable(S.STARTING) == set(S)
    assert {s for s in S if not NEXT[s]} == {S.JOINED, S.FAILED}
    for s in S:
        assert S.JOINED in _reachable(s) or not NEXT[s] or s is S.FAILED  # every live state can still join


def test_a_transition_not_listed_is_refused_naming_what_is_allowed():
    assert refusal(S.WAITING, S.JOINING) is None
    assert refusal(S.JOINED, S.WAITING) == ("a spare in state 'joined' cannot go to 'waiting' (allowed: none: it is "
                                            "an end)")
    assert refusal(S.STARTING, S.JOINED) == ("a spare in state 'starting' cannot go to 'joined' (allowed: building, "
                                             "building_ahead, waiting)")
    with pytest.raises(SpareStateError, match="spare spare0.0: .*'starting' cannot go to 'joining'.*because test"):
        life().to(S.JOINING, "spare0.0", "test")
    assert life().state is S.STARTING and life().path == ["starting"]


def test_each_transition_is_a_timeline_event_and_the_timeline_prints_the_path(timeline):
    lf = life()
    for state, why in ((S.BUILDING_AHEAD, "it builds for node1's rank 1 of 3"), (S.WAITING, "its engine is built"),
                       (S.JOINING, "assigned rank 2 in generation 1, taken by a relabel from rank 1"),
                       (S.JOINED, "rank 2's state restored (step 3)")):
        lf.to(state, "spare0.0", why)
    assert lf.path == ["starting", "building_ahead", "waiting", "joining", "joined"]
    events = read_events(str(timeline))
    assert [(e["event"], e["previous"], e["state"]) for e in events] == [
        ("spare_state", "starting", "building_ahead"), ("spare_state", "building_ahead", "waiting"),
        ("spare_state", "waiting", "joining"), ("spare_state", "joining", "joined")]
    [line] = spare_lines(events)
    assert line.startswith("spare spare0.0: starting -> building_ahead (+0.0 s) -> waiting (+")
    assert line.endswith("-> joined (+0.0 s); rank 2's state restored (step 3)")


def test_a_spare_started_again_shows_both_processes_in_one_path():
    t = 100.0
    events = [{"event": "spare_state", "worker": "spare0.0", "previous": p, "state": s, "why": w, "time": t + i}
              for i, (p, s, w) in enumerate([("starting", "building_ahead", "a"), ("building_ahead", "waiting", "b"),
                                             ("waiting", "building", "starts again: pipeline stage"),
                                             ("starting", "building", "assigned already"),
                                             ("building", "joined", "restored")])]
    [line] = spare_lines(json.loads(json.dumps(events)))
    assert line == ("spare spare0.0: starting -> building_ahead (+0.0 s) -> waiting (+1.0 s) -> building (+2.0 s) "
                    "-> | starting -> building (+3.0 s) -> joined (+4.0 s); restored")


def test_a_spare_that_cannot_build_ahead_waits_then_builds_for_its_assignment_then_joins():
    """The plain path (``hot_swap.spare_build_ahead: false``): ``build_ahead`` says ``waiting``, the assignment read
    before the script (``distributed.init_distributed``) moves it to ``building``, its restore to ``joined``."""
    off = FastPaths(True, False, "hot_swap.spare_build_ahead is false in ds.json")
    assert not build_ahead(None, "spare0.0", "spare0", 60.0, fast=off)  # type: ignore[arg-type]
    assert life().state is S.WAITING
    workers = [Worker("node0.0", "node0", 0), Worker("node1.0", "node1", 0), Worker("spare0.0", "spare0", 0)]
    a = replace_failed(initial_assignment(workers, ["node0", "node1"], ["spare0"]), workers, {"node0"})
    assigned("spare0.0", a)
    assigned("spare0.0", a)  # a formation retried: no second transition
    joined("spare0.0", 0, 3)
    assert life().path == ["starting", "waiting", "building", "joined"]
    joined("spare0.0", 0, 3)  # the end: nothing more
    assert life().state is S.JOINED


class _Waiting:
    """The membership of a spare waiting for its assignment: ``join`` hands the next generation at once."""

    worker_id = "spare0.0"

    def __init__(self, a):
        self.a = a

    def join(self, generation, timeout_s=None, while_waiting=None):
        assert generation == self.a.generation
        return self.a


def _assigned_after(failed: str):
    workers = [Worker(f"node{i}.0", f"node{i}", 0) for i in range(3)] + [Worker("spare0.0", "spare0", 0)]
    return replace_failed(initial_assignment(workers, ["node0", "node1", "node2"], ["spare0"]), workers, {failed})


@pytest.mark.parametrize("failed, blocker, path", [
    ("node1", "anything", ["joining"]),                        # the node it built for: as built, whatever blocks
    ("node2", "pipeline parallelism (each stage holds other layers)", ["building"]),  # another stage: again
])
def test_a_spare_built_ahead_waits_in_the_frameworks_call_then_joins_or_starts_again(monkeypatch, timeline, failed,
                                                                                        blocker, path):
    """``await_assignment`` (the end of ``deepspeed.initialize`` / ``MegatronRuntime``): ``waiting`` with its engine,
    then ``joining`` in place, or ``building`` and the process started again (its new life begins at ``starting``
    and finds itself assigned: ``building``, then ``joined`` at its restore)."""
    from deadpool_ext.rebuild import spare
    from deadpool_ext.rebuild.context import context

    again = []
    monkeypatch.setattr(spare, "start_again", lambda: again.append(True))
    monkeypatch.setattr(context(), "membership", _Waiting(_assigned_after(failed)))
    monkeypatch.setattr(context(), "pending_live", None)
    life().to(S.BUILDING_AHEAD, "spare0.0", "test")
    life().built = spare.BuiltAhead(rank=1, world_size=3, generation=0, node="node1", timeout_s=60.0)
    spare.await_assignment(spare.Relabel(why_not=blocker, apply=lambda rank: None))
    assert life().path == ["starting", "building_ahead", "waiting", *path]
    assert again == ([True] if path == ["building"] else [])
    assert (context().pending_live is not None) == (path == ["joining"])
    events = [e for e in read_events(str(timeline)) if e["event"] == "spare_state"]
    assert events[-1]["why"].startswith("assigned rank")
