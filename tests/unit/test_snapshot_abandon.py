"""A hot-swap's teardown of the snapshot worker when the worker is blocked in the global commit (the side group's
all-reduce) on a dead peer: the worker is abandoned within seconds, not waited for until the teardown timeout
(a rank that raised there left the job, e.g. with its host), and when that all-reduce returns later its
result never reaches the manager (the new generation's versions stay as they were).

Real SnapshotManager in a gloo world of one; the one stand-in is the all-reduce itself (a gloo receive from a dead
peer that does not fail), made to block until the test releases it."""
from __future__ import annotations

import threading
import time

import torch

from deadpool_ext.snapshot import manager as mgr
from deadpool_ext.snapshot import writer
from deadpool_ext.testing.memory_job import Adapter, manager, world_of_one


def test_worker_blocked_in_the_commit_is_abandoned_and_commits_nothing(tmp_path, monkeypatch):
    release = threading.Event()
    entered = threading.Event()
    real = mgr.dist.all_reduce

    def blocked_all_reduce(tensor: torch.Tensor, *args, **kwargs):
        if int(tensor[0]) == 3:  # the commit of step 3: blocked like a receive from a peer that died
            entered.set()
            release.wait(60)
        return real(tensor, *args, **kwargs)

    with world_of_one():
        a = Adapter()
        m = manager(str(tmp_path), a)
        monkeypatch.setattr(mgr.dist, "all_reduce", blocked_all_reduce)
        for step in (1, 2, 3):
            m.before_optimizer_step()
            a.w.fill_(step)
            a.steps = step
            m.after_step()
            if step < 3:
                m.wait_idle()
        assert m.committed_version == 2
        assert entered.wait(30), "the worker never reached the commit of step 3"
        thread = m.writer.thread
        assert thread is not None and m.writer.phase == mgr.COMMITTING
        t0 = time.monotonic()
        m.stop_worker(30.0)   # raised SnapshotWorkerError after 30 s before the fix
        waited = time.monotonic() - t0
        assert waited < mgr.ABANDON_AFTER_S + 5, waited
        assert m.timings.abandoned == [(3, mgr.COMMITTING)]  # abandoned in the global commit of step 3
        release.set()        # the dead generation's all-reduce returns after all (here: with the value 3)
        thread.join(30)
        assert not thread.is_alive()
        assert m.committed_version == 2 and m.committed_base == 2  # the stale commit was dropped
        assert m.writer.error is None   # an abandoned worker's end is not the new generation's error
        m.close()


def test_cut_short_is_a_lost_peer_in_an_exchange_only():
    """The pure rule behind the level of the line: a snapshot whose replica exchange or global commit failed on a
    lost peer (gloo's words, or the launcher's notice already in) was cut short by the failure the tiers protect
    against; any other failure, or one in the copy, stays the snapshot's own error."""
    reset = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42368: Connection reset by peer"
    assert writer.cut_short(writer.REPLICATING, reset, False)
    assert writer.cut_short(writer.COMMITTING, "Connection closed by peer [10.0.0.2]:1234", False)
    assert writer.cut_short(writer.COMMITTING, "anything at all", True)  # the generation had ended
    assert not writer.cut_short(writer.COMMITTING, "No space left on device", False)
    assert not writer.cut_short("copy", reset, True)  # the copy reads only local memory: never a peer's doing


def test_a_commit_cut_short_by_a_lost_peer_is_counted_as_such_and_commits_nothing(tmp_path, monkeypatch):
    """A real manager whose global commit of step 3 fails the way gloo fails when the peer died: the version is
    recorded as cut short (stats), nothing is committed past 2, and the main thread still learns of the failure at
    its next hook (the recovery decides by cause). A commit that fails for any other reason is not cut short."""
    real = mgr.dist.all_reduce
    fail_with = ["[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42368: Connection reset by peer"]

    def failing_all_reduce(tensor: torch.Tensor, *args, **kwargs):
        if int(tensor[0]) == 3:
            raise RuntimeError(fail_with[0])
        return real(tensor, *args, **kwargs)

    for error, cut in ((fail_with[0], [3]), ("No space left on device", [])):
        fail_with[0] = error
        with world_of_one():
            a = Adapter()
            m = manager(str(tmp_path / str(len(cut))), a)
            monkeypatch.setattr(mgr.dist, "all_reduce", failing_all_reduce)
            for step in (1, 2, 3):
                m.before_optimizer_step()
                a.w.fill_(step)
                a.steps = step
                m.after_step()
            try:
                m.wait_idle()
            except mgr.SnapshotWorkerError:
                pass
            assert m.timings.cut_short == cut and m.committed_version == 2
            assert m.writer.error is not None
            monkeypatch.setattr(mgr.dist, "all_reduce", real)
            m.writer.error = None
            m.close()
