"""A spare's warm parent: a spare that must start again for another node's ranks forks from a process that has
already imported the frameworks, instead of executing its script from a cold interpreter.

Why: a spare built ahead for one node's ranks takes any other node's ranks in place where it can (the relabel,
``integrations/deepspeed/takeover.py``). Where it cannot (a pipeline stage, an ``mpu``, MoE, ZeRO offload, a script
that read its rank before ``deepspeed.initialize``, another Megatron model shard), it started again from its
script's first line with ``os.execv``. That path paid the interpreter and every import again before the script's
first line: torch and DeepSpeed 1.9 s, transformers' GPT-2 modules 3 s more, on the 2-core host. It was slower than
the path where every rank rebuilds its engine (``hot_swap.in_place: false``), whose spare waits with its imports
done. A warm parent makes the start again cost what that path's spare costs: the script's prologue and its engine.

Call order (``deadpool_ext.run``, a deadpool-run spare that may build ahead, before its groups and its script):

1. :func:`hold` imports the frameworks the script imports at its top level (:data:`FRAMEWORKS` only: torch,
   DeepSpeed, transformers, Accelerate, Lightning, Megatron-Core, the project's training loop) and does what
   ``deepspeed.initialize`` would do lazily in every process (the modules it imports on first use, 1.9 s, and the
   CPU comm op: the runner's warm-up, ``integrations/deepspeed/warmup.py``), then forks. The parent never returns.
   It forwards the signals the launcher sends (:data:`FORWARDED`) to its child and waits for it;
2. the child runs as any spare: its groups, its script, its engine built ahead, the wait for an assignment;
3. a child that must start again (``spare.start_again``) calls :func:`again`, which tells the parent through a pipe
   and exits. The parent forks a fresh child, which finds itself assigned (``distributed.init_distributed``) and
   builds for its assignment. Any other end of a child ends the parent the same way: its exit status, or the same
   signal.

The fork happens before any other Python thread, CUDA context or process group exists, and is refused otherwise
(:func:`why_not`): the spare then starts again with ``os.execv``, as before, and says so in one line. A child dies
with its parent, and the parent with the launcher (``PR_SET_PDEATHSIG``): a launcher that kills the spare's process
kills the whole spare, and a spare never outlives its launcher. A child's orphan check watches its parent.
Its launcher signals a worker's whole family (``launcher/local.py``), so a pause (SIGSTOP) reaches the child too.
"""
from __future__ import annotations

import ast
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

log = logging.getLogger("deadpool_ext")

__all__ = ["FRAMEWORKS", "PARENT_NAME", "again", "hold", "is_child", "parent_pid", "script_frameworks", "why_not"]

FRAMEWORKS = ("torch", "deepspeed", "transformers", "accelerate", "lightning", "pytorch_lightning", "megatron",
              "deadpool_ext.training")
"""Packages a warm parent imports when the script imports them (or a module of theirs): heavy, and with no threads
or device context at import time (the last: the project's GPT/BERT scripts' training loop, which imports DeepSpeed
and transformers). Nothing else of the script's is run before the fork."""

FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
"""What the parent passes on to its child. SIGINT is not: a terminal's Ctrl-C reaches the whole process group,
the child included, so the parent ignores it and waits for the child's end."""

PARENT_NAME = "deadpool-warm"
"""The parent's process name (``/proc/<pid>/comm``): what a tool that looks for a worker's process by its
environment skips to find the child that runs the script (both carry the worker's variables)."""

AGAIN = b"A"
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_state: dict[str, int | None] = {"again_fd": None, "parent": None}


def is_child() -> bool:
    """Whether this process is a warm parent's child (a start again then forks anew, :func:`again`)."""
    return _state["again_fd"] is not None


def parent_pid() -> int | None:
    """A warm child's parent (the process the worker's orphan check watches instead of the launcher), else None."""
    return _state["parent"]


def script_frameworks(path: str | None, module: str | None) -> list[str]:
    """The modules of :data:`FRAMEWORKS` the script imports at its top level (pure: the file's syntax tree; a
    ``from X import name`` counts ``X`` and ``X.name``, which may be a lazily imported submodule)."""
    if path is None and module is not None:
        import importlib.util

        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return []
        path = spec.origin if spec is not None else None
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
    keep = [m for m in out if any(m == f or m.startswith(f + ".") for f in FRAMEWORKS)]
    return list(dict.fromkeys(keep))


def _import(names: Sequence[str]) -> list[str]:
    """Import ``names`` (``X.name`` that is no module: the attribute, which loads a lazy submodule); returns what
    was imported. A failure is left for the script to meet."""
    done = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            parent, _, attr = name.rpartition(".")
            if not parent or parent not in sys.modules:
                continue
            try:
                getattr(sys.modules[parent], attr)
            except Exception:  # the script's own import raises it, with the script's traceback
                continue
        except Exception:
            continue
        done.append(name)
    return done


