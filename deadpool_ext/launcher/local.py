"""This host's part of a deadpool-run job: its nodes' processes and memory (every launcher has one).

:class:`LocalNodes` starts the worker processes of the nodes this launcher runs, reports their exits to the
store, carries out the fences the coordinator writes for them (``fence/<node>``: processes killed, memory
dropped, ``fenced/<node>`` acknowledged), kills a node's processes on the coordinator's own host directly, and
starts a node that a shrink dropped again once ``--repair-after-s`` passed (elastic grow: ``resize.py``).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
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
                p.kill()
        for wid in self.node_procs(node):
            p = self.procs.get(wid)
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    log.error("worker %s did not die after SIGKILL", wid)

    def drop_memory(self, node: str) -> None:
        if node in self.local:   # another host's node: its own launcher drops it when fenced
            shutil.rmtree(job_shm_dir(self.args.shm_root, self.job_id, node), ignore_errors=True)

    def signal_all(self, sig: int) -> int:
        n = 0
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
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
                p.kill()
        for node in self.local:
            self.drop_memory(node)

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
                        self.procs[wid].kill()
                shutil.rmtree(job_shm_dir(self.args.shm_root, self.job_id, node), ignore_errors=True)
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


__all__ = ["LocalNodes"]
