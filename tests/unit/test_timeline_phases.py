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