def why_not() -> str | None:
    """Why this process cannot fork a warm child now (None: it can). Pure reads of the process."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"{sys.platform} (the warm parent needs Linux's fork and PR_SET_PDEATHSIG)"
    import threading

    # Python threads are ours or the runner's (a heartbeat, a watcher): a fork would copy none of them, and any lock
    # one held. The idle native thread torch starts at import is not counted: forking after importing torch is
    # what every DataLoader worker does.
    threads = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if threads:
        return f"{len(threads)} other thread(s) run before the script ({', '.join(sorted(threads))})"
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        return "a CUDA context exists before the script (a forked child cannot use it)"
    return None


def hold(worker_id: str, path: str | None, module: str | None,
         warm_up: Callable[[], Sequence[str]] | None = None) -> None:
    """In a spare before its groups and its script: import the script's frameworks, run ``warm_up`` (the
    framework's own work done once per process, e.g. DeepSpeed's lazily imported modules and its CPU comm op:
    ``integrations/deepspeed/warmup.py``; it returns what it did), fork, and in the parent wait for the child (never
    returning). Returns in the child, or at once (one line) where a fork is refused."""
    t0 = time.perf_counter()
    imported = _import(script_frameworks(path, module))
    if warm_up is not None:
        try:
            imported += list(warm_up())
        except Exception as exc:  # the child does it again where it needs it, and meets the error there
            log.debug("spare %s: the warm parent's warm-up failed: %s", worker_id, exc)
    import_s = time.perf_counter() - t0
    why = why_not()
    if why is not None:
        log.info("spare %s: no warm parent (%s); another node's ranks start it again with a fresh interpreter",
                 worker_id, why)
        return
    from ..recovery.timeline import write_event

    write_event(event="spare_warm_parent", worker=worker_id, pid=os.getpid(), imported=imported,
                import_s=round(import_s, 3))
    log.info("spare %s: a warm parent (pid %d) holds the imports (%s: %.1f s); another node's ranks fork a fresh child "
             "from it, not a cold interpreter", worker_id, os.getpid(), ", ".join(imported) or "none", import_s)
    _parent(worker_id)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for h in logging.getLogger().handlers + log.handlers:
        h.flush()


def _prctl(option: int, value: int | bytes) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _comm() -> bytes:
    """This process's name (Linux ``/proc/self/comm``; empty elsewhere)."""
    try:
        with open("/proc/self/comm", "rb") as f:
            return f.read().strip()[:15]
    except OSError:
        return b""


def _parent(worker_id: str) -> None:
    parent = os.getpid()
    child = 0
    n = 0
    launcher = os.getppid()
    name = _comm()  # the child takes it back
    _prctl(_PR_SET_NAME, PARENT_NAME.encode())
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))  # the parent dies with the launcher, and its child with it
    if os.getppid() != launcher:  # the launcher died before the death signal was armed
        os._exit(70)

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    while True:
        r, w = os.pipe()
        _flush()
        child = os.fork()
        if child == 0:
            os.close(r)
            _in_child(parent, w, name)
            return
        os.close(w)
        n += 1
        if n == 1:
            for s in FORWARDED:
                signal.signal(s, forward)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        status = _wait(child)
        asked = _read(r)
        if asked and os.WIFEXITED(status):
            log.info("spare %s: its child %d starts again for its assignment: a fresh child from the warm parent",
                     worker_id, child)
            continue
        _end_like(status)


def _in_child(parent: int, w: int, name: bytes) -> None:
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    _prctl(_PR_SET_NAME, name or b"python")  # the parent's name is not the child's: the one it had before is
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)
    for s in (*FORWARDED, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
    _state["again_fd"], _state["parent"] = w, parent
    from .context import context

    context().spare.times["started_at"] = time.time()  # the child's prologue starts at its fork


def _wait(child: int) -> int:
    while True:
        pid, status = os.waitpid(child, 0)  # a signal's handler runs, then the wait goes on (PEP 475)
        if pid == child and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
            return status


def _read(r: int) -> bool:
    try:
        return os.read(r, 1) == AGAIN
    except OSError:
        return False
    finally:
        os.close(r)


def _end_like(status: int) -> NoReturn:
    """The parent ends as its child did."""
    _flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # neither can be caught, so neither has a handler here
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a signal whose default is not to end the process: end anyway
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


def again() -> NoReturn:
    """In a warm parent's child: ask for a fresh child, and end this one."""
    fd = _state["again_fd"]
    assert fd is not None, "again() outside a warm parent's child"
    logging.shutdown()
    _flush()
    os.write(fd, AGAIN)
    os._exit(0)
