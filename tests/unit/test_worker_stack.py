"""The error for a snapshot worker that does not stop names where it is blocked (no silent hang)."""
from __future__ import annotations

import threading

from deadpool_ext.snapshot.writer import stack_of


def _blocked_in_a_transfer(release: threading.Event) -> None:
    release.wait(10)


def test_stack_of_a_blocked_thread_names_its_innermost_frames():
    release = threading.Event()
    t = threading.Thread(target=_blocked_in_a_transfer, args=(release,), daemon=True)
    t.start()
    try:
        where = stack_of(t)
        assert where.split(" < ")[0].startswith("threading.py:")  # innermost first: Event.wait -> Condition.wait
        assert "test_worker_stack.py" in where and "_blocked_in_a_transfer" in where
    finally:
        release.set()
        t.join(5)
    assert stack_of(t).startswith("(no stack")  # finished
