"""``recovery.timeline.phases``: the detect phase of a hot-swap and, when a survivor reported its failed collective
(the coordinator's ``suspect`` event), when that report was made."""
from __future__ import annotations

from deadpool_ext.recovery.timeline import format_table, phases


def _events(suspect: bool) -> list[dict]:
    ev = [{"event": "fault", "time": 100.0, "generation": 0},
          {"event": "failure", "generation": 0, "detected_at": 100.9, "time": 100.9,
           "failed": {"node2.0": {"rank": 2, "node": "node2", "why": "hung: ..."}}},
          {"event": "assignment", "generation": 1, "replaced": {"node2": "spare0"}, "published_at": 104.0}]
    if suspect:
        ev[1:1] = [{"event": "suspect", "generation": 0, "reporter": "node0.0", "rank": 0, "reported_at": 100.05,
                    "heard_at": 100.1},
                   {"event": "suspect", "generation": 0, "reporter": "node1.0", "rank": 1, "reported_at": 100.04,
                    "heard_at": 100.2}]
    return ev


def test_the_first_report_read_is_the_reported_phase():
    [row] = phases(_events(suspect=True))
    assert row["generation"] == 1 and abs(row["detect_s"] - 0.9) < 1e-9
    assert abs(row["reported_s"] - 0.05) < 1e-9   # the report the coordinator read first


def test_without_a_report_reported_is_none():
    [row] = phases(_events(suspect=False))
    assert row["reported_s"] is None and abs(row["detect_s"] - 0.9) < 1e-9


def test_deadpool_timeline_shows_the_report_beside_detection():
    table = format_table(phases(_events(suspect=True)) + phases(_events(suspect=False))).splitlines()
    assert table[0].split()[:3] == ["gen", "report", "detect"]
    assert table[2].split()[:3] == ["1", "0.05", "0.90"] and table[3].split()[:3] == ["1", "-", "0.90"]


def _swap(built_ahead: bool) -> list[dict]:
    """A swap whose spare built its engine before the failure, or after its assignment."""
    spare = {"event": "recover", "role": "spare", "generation": 1, "rank": 2, "pid": 9, "restored_version": 4,
             "restored_at": 105.2, "built_ahead": built_ahead, "join_at": 104.05 if built_ahead else 108.0,
             "pg_ready_at": 104.3 if built_ahead else 108.3, "prologue_s": 3.1, "engine_s": 1.4}
    surv = [{"event": "recover", "role": "survivor", "generation": 1, "pid": p, "restored_version": 4,
             "pg_ready_at": spare["pg_ready_at"], "engine_ready_at": spare["pg_ready_at"],
             "restored_at": spare["pg_ready_at"] + 0.5} for p in (7, 8)]
    ev = _events(suspect=False)
    ev[2]["time"] = 104.0
    return ev + surv + [spare]


def test_agree_is_split_into_the_assignment_the_spare_and_the_communicators():
    [ahead] = phases(_swap(built_ahead=True))
    assert abs(ahead["assign_s"] - 3.1) < 1e-9 and abs(ahead["spare_s"] - 0.05) < 1e-9
    assert abs(ahead["communicators_s"] - 0.25) < 1e-9 and ahead["spare_built_ahead"] is True
    [after] = phases(_swap(built_ahead=False))
    assert abs(after["spare_s"] - 4.0) < 1e-9 and after["spare_built_ahead"] is False
    assert abs(after["communicators_s"] - 0.3) < 1e-9
    for row in (ahead, after):  # the parts add up to what agree used to hold alone
        assert abs(row["assign_s"] + row["spare_s"] + row["communicators_s"] - row["agree_s"]) < 1e-9


def test_deadpool_timeline_names_the_spares_phases():
    table = format_table(phases(_swap(True)) + phases(_swap(False))).splitlines()
    assert table[0].split()[:7] == ["gen", "report", "detect", "assign", "spare", "comms", "rebuild"]
    assert "3.10 + 1.40 s ahead" in table[2] and "3.10 + 1.40 s after" in table[3]


def test_a_spare_that_relabelled_its_engine_says_the_rank_it_built_for():
    events = _swap(True)
    events[-1]["relabelled_from"] = 1  # built ahead for rank 1, took rank 2 (issue 44)
    [row] = phases(events)
    assert row["spare_relabelled_from"] == 1 and row["spare_built_ahead"] is True
    assert "3.10 + 1.40 s ahead, from r1" in format_table([row]).splitlines()[2]
