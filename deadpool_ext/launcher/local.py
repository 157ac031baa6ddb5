"""This host's part of a deadpool-run job: its nodes' processes and memory (every launcher has one).

:class:`LocalNodes` starts the worker processes of the nodes this launcher runs, reports their exits to the
store, carries out the fences the coordinator writes for them (``fence/<node>``: processes killed, memory
dropped, ``fenced/<node>`` acknowledged), kills a node's processes on the coordinator's own host directly, and
starts a node that a shrink dropped again once ``--repair-after-s`` passed (elastic grow: ``resize.py``).

A node's memory is dropped in two parts. Its directory is renamed out of the way at once (one ``rename``: from
then on nothing of the job finds it, and a node started again gets an empty one), and the renamed directory is
removed by a background thread at a lowered priority. Removing it there and then was on the recovery's critical
path: freeing the pages of a GPT-medium node's slots and replicas (about 2 GB of tmpfs) took 0.26 s on a quiet
2-core host and about 0.4 s on a busy one, before the coordinator could publish the new assignment. The end of the
job (:meth:`LocalNodes.stop_all`) waits for every removal; a launcher that leaves at once (a self-fence) removes
in the foreground.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..cluster.assignment import Worker
from ..memory.shm import job_shm_dir
from . import contract, keys
from .args import malloc_env
from .contract import HotSwapEnv

log = logging.getLogger("deadpool_ext.launcher")


class LocalNodes:
    """The processes of the nodes this launcher runs (``local``), and their tier-1 memory."""

    def __init__(self, args: Any, job_id: str, token: str, workers: Iterable[Worker], local: set[str],
                 event: Callable[..., None]) -> None:
        self.args, self.job_id, self.token, self.event = args, job_id, token, event
        self.workers = [w for w in workers if w.node in local]
        self.local = set(local)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.store_url = ""
        self._reported: set[str] = set()   # workers whose exit is in the store (or whose node was fenced)
        self._fenced: set[str] = set()
        self._arena_logged = False
        self._removals: list[threading.Thread] = []
        self._dropped = 0

    def node_procs(self, node: str) -> list[str]:
        return [w.worker_id for w in self.workers if w.node == node]

    # -- processes ----------------------------------------------------------------------------------------------
    def spawn(self, w: Worker, role: str) -> None:
        env = dict(os.environ)
        env.pop(contract.NO_SPARE_POLICY, None)  # set below only when this launcher was given the flag
        env.update(HotSwapEnv(store_url=self.store_url, token=self.token, job_id=self.job_id, worker_id=w.worker_id,
                              node=w.node, role=role, launcher_pid=os.getpid(), heartbeat_s=self.args.heartbeat_s,
                              watch_s=self.args.watch_s, shm_root=self.args.shm_root,
                              no_spare_policy=self.args.no_spare_policy or None,
                              spare_slots=getattr(self.args, "spare_slots", "prepare"),
                              preempt_grace_s=getattr(self.args, "preempt_grace_s", None)).to_environ())
        env.update({
            contract.LOCAL_RANK: str(w.local_index), contract.LOCAL_WORLD_SIZE: str(self.args.nproc_per_node),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
            # GPU path: on an NCCL error, abort the communicators but keep the process (it rebuilds in-process).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
        })
        env.update(malloc_env(self.args.malloc_arena_max, os.environ, log=not self._arena_logged))
        self._arena_logged = True
        if self.args.timeline:
            env[contract.TIMELINE] = os.path.abspath(self.args.timeline)
        for k in (contract.RANK, contract.WORLD_SIZE, contract.MASTER_ADDR, contract.MASTER_PORT,
                  contract.USE_AGENT_STORE):
            env.pop(k, None)
        # Through the runner: the hook on deepspeed.initialize and the process group exist before the script starts.
        self.procs[w.worker_id] = subprocess.Popen([sys.executable, "-m", "deadpool_ext.run", self.args.script,
                                                    *self.args.script_args], env=env)

    def exits(self) -> dict[str, int]:
        """Exit status of every local process that exited."""
        return {wid: rc for wid, p in self.procs.items() if (rc := p.poll()) is not None}

    def kill(self, node: str) -> None:
        """SIGKILL every process of a local ``node`` and reap it."""
        for wid in self.node_procs(node):
            p = self.procs.get(wid)
            if p is not None and p.poll() is None:
                _kill(p)
        for wid in self.node_procs(node):
            p = self.procs.get(wid)
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    log.error("worker %s did not die after SIGKILL", wid)

    def drop_memory(self, node: str, *, wait: bool = False) -> None:
        """Drop a local ``node``'s tier-1 memory: gone under its name at once, its pages freed in the background
        (``wait``: here and now)."""
        if node in self.local:   # another host's node: its own launcher drops it when fenced
            self._drop(job_shm_dir(self.args.shm_root, self.job_id, node), wait=wait)

    def _drop(self, path: str, *, wait: bool) -> None:
        self._dropped += 1
        parent, name = os.path.split(path)
        # hidden, and without the "deadpool." prefix that every listing of the shm root matches
        gone = os.path.join(parent, f".dropped-{name}-{os.getpid()}-{self._dropped}")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        except OSError as exc:   # cannot rename (another filesystem's rules): remove it in place
            log.debug("rename of %s: %s; removing it in place", path, exc)
            gone = path
        if wait:
            shutil.rmtree(gone, ignore_errors=True)
            return
        t = threading.Thread(target=_remove_quietly, args=(gone,), name=f"drop-{name}")
        t.start()
        self._removals = [r for r in self._removals if r.is_alive()] + [t]

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for the background removals of dropped memory (the end of the job)."""
        deadline = time.monotonic() + timeout_s
        for t in self._removals:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("the removal of dropped node memory (%s) still runs after %.0f s; leaving it", t.name,
                            timeout_s)
        self._removals = []

    def signal_all(self, sig: int) -> int:
        """``sig`` to every running worker and its children (a spare's warm parent and its child: a SIGSTOP, which
        no parent can pass on, must reach the child too)."""
        n = 0
        for p in self.procs.values():
            if p.poll() is None:
                for pid in family(p.pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        continue
                n += 1
        return n

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                _kill(p)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", p.pid)

    def stop_all(self) -> None:
        """At the end of the job: SIGTERM, SIGKILL after 10 s; every local node's memory dropped."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _kill(p)
        for node in self.local:
            self.drop_memory(node)
        self.settle()

    # -- every turn -----------------------------------------------------------------------------------------------
    def report_exits(self, store: Any) -> None:
        for wid, p in self.procs.items():
            rc = p.poll()
            if rc is not None and wid not in self._reported:
                # every exit, a clean one too: a worker that finished while the store was unreachable could not
                # record done/<worker>, and the coordinator must not take its silence for a hang
                store.set_json(keys.exit_of(wid), keys.exit_value(rc))
                self._reported.add(wid)   # only once it is written: an outage leaves it for the next turn

    def obey_fences(self, store: Any) -> None:
        for node in sorted(self.local - self._fenced):
            if store.get(keys.fence(node)) is not None:
                self._fenced.add(node)
                for wid in self.node_procs(node):
                    self._reported.add(wid)
                    if self.procs[wid].poll() is None:
                        _kill(self.procs[wid])
                self.drop_memory(node)
                store.set(keys.fenced(node), keys.MARK)

    def restart(self, node: str, store: Any) -> None:
        """Start a local ``node`` again as a spare (a repaired machine): what its dead processes and its fence left
        in the store is cleared first."""
        for w in self.workers:
            if w.node != node:
                continue
            for k in keys.worker_keys(w.worker_id):
                store.delete(k)
            self._reported.discard(w.worker_id)
            self.spawn(w, "spare")
        for k in keys.node_keys(node):
            store.delete(k)
        self._fenced.discard(node)


def family(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (psutil: a descendant started before ``pid``, i.e. a reused pid,
    is not one; ``pid`` alone once it is gone)."""
    import psutil

    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return [pid]


def _kill(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a worker and its children (a spare's warm child dies with its parent as well, but only once the
    kernel has ended the parent: a fenced node must run nothing by the time it is reaped)."""
    for pid in reversed(family(p.pid)[1:]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    p.kill()


def _remove_quietly(path: str) -> None:
    """A background removal gives way to the recovery it would slow (nice 10; best effort)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


__all__ = ["LocalNodes"]
