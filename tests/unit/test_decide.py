"""The coordinator's rules (``deadpool_ext/launcher/decide.py``), turn by turn, without processes or a store: each
test builds observations, calls ``decide`` and feeds the state it returns into the next turn, as the launcher's
loop does."""
from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment, shrink_failed
from deadpool_ext.launcher import decide as d
from deadpool_ext.launcher import values
from deadpool_ext.launcher.actions import (
    AnswerJoin,
    BadKey,
    ClearRepaired,
    Event,
    Fence,
    Finish,
    Log,
    MarkRepaired,
    NoteDropped,
    Publish,
    Say,
    SetSpares,
    Stop,
    WriteDeadSpares,
)
from deadpool_ext.launcher.decide import (
    AwaitSpare,
    CoordinatorState,
    JoinRequest,
    Observation,
    Roster,
    Settings,
    decide,
    taken_over,
)
from deadpool_ext.launcher.done import work_done

T0 = 1000.0
DETECT = 6.0


def settings(**kw) -> Settings:
    base = dict(detect_timeout_s=DETECT, progress_timeout_s=30.0, store_outage_s=120.0, spare_wait_s=60.0,
                nproc_per_node=1, policy_flag="fail")
    return Settings(**{**base, **kw})


def job(nnodes: int = 2, spares: int = 1, nproc: int = 1, hosts: int = 1) -> CoordinatorState:
    active = tuple(f"node{i}" for i in range(nnodes))
    spare = tuple(f"spare{i}" for i in range(spares))
    workers = tuple(Worker(f"{n}.{i}", n, i) for n in active + spare for i in range(nproc))
    host = {n: i % hosts for i, n in enumerate(active)} | {n: j % hosts for j, n in enumerate(spare)}
    roster = Roster(workers=workers, active_nodes=active, spare_nodes=spare, node_host=host)
    return CoordinatorState(assignment=initial_assignment(list(workers), list(active), list(spare)), roster=roster,
                            last_turn=T0)


def beat(t: float, step: int = 3, step_at: float | None = None, coll: bool = False, still_s: float = 0.0):
    return {"t": t, "step": step, "step_at": t if step_at is None else step_at, "coll": coll, "still_s": still_s}


def beats_of(state: CoordinatorState, t: float, **kw) -> dict:
    return {w.worker_id: beat(t, **kw) for w in state.roster.workers}


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def events(actions, name: str) -> list[dict]:
    return [dict(a.fields) for a in actions if isinstance(a, Event) and a.fields["event"] == name]


# -- completion and fatal reports ------------------------------------------------------------------------------------
def test_every_active_worker_done_or_exited_zero_finishes_the_job():
    st = job()
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node0.0": 0}, done=frozenset({"node1.0"})), settings())
    assert dec.exit_code == 0 and of(dec.actions, Finish) == [Finish(0)]
    assert events(dec.actions, "finished") == [{"event": "finished", "generation": 0}]
    # a spare's exit does not count: the active ranks decide
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node0.0": 0, "spare0.0": 0}), settings())
    assert dec.exit_code is None


def test_a_fatal_report_stops_the_job_and_says_why():
    dec = decide(job(), Observation(now=T0 + 0.1, fatal="replica of rank 1 lost"), settings())
    assert dec.exit_code == 1
    [stop] = of(dec.actions, Stop)
    assert stop.reason == "replica of rank 1 lost" and stop.assignment is None
    assert stop.said == "stopping the job, a worker reports unrecoverable state:\nreplica of rank 1 lost"


# -- detection -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rc,why", [(1, "exited with code 1"), (-9, "exited with signal 9"),
                                    (137, "exited with code 137")])
def test_a_crash_fences_the_node_and_a_spare_takes_its_ranks(rc, why):
    st = job()
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": rc}), settings())
    assert dec.exit_code is None
    [failure] = events(dec.actions, "failure")
    assert failure["failed"] == {"node1.0": {"rank": 1, "node": "node1", "why": why}}
    assert failure["detected_at"] == T0 + 0.1
    assert of(dec.actions, Fence) == [Fence("node1", drop_memory=True)]
    [pub] = of(dec.actions, Publish)
    new = pub.assignment
    assert new.generation == 1 and new.replaced == {"node1": "spare0"} and new.ranks["spare0.0"] == 1
    assert new.master_port == 0 and new.master_addr == "127.0.0.1"
    assert pub.event == {"event": "assignment", "generation": 1, "replaced": {"node1": "spare0"}, "spares_left": [],
                         "built_ahead": {"node1": False}, "host_rank": 0, "shrunk": [], "world_size": 2}
    assert dec.state.assignment == new and dec.state.formed_after == T0 + 0.1
    # the fence comes before the publish: no two processes ever hold rank 1
    kinds = [type(a).__name__ for a in dec.actions]
    assert kinds.index("Fence") < kinds.index("Publish")


def test_keep_memory_on_failure_fences_without_dropping_memory():
    dec = decide(job(), Observation(now=T0 + 0.1, exits={"node0.0": 1}), settings(keep_memory_on_failure=True))
    assert of(dec.actions, Fence) == [Fence("node0", drop_memory=False)]


def test_a_silent_heartbeat_is_a_hang_after_the_detection_timeout():
    st = job()
    st = decide(st, Observation(now=T0 + 0.1, beats=beats_of(st, T0)), settings()).state
    assert st.seen_hb == {"node0.0": T0, "node1.0": T0}
    # node1 goes silent, node0 and the spare beat on
    now = T0 + 0.1
    for _ in range(11):   # turns 0.5 s apart (a later one would be a stalled store's)
        now += 0.5
        dec = decide(st, Observation(now=now, beats={"node0.0": beat(now), "spare0.0": beat(now),
                                                     "node1.0": beat(T0)}), settings())
        assert not of(dec.actions, Publish)
        st = dec.state
    now += 0.5   # 6.1 s since node1's last beat
    dec = decide(st, Observation(now=now, beats={"node0.0": beat(now), "spare0.0": beat(now), "node1.0": beat(T0)}),
                 settings())
    [failure] = events(dec.actions, "failure")
    assert failure["failed"]["node1.0"]["why"] == "hung: no heartbeat for 6.1s (SIGKILLed to fence it)"
    # node1's record is gone; the new generation's ranks (the spare, the survivor) get a grace for their first beat
    assert dec.state.seen_hb == {} and dec.state.progress == {}


