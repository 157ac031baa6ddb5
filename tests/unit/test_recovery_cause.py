"""Whether a failure is recovered is decided by its cause (rebuild/cause.py), never by the exception's type: the pure
rule, then the membership's verdict and the join loop on a real coordination store, then the driver refusing a
failure whose generation lives on (a snapshot worker's error raised before the step is not a lost peer)."""
from __future__ import annotations

import secrets
import threading
import time

import pytest

from deadpool_ext.cluster.assignment import Assignment
from deadpool_ext.config import HotSwapConfig
from deadpool_ext.launcher import keys, values
from deadpool_ext.rebuild import notice
from deadpool_ext.rebuild.cause import Cause, FailureView, Mode, decide_failure, failure_cause, recovery_mode
from deadpool_ext.rebuild.context import context
from deadpool_ext.rebuild.recover import Recovery, report_collective_failure
from deadpool_ext.rebuild.worker import Membership, MembershipError, join_until_formed
from deadpool_ext.snapshot.manager import SnapshotWorkerError
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer

pytestmark = pytest.mark.timeout(60)


# -- the pure rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hot_swap,in_place,factory,same,mode", [
    (False, True, True, False, Mode.RESTART_RESTORE),      # not under deadpool-run (or hot_swap off)
    (True, True, False, False, Mode.IN_PLACE),
    (True, True, False, True, Mode.IN_PLACE),              # Lightning / HF / resilient_steps keep their objects
    (True, False, True, False, Mode.REBUILD),              # hot_swap.in_place: false, Megatron-Core
    (True, False, True, True, Mode.RESTART_RESTORE),       # a rebuild hands back objects the caller cannot take
    (True, False, False, False, Mode.RESTART_RESTORE),     # no factory, no swap: nothing to continue with
])
def test_the_mode_is_decided_once_from_what_the_runtime_can_do(hot_swap, in_place, factory, same, mode):
    assert recovery_mode(hot_swap=hot_swap, in_place=in_place, has_factory=factory, same_objects=same) is mode


@pytest.mark.parametrize("published,notice,cause", [
    (None, False, None),                        # nothing read
    (3, False, None),                           # the generation the step ran in is still the newest
    (2, True, None),                            # an older assignment (a stale read) is no verdict
    (4, False, Cause.COLLECTIVE_FAILED),
    (5, True, Cause.LAUNCHER_NOTICE),
])
def test_the_cause_is_the_launcher_ending_the_generation(published, notice, cause):
    assert failure_cause(3, published, notice) is cause


def test_a_failure_in_a_generation_that_lives_on_propagates_whatever_its_type():
    for mode in (Mode.IN_PLACE, Mode.REBUILD):
        d = decide_failure(FailureView(mode=mode, generation=1, published=1))
        assert not d.recover and d.cause is None and "still the newest" in d.why
        d = decide_failure(FailureView(mode=mode, generation=1, published=2, stopped_by_notice=True))
        assert d.recover and d.mode is mode and d.cause is Cause.LAUNCHER_NOTICE


def test_a_stopped_job_or_no_mode_is_never_recovered():
    assert not decide_failure(FailureView(mode=Mode.IN_PLACE, generation=0, published=1, stopped="no spare")).recover
    assert not decide_failure(FailureView(mode=Mode.RESTART_RESTORE, generation=0, published=1)).recover


# -- the membership's verdict and the join loop, on a real store ---------------------------------------------------
def _assignment(g: int, workers: tuple[str, ...] = ("node0.0", "node1.0"), size: int | None = None) -> Assignment:
    return Assignment(generation=g, world_size=size or len(workers), ranks={w: i for i, w in enumerate(workers)},
                      nodes={w: f"node{i}" for i, w in enumerate(workers)}, spares=[], master_addr="127.0.0.1",
                      master_port=0)


@pytest.fixture
def job():
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        launcher = connect(server.url, token, "causejob", 10.0)
        m = Membership(store_url=server.url, token=token, job_id="causejob", worker_id="node0.0", node="node0",
                       heartbeat_s=0.2, watch_s=0.2)
        try:
            yield launcher, m
        finally:
            m.close()


def _publish_later(store, value, after_s: float) -> threading.Thread:
    def publish() -> None:
        time.sleep(after_s)
        store.set_json(keys.ASSIGNMENT, value)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    return t


def test_verdict_waits_for_the_launcher_and_reads_a_stop(job):
    launcher, m = job
    launcher.set_json(keys.ASSIGNMENT, _assignment(0).to_json())
    t0 = time.monotonic()
    assert m.verdict(0, 0.3) == (0, None)                       # lives on: the whole wait
    assert time.monotonic() - t0 >= 0.3
    _publish_later(launcher, _assignment(1).to_json(), 0.2)
    assert m.verdict(0, 10.0) == (1, None)                      # returns once it is published
    launcher.set_json(keys.ASSIGNMENT, keys.stopped_assignment(_assignment(1).to_json(), "node1 lost, no spare"))
    assert m.verdict(1, 10.0) == (1, "node1 lost, no spare")


