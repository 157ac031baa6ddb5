"""A survivor busy computing learns of a new generation at once, instead of at its next collective.

Why: when a peer dies mid-step, the other ranks notice only when they next communicate with it. Under ZeRO
that can be most of a forward or backward pass away, all of it spent on a step that is thrown away,
and on a shared host, CPU taken from the spare that is joining. The launcher knows sooner: its notification
(the store key ``gen/<g>``, see ``rebuild.worker.Membership``) now also stops the training step.

How (call order):

1. ``install()`` in the main thread when the worker joins the job (``rebuild.worker.Membership.start``):
   a Python-level handler for ``SIGUSR2``. No OS signal is ever sent: ``request()`` uses
   ``_thread.interrupt_main(SIGUSR2)``, which runs the handler in the main thread at its next bytecode.
2. The integration marks where an interruption is safe: ``with armed():`` around the framework's own
   forward, backward and optimizer step (DeepSpeed: ``integrations/deepspeed/runtime.py``). Those are thrown
   away by a hot-swap anyway. Never around deadpool_ext's own code (snapshot capture, store calls) or the
   script's (metrics files), which must not stop half-way.
3. The heartbeat thread calls ``request(g)`` when generation ``g`` is dead. If the main thread is inside an
   armed region of generation ``g``, :class:`GenerationLost` is raised there; otherwise nothing happens
   now, and the next armed region of generation ``g`` raises at entry. A request about an older generation
   than the process's current one is ignored, so it cannot stop the rebuilt world's first step.
4. The training loop hands the failure to the recovery driver (``rebuild/recover.py``), which recovers because
   the launcher ended the generation, not because of the exception's type; :func:`stopped` tells it that the
   notice stopped the step (the ``recover`` event's ``cause``).

A real ``SIGUSR2`` sent by someone else is passed to the handler that was installed before ours.
"""
from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

SIGNAL = signal.SIGUSR2


class GenerationLost(RuntimeError):
    """The launcher published a newer generation while this rank was computing a step of the old one."""


@dataclass
class Interrupts:
    """This process's notice state, per generation (held by ``rebuild/context.py``, so the context answers every
    "which generation" question; the functions below reach it)."""

    armed_generation: int | None = None
    """The generation whose step is running in an armed region, or None."""
    requested: tuple[int, str] | None = None
    """(dead generation, why): the launcher's notice, not yet acted on."""
    stopped: int | None = None
    """The last generation whose step a request stopped."""


# Process-wide: a signal handler is installed per process (signal.signal), not per generation.
_installed = False
_previous: Any = signal.SIG_DFL  # process-wide: the handler installed before ours, that a real SIGUSR2 goes to


def _state() -> Interrupts:
    from .context import context

    return context().interrupts


def install() -> bool:
    """Install the handler (main thread only; returns False elsewhere, and interruption stays off)."""
    global _installed, _previous
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous = signal.signal(SIGNAL, _handler)
    _installed = True
    return True


def request(generation: int, why: str) -> None:
    """Generation ``generation`` is dead: stop its step in the main thread (from any thread)."""
    _state().requested = (generation, why)
    if _installed:
        _thread.interrupt_main(SIGNAL)


def _raise_if_requested(st: Interrupts, generation: int) -> None:
    req = st.requested
    if req is not None and req[0] == generation:
        st.requested = None
        st.armed_generation = None
        st.stopped = generation
        raise GenerationLost(f"generation {generation} was abandoned: {req[1]}")


def _handler(signum: int, frame: Any) -> None:
    st = _state()
    if st.requested is None:
        prev: Callable[..., Any] | Any = _previous
        if callable(prev):
            prev(signum, frame)
        return
    if st.armed_generation is not None:
        _raise_if_requested(st, st.armed_generation)


@contextlib.contextmanager
def armed(generation: int | None) -> Iterator[None]:
    """Let the current step of ``generation`` be stopped by a request (None: not in a generation, no-op).
    Re-entrant: an inner region (e.g. DeepSpeed's step inside a wrapped call) keeps the outer one armed."""
    st = _state()
    if generation is None or not _installed or st.armed_generation is not None:
        yield
        return
    _raise_if_requested(st, generation)
    st.armed_generation = generation
    try:
        yield
    finally:
        st.armed_generation = None


def stoppable(enabled: bool) -> Any:
    """``armed(current generation)`` when ``enabled`` (the integration runs under deadpool-run with hot-swap
    on), else a no-op context: what an integration wraps around the framework's forward, backward and step."""
    if not enabled:
        return contextlib.nullcontext()
    from .context import context

    return armed(context().generation)


def forget(generation: int) -> None:
    """Recovery of ``generation`` has begun: a request about it has nothing left to stop."""
    st = _state()
    if st.requested is not None and st.requested[0] <= generation:
        st.requested = None


def stopped(generation: int) -> bool:
    """Whether the launcher's notice stopped a step of ``generation`` in this process."""
    return _state().stopped == generation