def test_a_worker_without_a_first_heartbeat_is_not_judged_by_age():
    st = job()
    dec = decide(st, Observation(now=T0 + 0.5), settings())
    dec = decide(dec.state, Observation(now=T0 + 0.9), settings())
    assert not of(dec.actions, Publish) and dec.state.seen_hb == {}


def test_a_late_turn_grants_a_grace_period_before_heartbeats_count():
    st = job()
    st = decide(st, Observation(now=T0 + 0.1, beats=beats_of(st, T0)), settings()).state
    late = T0 + 0.1 + 8.0   # the store stalled: this turn comes 8 s late, every beat is old
    dec = decide(st, Observation(now=late, beats={"node0.0": beat(T0), "node1.0": beat(T0)}), settings())
    assert not of(dec.actions, Publish)
    assert dec.state.grace_until == late + DETECT
    [line] = [a for a in of(dec.actions, Log) if a.level == logging.INFO]
    assert "8.0s since its last turn (store slow)" in line.text
    # still stale once the grace is over (turns on pace again): a hang after all
    st = dataclasses.replace(dec.state, last_turn=late + DETECT)
    dec = decide(st, Observation(now=late + DETECT + 0.05, beats={"node0.0": beat(late + DETECT),
                                                                         "node1.0": beat(T0)}), settings())
    assert list(events(dec.actions, "failure")[0]["failed"]) == ["node1.0"]


def test_every_heartbeat_stale_at_once_spares_included_is_a_store_stall_said_once():
    st = job()
    st = decide(st, Observation(now=T0 + 0.1, beats=beats_of(st, T0)), settings()).state
    stale = beats_of(st, T0)
    logs = []
    now = T0 + 0.1
    for _ in range(3):   # the coordinator's turns keep their pace; nobody's writes reach the store
        now += 0.1 if not logs else 0.5
        now = max(now, T0 + DETECT + 0.5)
        dec = decide(st, Observation(now=now, beats=stale), settings())
        assert not of(dec.actions, Publish), dec.actions
        logs += [a.text for a in of(dec.actions, Log) if a.level == logging.WARNING]
        st = dec.state
    assert len(logs) == 1 and "the spares' too: the store took no worker's writes (not a hang)" in logs[0]
    # the store answers again: one worker beats, the other stays silent past the grace: that one is hung
    now = st.grace_until + 0.1
    st = dataclasses.replace(st, last_turn=now - 0.1)
    dec = decide(st, Observation(now=now, beats={"node0.0": beat(now), "spare0.0": beat(now), "node1.0": beat(T0)}),
                 settings())
    assert list(events(dec.actions, "failure")[0]["failed"]) == ["node1.0"]
    assert dec.state.stall_logged is False


def test_a_store_stall_longer_than_the_outage_limit_is_judged_as_hangs():
    st = job()
    st = decide(st, Observation(now=T0 + 0.1, beats=beats_of(st, T0)), settings(store_outage_s=10.0)).state
    st = dataclasses.replace(st, last_turn=T0 + 10.9)
    dec = decide(st, Observation(now=T0 + 11.0, beats=beats_of(st, T0)), settings(store_outage_s=10.0))
    assert sorted(events(dec.actions, "failure")[0]["failed"]) == ["node0.0", "node1.0"]


def test_a_rank_standing_still_outside_a_collective_while_others_wait_is_hung_by_progress():
    st = job(nnodes=3, spares=1)
    now = T0 + 100.0
    st = dataclasses.replace(st, last_turn=now - 0.1)
    beats = {"node0.0": beat(now, step=5, step_at=now - 40, coll=True),
             "node1.0": beat(now, step=5, step_at=now - 40, coll=False, still_s=35.0),
             "node2.0": beat(now, step=5, step_at=now - 40, coll=True), "spare0.0": beat(now)}
    dec = decide(st, Observation(now=now, beats=beats), settings())
    [failure] = events(dec.actions, "failure")
    assert list(failure["failed"]) == ["node1.0"] and failure["failed"]["node1.0"]["why"].startswith("no progress")
    # every rank in a collective: nobody can be singled out, said once
    coll = {w: beat(now, step=5, step_at=now - 40, coll=True) for w in ("node0.0", "node1.0", "node2.0")}
    said = []
    for i in range(3):
        dec = decide(st, Observation(now=now + 0.1 * i, beats=coll), settings())
        assert not of(dec.actions, Publish)
        said += of(dec.actions, Log)
        st = dec.state
    assert len(said) == 1 and "every rank is inside a collective" in said[0].text


def test_a_host_whose_lease_lapsed_fails_its_ranks_and_its_spares():
    st = job(nnodes=2, spares=2, hosts=2)   # host 0: node0, spare0; host 1: node1, spare1
    dec = decide(st, Observation(now=T0 + 0.1, hosts_seen=frozenset({0, 1}), hosts_now=frozenset({0})),
                 settings(leased=True))
    failure = events(dec.actions, "failure")[0]["failed"]
    assert failure == {"node1.0": {"rank": 1, "node": "node1", "why": "host 1 lost (its launcher's lease lapsed)"}}
    assert events(dec.actions, "spare_lost") == [{"event": "spare_lost", "node": "spare1", "detail": "host 1 lost"}]
    assert of(dec.actions, WriteDeadSpares) == [WriteDeadSpares(("spare1",))]
    assert of(dec.actions, Publish)[0].assignment.replaced == {"node1": "spare0"}
    # without leases (the embedded store: one launcher for good) nobody's lease is read
    dec = decide(st, Observation(now=T0 + 0.1, hosts_seen=frozenset({0, 1}), hosts_now=frozenset({0})), settings())
    assert dec.actions == ()


