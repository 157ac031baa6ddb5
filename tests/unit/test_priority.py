"""The snapshot worker's thread gives way to training: SCHED_IDLE (or nice 19) on that thread only."""
from __future__ import annotations

import os
import threading

import pytest

from deadpool_ext.config import ConfigError, DeadpoolConfig
from deadpool_ext.snapshot.priority import lower_thread_priority


def _in_thread(level: str) -> dict:
    out: dict = {}

    def body() -> None:
        out["got"] = lower_thread_priority(level)
        out["policy"] = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_idle_lowers_only_the_calling_thread():
    before = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    out = _in_thread("idle")
    assert out["got"] == "idle" and out["policy"] == os.SCHED_IDLE
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == before


def test_low_is_nice_19_and_normal_changes_nothing():
    out = _in_thread("low")
    assert out["got"] == "nice19" and out["nice"] == 19
    out = _in_thread("normal")
    assert out["got"] == "normal" and out["nice"] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_worker_priority_is_checked():
    assert DeadpoolConfig.from_dict({}).snapshot.worker_priority == "normal"  # idle starves on a saturated host
    with pytest.raises(ConfigError, match="deadpool.snapshot.worker_priority: must be one of idle, low, normal"):
        DeadpoolConfig.from_dict({"snapshot": {"worker_priority": "realtime"}})
