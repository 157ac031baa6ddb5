"""The pace a heartbeat reports (rebuild/progress.py): steps, their wall seconds and the training thread's seconds in
collectives, as running totals per generation; and progress.timed, where the swappable groups time a collective, on
a real one-rank gloo group."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from deadpool_ext.rebuild import progress
from deadpool_ext.rebuild.progress import Progress
from deadpool_ext.rebuild.timed_work import TimedWork
from deadpool_ext.testing.launch import free_port


def test_steps_are_timed_within_a_generation_and_not_across_one():
    p = Progress()
    p.note_step(1, 0)                 # the first step of a generation only starts the clock
    assert p.sample()["pace"] == [0, 0.0, 0.0, False]
    p.note_wait(0.004)
    time.sleep(0.01)
    p.note_step(2, 0)
    n, step_s, wait_s, measured = p.sample()["pace"]
    assert (n, measured) == (1, True) and step_s >= 0.01 and wait_s == 0.004
    time.sleep(0.02)                  # a recovery: the next step is in generation 1, its interval not a pace
    p.note_wait(0.5)
    p.note_step(3, 1)
    assert p.sample()["pace"][:3] == [1, step_s, wait_s]
    p.note_step(4, 1)
    assert p.sample()["pace"][0] == 2 and p.sample()["pace"][2] == wait_s   # the recovery's wait was dropped too


def test_timed_waits_for_a_synchronous_collective_and_wraps_an_asynchronous_one():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, 0, 1)
    t = torch.ones(4)
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    work = progress.timed(pg.allreduce, ([t], sync), {})
    assert work.is_completed() and not isinstance(work, TimedWork)
    asy = dist.AllreduceOptions()
    asy.asyncOp = True
    work = progress.timed(pg.allreduce, ([t], asy), {})
    assert isinstance(work, TimedWork)
    waited = progress._progress()._wait_s
    assert work.wait() and work.is_completed() and work.is_success()
    assert progress._progress()._wait_s >= waited   # the wait on this (the main) thread counted
    assert torch.equal(t, torch.ones(4)) and progress._progress().pace_measured
    # a wait on another thread (the snapshot writer's) is not the training thread's
    other = progress.timed(pg.allreduce, ([t], asy), {})
    waited = progress._progress()._wait_s
    th = threading.Thread(target=other.wait)
    th.start()
    th.join(10)
    assert progress._progress()._wait_s == waited