def test_a_dead_spare_is_fenced_once_and_never_chosen():
    st = job(nnodes=2, spares=2)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"spare0.0": 1}), settings())
    assert of(dec.actions, Fence) == [Fence("spare0", drop_memory=False)]
    assert events(dec.actions, "spare_lost")[0]["detail"] == "exited with 1"
    assert [a.level for a in of(dec.actions, Log)] == [logging.WARNING]   # not only an INFO event (issue 43, part 5)
    assert of(dec.actions, WriteDeadSpares) == []   # no successor coordinator to tell (no leases)
    st = dec.state
    assert st.dead_spares == {"spare0"}
    dec = decide(st, Observation(now=T0 + 0.2, exits={"spare0.0": 1}), settings())
    assert dec.actions == ()   # said once
    dec = decide(dec.state, Observation(now=T0 + 0.3, exits={"spare0.0": 1, "node0.0": -9}), settings())
    assert of(dec.actions, Publish)[0].assignment.replaced == {"node0": "spare1"}


# -- a survivor's report of a failed collective (suspect/) ------------------------------------------------------------
SUSPECT = 1.0


def report(t: float, gen: int = 0) -> values.Report:
    return values.Report(gen, t, "RuntimeError: [gloo] Connection closed by peer [10.200.0.3]:40123")


def three_nodes_beating(now: float, **kw) -> CoordinatorState:
    """Three nodes and a spare, every worker heard at ``now`` (and the coordinator's turn then)."""
    st = job(nnodes=3, spares=1)
    return decide(dataclasses.replace(st, last_turn=now - 0.1), Observation(now=now, beats=beats_of(st, now)),
                  settings(**kw)).state


LIVE = ("node0.0", "node1.0", "spare0.0")


def test_a_report_then_silence_fails_the_quiet_peer_after_the_suspect_age_not_the_detection_timeout():
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start, suspect_age_s=SUSPECT)
    # node2's host is lost just after: node0 and node1 fail their collective and report; they and the spare beat on
    reports = {"node0.0": report(start + 0.05), "node1.0": report(start + 0.07)}
    suspects, failure, now = [], None, start
    for i in range(1, 8):   # turns 0.3 s apart
        now = start + 0.3 * i
        dec = decide(st, Observation(now=now, beats={**{w: beat(now) for w in LIVE}, "node2.0": beat(start)},
                                     reports=reports), s)
        st = dec.state
        suspects += events(dec.actions, "suspect")
        if events(dec.actions, "failure"):
            [failure] = events(dec.actions, "failure")
            break
    # each report is recorded once, when first read
    assert [(e["reporter"], e["rank"], e["reported_at"], e["heard_at"]) for e in suspects] == [
        ("node0.0", 0, start + 0.05, start + 0.3), ("node1.0", 1, start + 0.07, start + 0.3)]
    # node2 is failed on the first turn its heartbeat has been unheard for more than the suspect age (1.2 s, not 6 s)
    assert failure is not None and now == start + 1.2 and failure["detected_at"] == now
    assert failure["failed"] == {"node2.0": {"rank": 2, "node": "node2", "why": (
        "hung: no heartbeat for 1.2s after rank 0 (node0.0) reported a failed collective (SIGKILLed to fence it)")}}
    # the fence as for any failure, before the next generation: the spare takes rank 2
    kinds = [type(a).__name__ for a in dec.actions]
    assert of(dec.actions, Fence) == [Fence("node2", drop_memory=True)]
    assert kinds.index("Fence") < kinds.index("Publish")
    [pub] = of(dec.actions, Publish)
    assert pub.assignment.replaced == {"node2": "spare0"} and pub.assignment.ranks["spare0.0"] == 2
    assert dec.state.reports_heard == {}   # the next generation starts without reports

    # node2 was alive after all (a starved host): it beats again, and reports too. It holds no rank of generation
    # 1, its report is of a generation that is over, and nothing gives rank 2 back: the spare keeps it
    for j in range(1, 4):
        t = now + 0.3 * j
        dec = decide(st, Observation(now=t, beats={w: beat(t) for w in (*LIVE, "node2.0")},
                                     reports={**reports, "node2.0": report(t)}), s)
        assert not of(dec.actions, Publish) and not events(dec.actions, "failure") and not of(dec.actions, Fence)
        assert not events(dec.actions, "suspect")
        st = dec.state
    assert "node2.0" not in st.assignment.ranks and st.assignment.ranks["spare0.0"] == 2
    assert sorted(st.assignment.ranks.values()) == [0, 1, 2]   # no two workers hold one rank


@pytest.mark.parametrize("suspect_age_s", [SUSPECT, 0.0])
def test_a_report_never_fails_a_peer_whose_heartbeat_is_fresh(suspect_age_s):
    """A flapping or lying reporter cannot evict a healthy peer: every worker beats on, nothing is failed."""
    s = settings(suspect_age_s=suspect_age_s)
    start = T0 + 0.1
    st = three_nodes_beating(start, suspect_age_s=suspect_age_s)
    said = 0
    for i in range(1, 40):   # 12 s of turns, twice the detection timeout, with a new report on every turn
        now = start + 0.3 * i
        dec = decide(st, Observation(now=now, beats=beats_of(st, now - 0.4),
                                     reports={"node0.0": report(now)}), s)
        assert not events(dec.actions, "failure") and not of(dec.actions, Fence), dec.actions
        said += len(events(dec.actions, "suspect"))
        st = dec.state
    assert said == 39   # each new report recorded, nobody failed


def test_without_reports_or_with_the_rule_off_a_quiet_peer_waits_for_the_detection_timeout():
    start = T0 + 0.1
    for s, reports in ((settings(suspect_age_s=SUSPECT), {}),
                       (settings(suspect_age_s=0.0), {"node0.0": report(start + 0.05)})):
        st = three_nodes_beating(start)
        for i in range(1, 30):
            now = start + 0.3 * i
            dec = decide(st, Observation(now=now, beats={**{w: beat(now) for w in LIVE}, "node2.0": beat(start)},
                                         reports=reports), s)
            st = dec.state
            if events(dec.actions, "failure"):
                break
        assert now - start > DETECT and events(dec.actions, "failure")[0]["failed"]["node2.0"]["why"].startswith(
            "hung: no heartbeat for 6.3s (SIGKILLed")


