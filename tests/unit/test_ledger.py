"""``recovery.ledger``: where a job's seconds went, on synthetic timelines (no processes). The seconds lost by cause
are ``deadpool timeline``'s phases, and lost plus productive seconds add up to the wall time."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadpool_ext.recovery.ledger import (
    CAUSES,
    failure_cause,
    format_ledger,
    free_parts,
    ledger,
    restore_tier,
    spares_available,
    uncovered,
)
from deadpool_ext.recovery.timeline import phases

T0 = 1000.0


def _start(spares=("spare0",)) -> dict:
    return {"event": "start", "time": T0, "generation": 0, "spare_nodes": list(spares), "active_nodes": ["node0"]}


def _swap(gen: int, fault: float, *, why: str = "exited with signal 9", restored_from: str = "peer",
          caught: bool = True, spare_s: float = 0.05) -> list[dict]:
    """One hot-swap into generation ``gen``: fault, detection 0.9 s later, assignment, spare, groups, engine,
    restore, recompute (durations 0.9, 0.1, spare_s, 0.25, 0.3, 0.5, 1.0)."""
    detected, assigned = fault + 0.9, fault + 1.0
    join = assigned + spare_s
    pg = join + 0.25
    ev = [{"event": "fault", "time": fault, "generation": gen - 1},
          {"event": "failure", "generation": gen - 1, "detected_at": detected, "time": detected,
           "failed": {"node1.0": {"rank": 1, "node": "node1", "why": why}}},
          {"event": "assignment", "generation": gen, "time": assigned, "replaced": {"node1": f"spare{gen - 1}"},
           "spares_left": []},
          {"event": "recover", "role": "survivor", "generation": gen, "pid": 7, "restored_version": 3,
           "pg_ready_at": pg, "engine_ready_at": pg + 0.3, "restored_at": pg + 0.8, "time": pg + 0.8},
          {"event": "recover", "role": "spare", "generation": gen, "rank": 1, "pid": 9, "restored_version": 3,
           "restored_from": restored_from, "join_at": join, "pg_ready_at": pg, "restored_at": pg + 0.8,
           "built_ahead": True, "time": pg + 0.8}]
    if caught:
        ev.append({"event": "caught_up", "generation": gen, "rank": 0, "step": 4, "time": pg + 1.8})
    return ev


def _snap(at: float, rank: int = 0, **kw) -> dict:
    return {"event": "snapshot", "time": at + 0.2, "rank": rank, "step_at": at, "version": 1, "blocking_s": 0.02,
            "nbytes": 1000, "commit_lag_s": 0.2, "committed": 1, **kw}


def _first(at: float) -> dict:
    return {"event": "first_step", "time": at, "step": 1}


def _balanced(led) -> bool:
    return math.isclose(led.productive_s + sum(led.lost_s.values()), led.wall_s, rel_tol=1e-9, abs_tol=1e-9)


def test_a_job_without_failure_is_all_productive_after_its_start_up():
    ev = [_start(), _first(T0 + 8.0), _first(T0 + 8.1), _snap(T0 + 7.9), {"event": "finished", "time": T0 + 20.0}]
    led = ledger(ev, now=T0 + 99)
    assert led.ended and led.wall_s == pytest.approx(20.0) and led.lost_s["startup"] == pytest.approx(8.0)
    assert led.productive_s == pytest.approx(12.0) and led.goodput == pytest.approx(0.6) and _balanced(led)
    assert set(led.lost_s) == set(CAUSES) and led.recoveries == {}


def test_a_hot_swap_is_booked_phase_by_phase_as_deadpool_timeline_shows_it():
    ev = [_start(), _first(T0 + 5.0), *_swap(1, T0 + 10.0), {"event": "finished", "time": T0 + 30.0}]
    led = ledger(ev, now=T0 + 99)
    [row] = phases(ev)
    lost = led.lost_s
    assert lost["detect"] == pytest.approx(row["detect_s"])
    assert lost["spare_wait"] == pytest.approx(row["spare_s"])
    assert lost["communicators"] == pytest.approx(row["agree_s"] - row["spare_s"])
    for cause in ("rebuild", "restore", "recompute"):
        assert lost[cause] == pytest.approx(row[f"{cause}_s"]), cause
    recovery = sum(lost[c] for c in ("detect", "spare_wait", "communicators", "rebuild", "restore", "recompute"))
    assert recovery == pytest.approx(row["total_s"]) and lost["other"] == pytest.approx(0.0)
    assert led.productive_s == pytest.approx(30.0 - 5.0 - row["total_s"]) and _balanced(led)
    assert led.recoveries == {("crash", "tier2"): 1}


def test_a_recovery_under_way_counts_up_to_now_in_the_phase_it_is_in():
    ev = [_start(), *_swap(1, T0 + 10.0, caught=False)]
    led = ledger(ev, now=T0 + 20.0)
    assert not led.ended and led.wall_s == pytest.approx(20.0)
    assert led.lost_s["recompute"] == pytest.approx(20.0 - 10.0 - 2.1)   # restored at +2.1 s, not caught up yet
    assert led.recoveries == {} and _balanced(led)                        # counted once it caught up


def test_a_failure_during_a_recovery_is_not_counted_twice():
    first = [e for e in _swap(1, T0 + 10.0) if e["event"] != "caught_up"]
    ev = [_start(("spare0", "spare1")), *first, *_swap(2, T0 + 11.5, why="hung: no heartbeat for 3.1s"),
          {"event": "finished", "time": T0 + 40.0}]
    led = ledger(ev, now=T0 + 99)
    rows = phases(ev)
    assert len(rows) == 2 and _balanced(led)
    assert sum(led.lost_s.values()) == pytest.approx(rows[1]["total_s"] + 1.5)  # the first runs until the second
    assert led.recoveries == {("hang", "tier2"): 1}


def test_waiting_for_a_machine_to_join_as_a_spare_is_spare_wait():
    ev = [_start(()), {"event": "fault", "time": T0 + 10.0, "generation": 0},
          {"event": "failure", "generation": 0, "detected_at": T0 + 10.5, "time": T0 + 10.5,
           "failed": {"node1.0": {"rank": 1, "node": "node1", "why": "exited with code 1"}}},
          {"event": "joined", "node": "late", "role": "spare", "generation": 0, "time": T0 + 30.0},
          {"event": "assignment", "generation": 1, "time": T0 + 30.1, "replaced": {"node1": "late"},
           "spares_left": []},
          {"event": "recover", "role": "survivor", "generation": 1, "pid": 7, "pg_ready_at": T0 + 40.0,
           "engine_ready_at": T0 + 40.0, "restored_at": T0 + 40.5, "restored_version": 3},
          {"event": "recover", "role": "spare", "generation": 1, "pid": 9, "rank": 1, "join_at": T0 + 39.0,
           "pg_ready_at": T0 + 40.0, "restored_at": T0 + 40.5, "restored_from": "peer", "restored_version": 3},
          {"event": "caught_up", "generation": 1, "rank": 0, "time": T0 + 41.0},
          {"event": "finished", "time": T0 + 50.0}]
    led = ledger(ev, now=T0 + 99)
    assert led.lost_s["spare_wait"] == pytest.approx(19.6 + 8.9)   # no spare until one joined, then its build
    assert led.lost_s["communicators"] == pytest.approx(1.0) and _balanced(led)


def test_a_stopped_job_ends_its_wall_time_at_the_stop():
    ev = [_start(()), {"event": "fault", "time": T0 + 10.0, "generation": 0},
          {"event": "failure", "generation": 0, "detected_at": T0 + 10.4, "time": T0 + 10.4,
           "failed": {"node1.0": {"rank": 1, "node": "node1", "why": "exited with signal 9"}}},
          {"event": "stopped", "time": T0 + 11.0, "reason": "no spare"}]
    led = ledger(ev, now=T0 + 99)
    assert led.ended and led.wall_s == pytest.approx(11.0) and led.lost_s["detect"] == pytest.approx(0.4)
    assert sum(led.lost_s.values()) == pytest.approx(1.0) and _balanced(led)


def test_straggler_and_preemption_seconds_come_from_their_events_and_never_overlap_a_recovery():
    ev = [_start(), *_swap(1, T0 + 10.0),
          {"event": "straggler", "time": T0 + 13.0, "rank": 2, "lost_s": 4.0},   # 9..13: overlaps the swap 10..13.1
          {"event": "drain", "time": T0 + 28.6, "requested_at": T0 + 28.5, "by": "SIGTERM", "host_rank": 0,
           "source": "launcher"},
          {"event": "drained", "time": T0 + 30.5, "step": 40, "source": "worker"},    # a worker's: not the end
          {"event": "drained", "time": T0 + 31.0, "status": 75, "source": "launcher"}]
    led = ledger(ev, now=T0 + 99)
    assert led.ended and led.wall_s == pytest.approx(31.0)
    assert led.lost_s["straggler"] == pytest.approx(1.0) and led.lost_s["preemption"] == pytest.approx(2.5)
    assert led.stragglers_named == 1 and _balanced(led)


def test_versions_quarantined_are_counted_once_whatever_the_ranks():
    ev = [_start()] + [{"event": "canary_rollback", "rank": r, "version": 6, "quarantined": [6], "time": T0 + 5}
                       for r in (0, 1)] + \
        [{"event": "canary_stop", "rank": r, "version": 5, "time": T0 + 6} for r in (0, 1)]
    assert ledger(ev, now=T0 + 10).versions_quarantined == 2


def test_the_shutdown_after_the_last_loop_ended_is_lost():
    ev = [_start(), {"event": "trained", "time": T0 + 18.0, "rank": 0}, {"event": "trained", "time": T0 + 18.5},
          {"event": "finished", "time": T0 + 20.0}]
    led = ledger(ev, now=T0 + 99)
    assert led.lost_s["shutdown"] == pytest.approx(1.5) and _balanced(led)


def test_before_the_launcher_started_there_is_nothing():
    led = ledger([], now=T0)
    assert led.start is None and led.wall_s == 0 and led.goodput == 1.0
    assert format_ledger(led).startswith("ledger: no start event")


def test_snapshot_figures_take_each_ranks_newest_event():
    ev = [_start(), _snap(T0 + 1), _snap(T0 + 1, rank=1, blocking_s=0.05), _snap(T0 + 2, version=2, committed=2,
                                                                               commit_lag_s=0.4, nbytes=1200)]
    snap = ledger(ev, now=T0 + 3).snapshot
    assert snap.blocking_s == 0.05 and snap.nbytes == 2200 and snap.commit_lag_s == 0.4 and snap.committed == 1


def test_spares_available_follow_assignments_joins_and_losses():
    ev = [_start(("spare0", "spare1")),
          {"event": "assignment", "generation": 1, "spares_left": ["spare1"]},
          {"event": "joined", "node": "late", "role": "spare"},
          {"event": "spare_lost", "node": "spare1"}]
    assert spares_available(ev[:1]) == 2 and spares_available(ev[:2]) == 1 and spares_available(ev) == 1


@pytest.mark.parametrize("why,label", [("exited with signal 9", "crash"), ("host 1 lost (its launcher's lease",
                                                                             "host_lost"),
                                       ("hung: no heartbeat for 3.0s", "hang"), ("no progress: step 4", "stall"),
                                       ("something new", "other")])
def test_failure_causes(why, label):
    assert failure_cause(why) == label


def test_restore_tiers():
    assert restore_tier([{"restored_from": "local"}, {}]) == "tier1"
    assert restore_tier([{"restored_from": "local"}, {"restored_from": "peer"}]) == "tier2"
    assert restore_tier([{"restored_from": "resharded"}]) == "resharded"


def test_uncovered_and_free_parts():
    assert uncovered(0, 10, [(1, 3), (2, 4), (8, 12)]) == pytest.approx(5.0)
    assert free_parts(0, 10, [(1, 3), (2, 4), (8, 12)]) == [(0, 1), (4, 8)]


@st.composite
def _timelines(draw):
    """Any sequence of hot-swaps: overlapping or not, caught up or not, phases missing, losses from events."""
    ev, t, gen = [_start(("s0", "s1", "s2"))], T0 + draw(st.floats(0, 5)), 0
    if draw(st.booleans()):
        ev.append(_first(T0 + draw(st.floats(0, 20))))
    for _ in range(draw(st.integers(0, 4))):
        gen += 1
        swap = _swap(gen, t, caught=draw(st.booleans()), spare_s=draw(st.floats(0, 5)))
        drop = draw(st.sets(st.sampled_from(["survivor", "spare", "assignment"]), max_size=2))  # not written yet
        ev += [e for e in swap if e.get("role", e["event"]) not in drop]
        t += draw(st.floats(0.1, 10))
    for name in ("straggler", "drain", "trained"):
        if draw(st.booleans()):
            ev.append({"event": name, "time": T0 + draw(st.floats(0, 40)), "lost_s": draw(st.floats(0, 10))})
    if draw(st.booleans()):
        ev.append({"event": "finished", "time": t + draw(st.floats(0, 5))})
    return ev, t + draw(st.floats(0, 10))


@settings(max_examples=300, deadline=None)
@given(_timelines())
def test_lost_plus_productive_is_the_wall_time_whatever_the_timeline(case):
    events, now = case
    led = ledger(events, now)
    assert all(v >= -1e-9 for v in led.lost_s.values()), led.lost_s
    assert led.productive_s >= -1e-9 and _balanced(led), (led.productive_s, led.lost_s, led.wall_s)
