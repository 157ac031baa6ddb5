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