@pytest.mark.parametrize("case", ["older generation", "a spare", "a fenced node", "nobody", "quiet reporter",
                                  "reporter exited", "report too old"])
def test_reports_the_rule_ignores(case):
    """Only a live rank of the current generation, heard from within the suspect age, shortens detection, and only
    for two suspect ages after its report was read."""
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start)
    if case == "a fenced node":   # generation 1: node1 failed and replaced by the spare, node1 (alive) reports
        st = decide(st, Observation(now=start + 0.1, exits={"node1.0": -9}), s).state
        st = decide(st, Observation(now=start + 0.2, beats=beats_of(st, start + 0.2)), s).state
        start += 0.2
    gen = st.assignment.generation
    reporter = {"older generation": "node0.0", "a spare": "spare0.0", "a fenced node": "node1.0",
                "nobody": "ghost0.0", "quiet reporter": "node0.0", "reporter exited": "node0.0",
                "report too old": "node0.0"}[case]
    rep = report(start, gen=gen - 1 if case == "older generation" else gen)
    if case == "older generation":
        st = dataclasses.replace(st, assignment=dataclasses.replace(st.assignment, generation=gen + 1))
        rep = report(start, gen=gen)
    live = [w for w in st.assignment.ranks if w != "node2.0"] + ["spare0.0" if case != "a fenced node" else "node1.0"]
    if case == "quiet reporter":
        live.remove("node0.0")
    exits = {"node0.0": 0} if case == "reporter exited" else {}
    now, seen = start, []
    for i in range(1, 12):   # 3.3 s
        now = start + 0.3 * i
        dec = decide(st, Observation(now=now, beats={**{w: beat(now) for w in live}, "node2.0": beat(start),
                                                     **({"node0.0": beat(start)} if case == "quiet reporter" else {})},
                                     reports={reporter: rep}, exits=exits), s)
        seen += events(dec.actions, "suspect")
        assert not events(dec.actions, "failure"), (case, now - start, dec.actions)
        st = dec.state
        if case == "report too old" and i == 1:   # read 2.1 s ago: past two suspect ages, it counts no more
            st = dataclasses.replace(st, reports_heard={reporter: (gen, start, now - 2 * SUSPECT - 0.1)})
    # a report of the generation by one of its ranks is recorded (once) even where it decides nothing
    assert len(seen) == (1 if case in ("quiet reporter", "reporter exited", "report too old") else 0)


def test_a_turn_that_found_a_failure_otherwise_fails_nobody_by_report():
    """node1 crashed (its exit seen): the survivors' reports are that failure's. node2, starved (quiet 1.5 s) but
    alive, is not failed with it."""
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start)
    now = start
    for i in range(1, 5):
        now = start + 0.3 * i
        st = decide(st, Observation(now=now, beats={"node0.0": beat(now), "node1.0": beat(now), "spare0.0": beat(now),
                                                    "node2.0": beat(start)}), s).state
    now += 0.3   # node2 unheard for 1.5 s
    dec = decide(st, Observation(now=now, beats={"node0.0": beat(now), "spare0.0": beat(now), "node2.0": beat(start)},
                                 exits={"node1.0": -9}, reports={"node0.0": report(now - 0.1)}), s)
    [failure] = events(dec.actions, "failure")
    assert list(failure["failed"]) == ["node1.0"] and of(dec.actions, Fence) == [Fence("node1", drop_memory=True)]


def test_a_report_fails_nobody_while_the_reporter_is_as_quiet_as_the_peer():
    """Every heartbeat comes late (a starved machine): the reporter has not beaten twice since the quiet peer's last
    beat, so that peer's silence says nothing yet; once the reporter beats on and the peer does not, it is failed."""
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start)
    once = {**{w: beat(start + 0.5) for w in LIVE}, "node2.0": beat(start)}   # one beat each since, none from node2
    rep = {"node0.0": report(start + 0.55)}
    for now in (start + 0.6, start + 1.2, start + 1.5):   # node2 unheard for up to 1.5 s
        dec = decide(st, Observation(now=now, beats=once, reports=rep), s)
        assert not events(dec.actions, "failure"), dec.actions
        st = dec.state
    now = start + 1.8   # the others' second beat since node2's last: node2 is failed
    dec = decide(st, Observation(now=now, beats={**once, **{w: beat(now) for w in LIVE}}, reports=rep), s)
    assert list(events(dec.actions, "failure")[0]["failed"]) == ["node2.0"]


def test_a_store_grace_holds_report_based_detection_too():
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start)
    late = start + 2.0   # this turn came 2 s late: a stalled store; every heartbeat gets DETECT s of grace
    st = decide(st, Observation(now=late, beats={w: beat(late) for w in LIVE}), s).state
    assert st.grace_until == late + DETECT
    for i in range(1, 10):
        now = late + 0.3 * i
        dec = decide(st, Observation(now=now, beats={**{w: beat(now) for w in LIVE}, "node2.0": beat(start)},
                                     reports={"node0.0": report(now)}), s)
        assert not events(dec.actions, "failure")
        st = dec.state


def test_quiet_is_measured_on_the_coordinators_clock_not_the_workers():
    """A worker whose clock runs 5 s behind beats on: its ``t`` changes every beat, so it is heard, not quiet."""
    s = settings(suspect_age_s=SUSPECT)
    start = T0 + 0.1
    st = three_nodes_beating(start)
    for i in range(1, 10):
        now = start + 0.3 * i
        dec = decide(st, Observation(now=now, beats={**{w: beat(now) for w in LIVE}, "node2.0": beat(now - 5.0)},
                                     reports={"node0.0": report(now)}), s)
        assert not events(dec.actions, "failure")
        st = dec.state


