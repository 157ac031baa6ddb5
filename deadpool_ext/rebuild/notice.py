"""What the launcher's notice does to a process: cut the dead generation's sockets, stop the main thread's step.

The notice: when the launcher publishes generation g+1 it writes the store key ``gen/<g+1>``; each worker's
heartbeat thread blocks on it between heartbeats (``rebuild.worker.Membership._heartbeat``) and, within a store
round trip of the publication, does two things to its own process, both here:

1. **The cut** (:class:`GenerationFence`, the context's ``fence``): every TCP connection this process opened for
   generation g is shut down, so nobody stays blocked in it.
2. **The stop** (:func:`request`): the main thread's training step of generation g raises :class:`GenerationLost`,
   so a survivor busy computing learns of the new generation at once, instead of at its next collective.

The cut
-------
Why: a gloo collective blocked on a peer only returns when a socket of that peer errors or the group's timeout
expires. A peer that is killed closes its sockets (the kernel does it), but a *survivor* that has left the
generation keeps them open as long as its process-group objects live, and those are kept alive on purpose (the
context's ``graveyard``: gloo's destructor can block). Without the cut a survivor still inside the dead generation
waits for the full collective timeout while everyone else waits for it in the next one.

What: every socket this process opened since the generation started (``begin``), except connections to the
coordination store, belongs to that generation: the c10d store client of the generation and every gloo pair of
every group built on it. ``cut()`` calls ``shutdown(SHUT_RDWR)`` on them (the descriptors stay owned by gloo, which
then sees "connection closed"), which also sends FIN to each peer, so the error cascades to every process still
blocked in the generation within milliseconds.

Call order:

1. ``fence().begin(generation)`` just before a generation's process group is created (``rebuild.worker``);
2. ``fence().cut(generation, why)`` by the survivor's teardown, and by the heartbeat thread on the notice (a
   survivor blocked in a collective with a hung peer learns of the new generation without waiting for any
   timeout).

Linux only (``/proc``); elsewhere ``cut`` does nothing and the collective timeout remains the backstop.

The stop
--------
Why: when a peer dies mid-step, the other ranks notice only when they next communicate with it. Under ZeRO that
can be most of a forward or backward pass away, all of it spent on a step that is thrown away, and on a shared
host, CPU taken from the spare that is joining. The launcher knows sooner.

How (call order):

1. ``install()`` in the main thread when the worker joins the job (``rebuild.worker.Membership.start``): a
   Python-level handler for ``SIGUSR2``. No OS signal is ever sent: ``request()`` uses
   ``_thread.interrupt_main(SIGUSR2)``, which runs the handler in the main thread at its next bytecode.
2. The integration marks where an interruption is safe: ``with armed():`` (or :func:`stoppable`) around the
   framework's own forward, backward and optimizer step (DeepSpeed: ``integrations/deepspeed/runtime.py``). Those
   are thrown away by a hot-swap anyway. Never around deadpool_ext's own code (snapshot capture, store calls) or
   the script's (metrics files), which must not stop half-way.
3. The heartbeat thread calls ``request(g)`` when generation ``g`` is dead. If the main thread is inside an armed
   region of generation ``g``, :class:`GenerationLost` is raised there; otherwise nothing happens now, and the next
   armed region of generation ``g`` raises at entry. A request about an older generation than the process's
   current one is ignored, so it cannot stop the rebuilt world's first step.
4. The training loop hands the failure to the recovery driver (``rebuild/recover.py``), which recovers because the
   launcher ended the generation, not because of the exception's type; :func:`stopped` tells it that the notice
   stopped the step (the ``recover`` event's ``cause``), and :func:`forget` drops a request once recovery began.

A real ``SIGUSR2`` sent by someone else is passed to the handler that was installed before ours.
"""
from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("deadpool_ext")

# -- the cut -----------------------------------------------------------------------------------------------------------

_LISTEN = "0A"  # TCP state code in /proc/net/tcp


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for this network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def _socket_fds() -> dict[int, int]:
    """fd -> socket inode for this process."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


class GenerationFence:
    """Tracks the sockets of the current generation of this process; see the module docstring (the cut)."""

    def __init__(self, keep_remote_ports: set[int] | None = None) -> None:
        self.keep_remote_ports = set(keep_remote_ports or ())
        self.generation: int | None = None
        self._baseline: set[int] = set()
        self._cut: set[int] = set()
        self._lock = threading.Lock()

    def begin(self, generation: int) -> None:
        with self._lock:
            self.generation = generation
            self._baseline = set(_socket_fds().values())

    def sockets(self) -> dict[int, int]:
        """fd -> inode of the live TCP connections opened since ``begin`` (store connections excluded)."""
        table = _tcp_table()
        out = {}
        for fd, inode in _socket_fds().items():
            if inode in self._baseline or inode not in table:
                continue
            _, remote, state = table[inode]
            if state == _LISTEN or remote in self.keep_remote_ports:
                continue
            out[fd] = inode
        return out

    def cut(self, generation: int, why: str) -> int:
        """Shut down the sockets of ``generation`` if it is still this process's current one; return how many."""
        with self._lock:
            if self.generation is None or self.generation != generation:
                return 0
            n = 0
            for fd, inode in self.sockets().items():
                if inode in self._cut:
                    continue
                try:
                    if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                        continue  # closed and reused meanwhile: not ours any more
                    s = socket.socket(fileno=fd)
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already disconnected
                    finally:
                        s.detach()  # the descriptor stays owned by gloo / the c10d store
                    self._cut.add(inode)
                    n += 1
                except OSError:
                    continue
            if n:
                log.warning("generation %d: cut %d connection(s) of the dead generation (%s)", generation, n, why)
            return n


def fence() -> GenerationFence:
    """This process's fence (``rebuild/context.py``). The membership client adds the coordination store's port to
    ``keep_remote_ports`` (that connection is never cut)."""
    from .context import context

    return context().fence


# -- the stop ----------------------------------------------------------------------------------------------------------

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


UNHEEDED_REPORT_S = 10.0
"""A notice that neither stopped this rank's step nor saw its recovery begin after this long prints every thread's
stack once (a rank outside any armed region and any cut connection holds up everyone's rendezvous until it gets
there; this says where it is)."""


def unheeded_report(generation: int, after_s: float, stacks: Any = None) -> threading.Timer:
    """Started by the heartbeat thread once it passed the notice of ``generation``'s end on (:func:`request`): after
    ``after_s``, if the request is still pending (the main thread neither stopped its step nor began its recovery),
    one line, a ``notice_unheeded`` timeline event and every thread's stack on ``stacks`` (default stderr, the
    worker's log); otherwise nothing."""
    import faulthandler

    from ..recovery.timeline import write_event

    def report() -> None:
        req = _state().requested
        if req is None or req[0] != generation:
            return
        log.warning("generation %d: the launcher's notice came %.0f s ago and this rank has neither stopped its step "
                    "nor begun its recovery; every thread's stack follows (where it is)", generation, after_s)
        write_event(event="notice_unheeded", generation=generation, after_s=after_s, pid=os.getpid())
        faulthandler.dump_traceback(all_threads=True, **({} if stacks is None else {"file": stacks}))

    timer = threading.Timer(after_s, report)
    timer.daemon = True
    timer.start()
    return timer


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
