"""rebuild.interrupt: the launcher's notice stops an armed step of the dead generation, and nothing else."""
import os
import signal
import threading
import time

import pytest

from deadpool_ext.rebuild import interrupt
from deadpool_ext.rebuild.context import context


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """A notice state of its own (the context's) for each test."""
    monkeypatch.setattr(context(), "interrupts", interrupt.Interrupts())
    return context().interrupts


@pytest.fixture
def installed():
    before = signal.getsignal(interrupt.SIGNAL)
    calls = []
    signal.signal(interrupt.SIGNAL, lambda signum, frame: calls.append(signum))  # someone else's handler
    assert interrupt.install()
    yield calls
    signal.signal(interrupt.SIGNAL, before)
    interrupt._installed = False


def _spin(seconds: float) -> None:
    """Python bytecode in the main thread (where the handler runs), like a step's Python-level hooks."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_notice_stops_an_armed_step_of_that_generation(installed, fresh):
    with pytest.raises(interrupt.GenerationLost, match="generation 3 was abandoned: launcher says so"):
        with interrupt.armed(3):
            threading.Timer(0.05, interrupt.request, (3, "launcher says so")).start()
            _spin(5.0)
    assert fresh.armed_generation is None and fresh.requested is None and fresh.stopped == 3


def test_notice_outside_a_step_waits_for_the_next_step_of_that_generation(installed):
    interrupt.request(3, "dead")
    _spin(0.05)  # the handler ran with nothing armed: no exception here
    with pytest.raises(interrupt.GenerationLost):
        with interrupt.armed(3):
            pytest.fail("the step must not start")


def test_notice_about_an_older_generation_never_stops_the_rebuilt_world(installed):
    interrupt.request(3, "dead")
    with interrupt.armed(4):
        _spin(0.05)
    interrupt.forget(3)  # recovery of 3 began: nothing left to stop
    with interrupt.armed(3):
        _spin(0.01)


def test_nested_regions_keep_the_outer_one_armed(installed):
    with pytest.raises(interrupt.GenerationLost):
        with interrupt.armed(1):
            with interrupt.armed(1):
                pass
            threading.Timer(0.02, interrupt.request, (1, "dead")).start()
            _spin(5.0)


def test_a_real_sigusr2_goes_to_the_handler_installed_before(installed):
    with interrupt.armed(2):
        os.kill(os.getpid(), interrupt.SIGNAL)
        _spin(0.05)
    assert installed == [interrupt.SIGNAL]


def test_not_installed_or_not_in_a_generation_is_a_no_op():
    assert not interrupt._installed
    interrupt.request(5, "dead")  # no handler: nothing is delivered
    with interrupt.armed(None):
        _spin(0.01)


def test_install_refuses_outside_the_main_thread():
    result = []
    t = threading.Thread(target=lambda: result.append(interrupt.install()))
    t.start()
    t.join()
    assert result == [False] and not interrupt._installed
