"""The snapshot worker's thread gives way to training: SCHED_IDLE (or nice 19) on that thread only."""
from __future__ import annotations

import os
import threading

import pytest

from deadpool_ext.config import ConfigError, DeadpoolConfig
from deadpool_ext.snapshot.priority import WorkerPriority, can_boost, lower_thread_priority


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
    assert DeadpoolConfig.from_dict({}).snapshot.worker_priority == "normal"  # see the key's docstring
    with pytest.raises(ConfigError,
                       match="deadpool.snapshot.worker_priority: must be one of auto, idle, low, normal"):
        DeadpoolConfig.from_dict({"snapshot": {"worker_priority": "realtime"}})


def _policy(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def _worker_thread(prio: WorkerPriority):
    """A thread that lowers itself, then (on each request) calls lower() again, as the snapshot worker does at the
    start of every job."""
    import queue

    jobs: queue.Queue = queue.Queue()
    seen: dict = {}

    def body() -> None:
        seen["tid"] = threading.get_native_id()
        seen["first"] = prio.lower()
        seen["ready"].set()
        while (job := jobs.get()) is not None:
            seen[job] = prio.lower()
            seen[f"{job}_done"].set()

    seen["ready"] = threading.Event()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    seen["ready"].wait(5)
    return t, jobs, seen


def _job(jobs, seen, name: str) -> str:
    seen[f"{name}_done"] = threading.Event()
    jobs.put(name)
    assert seen[f"{name}_done"].wait(5)
    return seen[name]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not can_boost()[0],
                    reason="needs SCHED_IDLE and the right to raise a thread back (root or CAP_SYS_NICE)")
def test_a_waiting_thread_boosts_the_idle_worker_until_its_next_job():
    prio = WorkerPriority("auto")
    assert prio.level == "idle"  # auto: idle where the boost works
    normal = (os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))  # as this thread (nice)
    t, jobs, seen = _worker_thread(prio)
    tid = seen["tid"]
    assert seen["first"] == "idle" and _policy(tid)[0] == os.SCHED_IDLE
    assert _job(jobs, seen, "again") == "idle" and _policy(tid)[0] == os.SCHED_IDLE  # not boosted: unchanged
    assert prio.boost() and prio.boosts == 1
    assert _policy(tid) == normal  # raised from this (the "training") thread, to where it started
    assert not prio.boost() and prio.boosts == 1  # already raised
    assert _job(jobs, seen, "next") == "idle" and _policy(tid)[0] == os.SCHED_IDLE  # lowered at its next job
    prio.set_level("normal")
    assert _policy(tid) == normal
    assert _job(jobs, seen, "after") == "normal" and _policy(tid) == normal
    jobs.put(None)
    t.join(5)


def test_auto_is_normal_where_the_worker_could_not_be_raised_back(monkeypatch):
    import deadpool_ext.snapshot.priority as priority

    monkeypatch.setattr(priority, "_can_boost", (False, "PermissionError: [Errno 1] Operation not permitted"))
    prio = WorkerPriority("auto")
    assert prio.level == "normal" and prio.not_boostable == "PermissionError: [Errno 1] Operation not permitted"
    t, jobs, seen = _worker_thread(prio)
    assert seen["first"] == "normal" and _policy(seen["tid"]) == _policy(threading.get_native_id())
    assert not prio.boost()  # nothing to raise
    jobs.put(None)
    t.join(5)
    with pytest.raises(ValueError, match="one of auto, idle, low, normal"):
        WorkerPriority("fast")