# -- no spare left -------------------------------------------------------------------------------------------------
def test_no_spare_left_with_policy_fail_stops_naming_the_lost_node():
    st = job(spares=0)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}), settings())
    assert dec.exit_code == 1
    [stop] = of(dec.actions, Stop)
    assert stop.reason.startswith("node(s) ['node1'] failed but only 0 spare node(s) are left")
    assert "Policy --no-spare-policy=fail: stopping the job" in stop.said
    assert stop.assignment == st.assignment
    assert of(dec.actions, Fence) == [Fence("node1", drop_memory=True)]


def test_a_worker_that_exited_on_its_own_is_named_as_the_cause_not_a_lost_node():
    dec = decide(job(spares=0), Observation(now=T0 + 0.1, exits={"node1.0": 2}), settings())
    [stop] = of(dec.actions, Stop)
    assert "node1.0 (exit status 2) refused its configuration" in stop.said


def test_shrink_then_grow_back_once_the_shrunk_world_has_formed():
    st = job(nnodes=3, spares=0)
    s = settings(policy_flag=None)
    # the job's config says shrink (no flag)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node2.0": -9}, job_policy="shrink"), s)
    [say] = of(dec.actions, Say)
    assert say.text.endswith("--no-spare-policy shrink: continuing without node(s) ['node2'] on 2 ranks (was 3), the "
                             "state resharded from memory")
    assert of(dec.actions, NoteDropped) == [NoteDropped(("node2",), 1)]
    [pub] = of(dec.actions, Publish)
    assert pub.assignment.shrunk == ("node2",) and pub.assignment.world_size == 2
    st = dec.state
    assert st.shrunk and st.formed_after == T0 + 0.1
    # node2 repaired: its process beats, but the shrunk world has not stepped yet: the grow waits, said once
    now = T0 + 5.0
    obs = dict(job_policy="shrink", repaired=("node2",))
    st = dataclasses.replace(st, last_turn=now - 0.1)
    waiting = {"node0.0": beat(now, step_at=T0), "node1.0": beat(now, step_at=T0), "node2.0": beat(now)}
    said = []
    for i in range(3):
        dec = decide(st, Observation(now=now + 0.1 * i, beats=waiting, **obs), s)
        assert not of(dec.actions, Publish)
        said += of(dec.actions, Log)
        st = dec.state
    assert [a.text for a in said] == ["node node2 is ready to join; the grow waits until generation 1 (2 ranks) has "
                                      "finished a step on every rank (not yet: node0.0, node1.0)"]
    # every rank of generation 1 finished a step: grow
    formed = {**waiting, "node0.0": beat(now + 1, step_at=now + 1), "node1.0": beat(now + 1, step_at=now + 1)}
    dec = decide(st, Observation(now=now + 1, beats=formed, **obs), s)
    [pub] = of(dec.actions, Publish)
    assert pub.assignment.grown == ("node2",) and pub.assignment.world_size == 3
    assert pub.assignment.ranks == {"node0.0": 0, "node1.0": 1, "node2.0": 2}
    assert pub.event == {"event": "assignment", "generation": 2, "grown": ["node2"], "world_size": 3}
    assert of(dec.actions, ClearRepaired) == [ClearRepaired("node2")]
    assert of(dec.actions, Say)[0].text == ("node node2 joins: growing to 3 ranks (was 2), the state resharded from "
                                            "memory")
    assert not dec.state.shrunk


@pytest.mark.parametrize("case", ["unknown", "in_world", "exited", "no_beat", "policy_fail"])
def test_a_repaired_node_is_grown_to_only_when_it_is_the_jobs_ready_and_the_policy_is_shrink(case):
    st = job(nnodes=3, spares=0)
    st = dataclasses.replace(st, assignment=shrink_failed(st.assignment, {"node2"}), formed_after=0.0)
    now = T0 + 1
    beats = beats_of(st, now)
    obs = dict(now=now, beats=beats, job_policy="shrink", repaired=("node2",))
    if case == "unknown":
        obs["repaired"] = ("evil",)
    if case == "in_world":
        obs["repaired"] = ("node1",)
    if case == "exited":
        obs["exits"] = {"node2.0": 1}
    if case == "no_beat":
        obs["beats"] = {w: b for w, b in beats.items() if w != "node2.0"}
    if case == "policy_fail":
        obs["job_policy"] = "fail"
    dec = decide(st, Observation(**obs), settings(policy_flag=None))
    assert not of(dec.actions, Publish)
    expected = {"unknown": [BadKey("repaired/evil", "names no node of this job (nor one admitted to join it)",
                                   delete=True)],
                "in_world": [ClearRepaired("node1")]}.get(case, [])
    assert [a for a in dec.actions if isinstance(a, (BadKey, ClearRepaired))] == expected


def test_shrink_with_no_node_left_stops():
    st = job(nnodes=1, spares=0)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node0.0": -9}), settings(policy_flag="shrink"))
    [stop] = of(dec.actions, Stop)
    assert stop.reason.startswith("node(s) ['node0'] failed and no node is left to shrink to")