def test_join_loop_goes_on_to_the_next_generation_only_when_the_launcher_ends_the_failed_one(job):
    launcher, m = job
    launcher.set_json(keys.ASSIGNMENT, _assignment(0).to_json())
    formed, left = [], []

    def form(a: Assignment) -> int:
        formed.append(a.generation)
        if a.generation == 0:
            _publish_later(launcher, _assignment(1).to_json(), 0.1)   # a peer died while generation 0 formed
            raise ValueError("peer closed the connection")           # not a RuntimeError: the type is irrelevant
        return a.generation

    def leave() -> None:
        left.append(len(formed))

    assert join_until_formed(m, 0, form, leave=leave, what="forming", wait_s=5.0, retry_wait_s=5.0) == 1
    assert formed == [0, 1] and left == [1]

    def fails(a: Assignment) -> int:  # generation 1 lives on: the failure is this process's own
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        join_until_formed(m, 1, fails, leave=leave, what="forming", wait_s=5.0, retry_wait_s=0.3)
    assert store_failure(launcher, 1, "node0.0")

    launcher.set_json(keys.ASSIGNMENT, keys.stopped_assignment(_assignment(1).to_json(), "stopped"))
    with pytest.raises(MembershipError, match="launcher stopped the job: stopped"):
        join_until_formed(m, 1, fails, leave=leave, what="forming", wait_s=5.0, retry_wait_s=5.0,
                          first=_assignment(1))

    def fatal(a: Assignment) -> int:
        raise SnapshotWorkerError("state gone")

    with pytest.raises(SnapshotWorkerError):
        join_until_formed(m, 1, fatal, leave=leave, what="forming", wait_s=5.0, retry_wait_s=5.0,
                          first=_assignment(1), fatal=(SnapshotWorkerError,))
    assert launcher.get(keys.FATAL) is not None


def store_failure(store, g: int, worker: str) -> bool:
    return store.get(keys.failure(g, worker)) is not None


# -- the driver -------------------------------------------------------------------------------------------------
class Untouchable:
    """Hooks of a runtime whose failure must not be recovered: any call but the step counter fails the test."""

    rank = 0
    what_recovers = "rebuilding communicators"

    def step_counter(self) -> int:
        return 7

    def __getattr__(self, name: str):
        raise AssertionError(f"hook {name} called for a failure that is not recovered")


def test_a_snapshot_worker_error_before_the_step_is_not_a_lost_peer(job, monkeypatch):
    launcher, m = job
    launcher.set_json(keys.ASSIGNMENT, _assignment(0).to_json())
    assert m.join(0, timeout_s=5.0).generation == 0
    monkeypatch.setattr(context(), "membership", m)
    hc = HotSwapConfig(assignment_timeout_s=0.3)
    driver = Recovery()
    exc = SnapshotWorkerError("snapshot worker failed: No space left on device")   # a RuntimeError
    t0 = time.monotonic()
    assert driver.handle_failure(exc, Untouchable(), hc, Mode.IN_PLACE) is None
    assert time.monotonic() - t0 >= 0.3                 # the launcher's verdict was waited for, bounded
    assert driver.mode is Mode.RESTART_RESTORE and driver.recoveries == 0
    assert not store_failure(launcher, 0, "node0.0")         # nothing reported: no recovery began
    # Without a mode, nothing is even waited for.
    t0 = time.monotonic()
    assert driver.handle_failure(exc, Untouchable(), HotSwapConfig(), Mode.RESTART_RESTORE) is None
    assert time.monotonic() - t0 < 0.2


def test_a_failed_step_is_reported_to_the_coordinator_at_once_before_the_verdict(job, monkeypatch):
    """A survivor whose collective failed writes ``suspect/<worker>`` (through its membership's authenticated store
    client) the moment the driver sees the failure, long before the wait for the launcher's verdict ends: the
    coordinator reads it through the key's schema."""
    launcher, m = job
    launcher.set_json(keys.ASSIGNMENT, _assignment(0).to_json())
    assert m.join(0, timeout_s=5.0).generation == 0
    monkeypatch.setattr(context(), "membership", m)
    found: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and launcher.get(keys.suspect("node0.0")) is None:
            time.sleep(0.01)
        found.append(time.monotonic())

    t0 = time.monotonic()
    threading.Thread(target=watch, daemon=True).start()
    exc = RuntimeError("[gloo] Connection closed by peer [10.200.0.3]:40123")
    assert Recovery().handle_failure(exc, Untouchable(), HotSwapConfig(assignment_timeout_s=1.0), Mode.IN_PLACE) is None
    waited = time.monotonic() - t0
    assert waited >= 1.0 and found and found[0] - t0 < 0.5, (waited, found)
    reports = values.StoreValues(launcher).items(keys.SUSPECTS, values.suspect, values.WORKER_RE)
    assert list(reports) == ["node0.0"] and reports["node0.0"].generation == 0
    assert reports["node0.0"].what == "RuntimeError: [gloo] Connection closed by peer [10.200.0.3]:40123"


def test_a_store_that_refuses_the_report_leaves_the_heartbeat_timeout():
    class Refusing:
        worker_id = "node0.0"

        class store:   # noqa: N801 - the client's attribute name
            @staticmethod
            def set_json(key, value):
                raise ConnectionError("store unreachable")

    report_collective_failure(Refusing(), 2, RuntimeError("x"))   # no exception: best effort


def test_the_notice_that_stopped_a_step_is_its_cause(monkeypatch):
    state = notice.Interrupts()
    monkeypatch.setattr(context(), "interrupts", state)
    assert not notice.stopped(4)
    state.requested = (4, "the launcher published generation 5")
    with pytest.raises(notice.GenerationLost):
        notice._raise_if_requested(state, 4)
    assert notice.stopped(4) and not notice.stopped(5)
