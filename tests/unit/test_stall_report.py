"""A recovery still under way after ``STALL_REPORT_S`` says where it waits: one ``recovery_stalled`` timeline event
and every thread's stack on stderr, once, and the recovery goes on; a recovery that ends first says nothing."""
from __future__ import annotations

import json
import threading
import time

import pytest

from deadpool_ext.launcher.contract import TIMELINE, reset_worker_env
from deadpool_ext.rebuild.recover import stall_report


@pytest.fixture
def timeline(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(TIMELINE, str(path))
    reset_worker_env()
    yield path
    monkeypatch.delenv(TIMELINE)
    reset_worker_env()


def _waiting_in_a_collective(release: threading.Event) -> None:
    release.wait(5.0)


def test_a_stalled_recovery_prints_every_threads_stack_once(timeline, tmp_path):
    release = threading.Event()
    waiter = threading.Thread(target=_waiting_in_a_collective, args=(release,), name="stuck", daemon=True)
    waiter.start()
    try:
        with open(tmp_path / "stacks", "w+") as stacks:
            timer = stall_report(3, 0.05, stacks)
            timer.join(5.0)
            stacks.seek(0)
            frames = stacks.read()
        assert "_waiting_in_a_collective" in frames  # the stuck thread's frame: where it waits
        events = [json.loads(line) for line in timeline.read_text().splitlines()]
        assert [(e["event"], e["generation"], e["after_s"]) for e in events] == [("recovery_stalled", 3, 0.05)]
    finally:
        release.set()


def test_a_recovery_that_ends_in_time_says_nothing(timeline, tmp_path):
    with open(tmp_path / "stacks", "w+") as stacks:
        timer = stall_report(4, 0.2, stacks)
        timer.cancel()
        time.sleep(0.3)
        assert stacks.tell() == 0
    assert not timeline.exists()


def test_a_notice_the_main_thread_never_heeds_prints_every_threads_stack(timeline, tmp_path):
    """The heartbeat thread passed the launcher's notice on, and the main thread is in no armed region and begins no
    recovery (blocked outside any cut connection): after the delay, where every thread is, once."""
    from deadpool_ext.rebuild import notice

    release = threading.Event()
    waiter = threading.Thread(target=_waiting_in_a_collective, args=(release,), name="stuck", daemon=True)
    waiter.start()
    try:
        notice.request(7, "the launcher published generation 8")
        with open(tmp_path / "stacks", "w+") as stacks:
            notice.unheeded_report(7, 0.05, stacks).join(5.0)
            stacks.seek(0)
            assert "_waiting_in_a_collective" in stacks.read()
        events = [json.loads(line) for line in timeline.read_text().splitlines()]
        assert [(e["event"], e["generation"]) for e in events] == [("notice_unheeded", 7)]
    finally:
        notice.forget(7)
        release.set()


def test_a_notice_heeded_in_time_says_nothing(timeline, tmp_path):
    from deadpool_ext.rebuild import notice

    notice.request(8, "the launcher published generation 9")
    notice.forget(8)  # its recovery began
    with open(tmp_path / "stacks", "w+") as stacks:
        notice.unheeded_report(8, 0.05, stacks).join(5.0)
        assert stacks.tell() == 0
    assert not timeline.exists()