# -- waiting for a spare: a state, not a sleep -----------------------------------------------------------------------
def test_no_spare_with_policy_wait_awaits_a_joining_machine_and_gives_it_the_failed_ranks():
    st = job(spares=0)
    s = settings(policy_flag="wait", spare_wait_s=30.0)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}), s)
    assert dec.exit_code is None and not of(dec.actions, Publish)
    assert of(dec.actions, Fence) == [Fence("node1", drop_memory=True)]
    assert dec.state.awaiting == AwaitSpare(frozenset({"node1"}), T0 + 30.1, "wait")
    assert "waiting up to 30s for a machine to join as a spare" in of(dec.actions, Log)[0].text
    st = dec.state
    # turns go by: nothing is judged again (node1's exit is not a second failure), nothing is said again
    for i in range(1, 4):
        dec = decide(st, Observation(now=T0 + 0.1 + i, exits={"node1.0": -9}), s)
        assert dec.actions == () and dec.state.awaiting == st.awaiting
        st = dec.state
    # a machine asks to join: admitted as a spare, and takes node1's ranks in the same turn
    req = JoinRequest("extra0", json.dumps({"nproc": 1, "time": 0}).encode())
    dec = decide(st, Observation(now=T0 + 5, exits={"node1.0": -9}, joins=(req,)), s)
    assert of(dec.actions, AnswerJoin) == [AnswerJoin("extra0", True, role="spare")]
    [spares] = of(dec.actions, SetSpares)
    assert spares.assignment.spares == ("extra0",) and spares.assignment.generation == 0
    [pub] = of(dec.actions, Publish)
    assert pub.assignment.generation == 1 and pub.assignment.replaced == {"node1": "extra0"}
    assert pub.assignment.ranks == {"node0.0": 0, "extra0.0": 1}
    assert dec.state.awaiting is None and dec.state.roster.node_host["extra0"] == d.JOINED_HOST
    # the next turn judges the new generation as usual
    dec = decide(dec.state, Observation(now=T0 + 5.1, exits={"node1.0": -9}), s)
    assert dec.actions == ()


def test_waiting_for_a_spare_stops_at_the_deadline():
    st = job(spares=0)
    s = settings(policy_flag="wait", spare_wait_s=2.0)
    st = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": 1}), s).state
    assert decide(st, Observation(now=T0 + 2.0), s).state.awaiting is not None
    dec = decide(st, Observation(now=T0 + 2.1, exits={"node1.0": 1}), s)
    assert dec.exit_code == 1 and dec.state.awaiting is None
    [stop] = of(dec.actions, Stop)
    assert "node1.0 (exit status 1) exited on its own" in stop.said and stop.assignment == st.assignment


def test_a_coordinator_taking_over_during_a_wait_judges_the_failure_afresh():
    st = job(spares=0)
    s = settings(policy_flag="wait", spare_wait_s=30.0)
    st = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}), s).state
    st = taken_over(st, st.assignment, {"spare9"}, T0 + 1)
    assert st.awaiting is None and st.dead_spares == {"spare9"} and st.formed_after == T0 + 1 and st.seen_hb == {}
    dec = decide(st, Observation(now=T0 + 1.1, exits={"node1.0": -9}), s)
    assert events(dec.actions, "failure") and dec.state.awaiting is not None


# -- joins ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,request_,why", [
    ("node1", {"nproc": 1}, "node name 'node1' is taken by a node of this job"),
    ("extra0", {"nproc": 3}, "the joining node has 3 process(es), this job's nodes have 1: pass --nproc-per-node 1"),
    ("extra0", {"nproc": "1"}, "the joining node has '1' process(es)"),
    ("extra0", ["not", "a", "dict"], "the joining node has None process(es)"),
    ("0bad", {"nproc": 1}, "node name '0bad': must be 1-63 characters"),
    ("../evil", {"nproc": 1}, "node name '../evil': must be 1-63 characters"),
])
def test_bad_join_requests_are_refused_with_the_reason(name, request_, why):
    st = job()
    req = JoinRequest(name, json.dumps(request_).encode(), earlier_ok=True)   # a pre-written ack changes nothing
    dec = decide(st, Observation(now=T0 + 0.1, joins=(req,)), settings())
    [ans] = of(dec.actions, AnswerJoin)
    assert not ans.ok and why in ans.why
    assert dec.state.roster == st.roster and dec.state.assignment == st.assignment
    assert events(dec.actions, "join_refused")[0]["why"] == ans.why


def test_an_unreadable_join_request_is_refused():
    dec = decide(job(), Observation(now=T0, joins=(JoinRequest("extra0", b"\xff{"),)), settings())
    assert of(dec.actions, AnswerJoin)[0].why.startswith("the join request is not usable: store key 'joined/extra0'")


def test_each_join_request_is_judged_once_and_a_refusal_already_given_is_not_repeated():
    st = job()
    req = JoinRequest("extra0", b'{"nproc": 1}')
    dec = decide(st, Observation(now=T0, joins=(req,)), settings())
    assert len(of(dec.actions, AnswerJoin)) == 1
    assert decide(dec.state, Observation(now=T0 + 1, joins=(req,)), settings()).actions == ()
    bad = JoinRequest("extra1", b'{"nproc": 2}', earlier_ok=False)
    assert decide(st, Observation(now=T0, joins=(bad,)), settings()).actions == ()


def test_a_coordinator_taking_over_learns_the_nodes_admitted_before_without_answering_again():
    st = job()
    dec = decide(st, Observation(now=T0, joins=(JoinRequest("extra0", b'{"nproc": 1}', earlier_ok=True),)), settings())
    assert dec.actions == ()
    assert Worker("extra0.0", "extra0", 0) in dec.state.roster.workers and "extra0" in dec.state.roster.spare_nodes


def test_a_machine_joining_a_shrunk_world_is_offered_for_growing():
    st = job(nnodes=2, spares=0)
    st = dataclasses.replace(st, assignment=shrink_failed(st.assignment, {"node1"}))
    dec = decide(st, Observation(now=T0, joins=(JoinRequest("extra0", b'{"nproc": 1}'),)),
                 settings(policy_flag="shrink"))
    assert of(dec.actions, MarkRepaired) == [MarkRepaired("extra0")] and not of(dec.actions, SetSpares)
    assert of(dec.actions, AnswerJoin) == [AnswerJoin("extra0", True, role="grow")]
    assert dec.state.assignment == st.assignment
    # grown to on a later turn, like a repaired node
    now = T0 + 1
    st = dec.state
    dec = decide(st, Observation(now=now, beats=beats_of(st, now, step_at=now), repaired=("extra0",)),
                 settings(policy_flag="shrink"))
    assert of(dec.actions, Publish)[0].assignment.grown == ("extra0",)


