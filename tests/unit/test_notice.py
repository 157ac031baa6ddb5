"""rebuild/notice.py, the stop: the launcher's notice stops an armed step of the dead generation, and nothing else."""
import os
import signal
import threading
import time

import pytest

from deadpool_ext.rebuild import notice
from deadpool_ext.rebuild.context import context


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """A notice state of its own (the context's) for each test."""
    monkeypatch.setattr(context(), "interrupts", notice.Interrupts())
    return context().interrupts


@pytest.fixture
def installed():
    before = signal.getsignal(notice.SIGNAL)
    calls = []
    signal.signal(notice.SIGNAL, lambda signum, frame: calls.append(signum))  # someone else's handler
    assert notice.install()
    yield calls
    signal.signal(notice.SIGNAL, before)
    notice._installed = False


def _spin(seconds: float) -> None:
    """Python bytecode in the main thread (where the handler runs), like a step's Python-level hooks."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_notice_stops_an_armed_step_of_that_generation(installed, fresh):
    with pytest.raises(notice.GenerationLost, match="generation 3 was abandoned: launcher says so"):
        with notice.armed(3):
            threading.Timer(0.05, notice.request, (3, "launcher says so")).start()
            _spin(5.0)
    assert fresh.armed_generation is None and fresh.requested is None and fresh.stopped == 3


def test_notice_outside_a_step_waits_for_the_next_step_of_that_generation(installed):
    notice.request(3, "dead")
    _spin(0.05)  # the handler ran with nothing armed: no exception here
    with pytest.raises(notice.GenerationLost):
        with notice.armed(3):
            pytest.fail("the step must not start")


def test_notice_about_an_older_generation_never_stops_the_rebuilt_world(installed):
    notice.request(3, "dead")
    with notice.armed(4):
        _spin(0.05)
    notice.forget(3)  # recovery of 3 began: nothing left to stop
    with notice.armed(3):
        _spin(0.01)


def test_nested_regions_keep_the_outer_one_armed(installed):
    with pytest.raises(notice.GenerationLost):
        with notice.armed(1):
            with notice.armed(1):
                pass
            threading.Timer(0.02, notice.request, (1, "dead")).start()
            _spin(5.0)


def test_a_real_sigusr2_goes_to_the_handler_installed_before(installed):
    with notice.armed(2):
        os.kill(os.getpid(), notice.SIGNAL)
        _spin(0.05)
    assert installed == [notice.SIGNAL]


def test_not_installed_or_not_in_a_generation_is_a_no_op():
    assert not notice._installed
    notice.request(5, "dead")  # no handler: nothing is delivered
    with notice.armed(None):
        _spin(0.01)


def test_install_refuses_outside_the_main_thread():
    result = []
    t = threading.Thread(target=lambda: result.append(notice.install()))
    t.start()
    t.join()
    assert result == [False] and not notice._installed