# -- a lease that resumed, and the purity of the whole ---------------------------------------------------------------
def test_a_resumed_lease_restarts_heartbeat_records_with_a_grace():
    st = job()
    st = decide(st, Observation(now=T0 + 0.1, beats=beats_of(st, T0)), settings()).state
    dec = decide(st, Observation(now=T0 + 30, resumed_grace_until=T0 + 50), settings())
    assert not of(dec.actions, Publish)
    assert dec.state.grace_until == T0 + 50 and dec.state.seen_hb == {}


def test_decide_leaves_its_inputs_alone():
    st = job()
    obs = Observation(now=T0 + 0.1, exits={"node1.0": 1}, beats=beats_of(st, T0))
    before = (dataclasses.asdict(st), dict(obs.beats), dict(obs.exits))
    first = decide(st, obs, settings())
    assert (dataclasses.asdict(st), dict(obs.beats), dict(obs.exits)) == before
    assert decide(st, obs, settings()) == first   # the same turn twice: the same decision


def test_the_rules_module_does_no_io():
    """No clock, no sleep, no store, no process, no thread: what decide returns depends on its arguments only
    (done.py, the rule of a loss after the job's work is done, alike)."""
    from deadpool_ext.launcher import done

    for module in (d, done):
        with open(module.__file__) as fh:
            tree = ast.parse(fh.read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and not n.level}
        assert not imported & {"time", "os", "subprocess", "socket", "threading", "signal", "shutil", "select",
                               "random"}
        from_package = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
        assert from_package <= {"actions", "cluster.assignment", "cluster.membership", None, "final", "hangs",
                                "done"}, from_package
    assert os.path.basename(d.__file__) == "decide.py"


def test_work_done_needs_every_live_rank_at_its_last_step_and_the_lost_ones_committed():
    """The rule behind a loss after the job's work is done (pure): every rank that was not lost ended its loop in
    this generation at the same last step, and a lost rank that wrote nothing is known to have finished it (that
    step committed, an all-reduce over every rank)."""
    ranks = {"node0.0": 0, "node1.0": 1}

    def t(step: int, committed: int | None = None, generation: int = 0) -> values.Trained:
        return values.Trained(generation, step, committed)

    lost = {"node1.0"}
    assert work_done(ranks, 0, {"node0.0": t(10, 10)}, lost) == 10  # the lost rank's step 10 was committed
    assert work_done(ranks, 0, {"node0.0": t(10, 10), "node1.0": t(10, 10)}, lost) == 10  # it ended too
    assert work_done(ranks, 0, {"node0.0": t(10, 9), "node1.0": t(10, 9)}, lost) == 10  # ended: no commit needed
    assert work_done(ranks, 0, {"node0.0": t(10, 9)}, lost) is None  # step 10 of the lost rank unknown
    assert work_done(ranks, 0, {"node0.0": t(10)}, lost) is None  # nothing committed
    assert work_done(ranks, 0, {}, lost) is None  # no loop ended: a plain failure
    assert work_done(ranks, 0, {"node1.0": t(10, 10)}, lost) is None  # the survivor still trains
    assert work_done(ranks, 0, {"node0.0": t(10, 10), "node1.0": t(9, 9)}, lost) is None  # different steps
    assert work_done(ranks, 1, {"node0.0": t(10, 10)}, lost) is None  # of an earlier generation
    assert work_done(ranks, 0, {"node0.0": t(10, 10)}, set()) is None  # nobody lost
    both = {"node0.0", "node1.0"}  # both gone in one turn (a survivor stopped in the closing barrier too)
    assert work_done(ranks, 0, {"node0.0": t(10, 10)}, both) == 10


def test_a_node_lost_after_the_jobs_last_step_finishes_the_job():
    """Every rank ended its loop at step 10 (``trained/``, step 10 committed), then node1 is lost in the closing
    barrier: the job finishes (status 0), the lost node fenced and named once, no spare is used; without the
    records the same loss is a failure (the spare takes node1's ranks)."""
    st = job(spares=1)
    trained = {"node0.0": values.Trained(0, 10, 10), "node1.0": values.Trained(0, 10, 10)}
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}, trained=trained), settings())
    assert dec.exit_code == 0 and not of(dec.actions, Publish) and not of(dec.actions, Stop)
    assert events(dec.actions, "lost_after_done") == [{"event": "lost_after_done", "generation": 0,
                                                       "lost": ["node1"], "step": 10,
                                                       "failed": {"node1.0": "exited with signal 9"}}]
    assert of(dec.actions, Fence) == [Fence("node1", drop_memory=True)] and len(of(dec.actions, Say)) == 1
    plain = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}), settings())
    assert plain.exit_code is None and of(plain.actions, Publish) and not events(plain.actions, "lost_after_done")
    # a loss while the survivor still trains (its loop has not ended): a failure, not the job's end
    early = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}, trained={"node1.0": trained["node1.0"]}),
                   settings())
    assert early.exit_code is None and of(early.actions, Publish)


def test_a_script_that_ended_counts_as_the_end_of_its_loop():
    """A rank whose script returned (exit 0 or ``done/``) after step 10: a rank lost meanwhile needs no commit of
    step 10 to be known to have finished it (its gradients were reduced over it, and the loop is over)."""
    ranks, lost = {"node0.0": 0, "node1.0": 1}, {"node1.0"}
    plain_loop = {"node0.0": values.Trained(0, 10, None)}  # written by mark_done: no commit known
    assert work_done(ranks, 0, plain_loop, lost) is None
    assert work_done(ranks, 0, plain_loop, lost, ended={"node0.0"}) == 10


def _after_swap() -> CoordinatorState:
    """Generation 1: node1 was lost (exit -9) and spare0 took its rank."""
    dec = decide(job(spares=1), Observation(now=T0 + 0.1, exits={"node1.0": -9}), settings())
    assert dec.state.assignment.replaced == {"node1": "spare0"}
    return dec.state


def test_a_survivor_whose_script_ended_before_the_swap_finishes_the_job():
    """node1 lost right after the last step 10 of a plain loop; node0's script ended (exit 0, its loop's end
    recorded in generation 0) while generation 1 was published: it never joins it, so the spare would wait for it
    until its deadline. The job's work is done: finished with status 0, the lost node named, the spare stopped."""
    st = _after_swap()
    trained = {"node0.0": values.Trained(0, 10, None)}
    dec = decide(st, Observation(now=T0 + 0.5, exits={"node1.0": -9, "node0.0": 0}, trained=trained), settings())
    assert dec.exit_code == 0 and not of(dec.actions, Publish) and len(of(dec.actions, Say)) == 1
    assert [(e["lost"], e["step"], e["ended"], e["stopped"]) for e in events(dec.actions, "lost_after_done")] == [
        (["node1"], 10, ["node0.0"], ["spare0.0"])]
    unknown = decide(st, Observation(now=T0 + 0.5, exits={"node1.0": -9, "node0.0": 0}), settings())
    assert unknown.exit_code is None and not events(unknown.actions, "lost_after_done")  # no step known: no verdict


def test_a_spare_past_the_last_step_alone_in_a_collective_finishes_the_job():
    """node1 lost at the last step 10; the survivor recovered in place in generation 1, its script then ended after
    step 10, and the spare, restored to step 10, trains step 11 (the script checks its step count after a step):
    its collective fails once the survivor's connections close, and it reports it. The job's work is done. Being
    inside a collective for long is not enough (a rank's own last writes can stand in torch.distributed's code),
    and without a recovery the same picture is the script's own hang, judged as before."""
    st = _after_swap()
    trained = {"node0.0": values.Trained(1, 10, None)}
    exits = {"node1.0": -9, "node0.0": 0}

    def turn(**kw):
        return decide(st, Observation(now=T0 + 9, exits=exits, trained=trained, **kw), settings())

    reported = turn(beats={"spare0.0": beat(T0 + 9, step=-1)},
                    reports={"spare0.0": values.Report(1, T0 + 8, "Connection closed by peer")})
    assert reported.exit_code == 0
    assert [e["stopped"] for e in events(reported.actions, "lost_after_done")] == [["spare0.0"]]
    older = turn(beats={"spare0.0": beat(T0 + 9, step=-1)},
                 reports={"spare0.0": values.Report(0, T0 + 8, "Connection closed by peer")})
    assert older.exit_code is None and not events(older.actions, "lost_after_done")  # the report of the loss itself
    for b in (beat(T0 + 9, step=-1, coll=True, still_s=60.0), beat(T0 + 9, step=-1, still_s=30.0)):
        left = turn(beats={"spare0.0": b})
        assert left.exit_code is None and not events(left.actions, "lost_after_done"), b
    st0 = job(spares=1)
    hang = decide(st0, Observation(now=T0 + 9, exits={"node0.0": 0}, trained={"node0.0": values.Trained(0, 10, None)},
                                   reports={"node1.0": values.Report(0, T0 + 8, "Connection closed by peer")}),
                  settings())
    assert not events(hang.actions, "lost_after_done") and hang.exit_code is None


def test_a_spare_that_took_ranks_and_then_failed_is_a_failed_node_not_a_lost_spare():
    """Five swaps, swap 3 (benchmarks/results/five_swaps_any_node.md): spare0 took node1's ranks, then was killed
    itself. Once the next generation replaced it, its exit must not read as a *spare* lost ("no spare left"): only a
    node that is a spare in the current assignment can be one."""
    st = job(nnodes=2, spares=2)
    dec = decide(st, Observation(now=T0 + 0.1, exits={"node1.0": -9}), settings())
    assert of(dec.actions, Publish)[0].assignment.replaced == {"node1": "spare0"}
    exits = {"node1.0": -9, "spare0.0": -9}
    dec = decide(dec.state, Observation(now=T0 + 0.2, exits=exits), settings())
    assert of(dec.actions, Publish)[0].assignment.replaced == {"spare0": "spare1"}
    assert events(dec.actions, "spare_lost") == []
    dec = decide(dec.state, Observation(now=T0 + 0.3, exits=exits), settings())
    assert events(dec.actions, "spare_lost") == [] and not of(dec.actions, Log), dec.actions
    assert dec.state.dead_spares == frozenset()


def test_out_of_spares_says_which_step_is_safe_on_which_tier():
    """Issue 47: an allocation that lost more nodes than it has spares stops with one line saying which step is safe
    on which tier: the memory tiers end with the job, so tier 3's newest verified base (in the coordinating rank's
    heartbeat) is what a restart resumes from, and the steps trained since are named as lost."""
    st = job(spares=0)
    beats = {"node0.0": {**beat(T0, step=9), "tier3": 6}, "node1.0": beat(T0 - 1, step=8)}
    dec = decide(st, Observation(now=T0 + 0.1, beats=beats, exits={"node1.0": -9}), settings())
    [stop] = of(dec.actions, Stop)
    assert stop.safe == {"trained_step": 9, "tier3_step": 6}
    assert stop.said.endswith("Safe on tier 3: step 6, its newest verified base when the job stopped (a base still "
                              "being written may add a newer one): a restart with --load resumes from the newest; "
                              "steps 7-9 trained since were in memory only.")
    dec = decide(st, Observation(now=T0 + 0.1, beats={"node0.0": beat(T0, step=9)}, exits={"node1.0": -9}),
                 settings())
    [stop] = of(dec.actions, Stop)
    assert stop.safe == {"trained_step": 9, "tier3_step": None}
    assert "No tier-3 base was published (persist.url unset, or none written yet): the steps trained up to step 9 " \
           "end with this job's memory, and a restart trains from its start" in stop.said


def test_a_heartbeat_carries_the_newest_tier3_base_and_a_bad_one_is_refused():
    raw = json.dumps({**beat(T0), "tier3": 12}).encode()
    assert values.heartbeat("hb/node0.0", raw)["tier3"] == 12
    with pytest.raises(values.BadValue, match="tier3"):
        values.heartbeat("hb/node0.0", json.dumps({**beat(T0), "tier3": "12"}).encode())
