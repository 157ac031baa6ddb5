"""Process-group start-up that survives launcher restarts.

Why not plain ``init_process_group("env://")``: under torchrun workers share the launcher's
rendezvous TCPStore, which is kept across restart attempts without a per-attempt prefix
(pytorch/pytorch#135712). A relaunched gloo group can read the dead attempt's addresses and hang while
connecting. We build the group on the same store, prefixed by ``TORCHELASTIC_RESTART_COUNT``, so each attempt
has its own key space. Users run plain torchrun and need not set any variable.

Under deadpool-run the start-up also makes the process's membership client; it, and with it the generation and
the role, is the process's context's (``rebuild/context.py``), where every module reads it.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .cluster.netif import pin_gloo_interface
from .config import HotSwapConfig
from .launcher.contract import WorkerEnv, worker_env
from .rebuild.context import context
from .rebuild.fastpaths import FastPaths
from .recovery.timeline import write_event
from .store.c10d import serve_c10d_store

if TYPE_CHECKING:
    from .cluster.assignment import Assignment

log = logging.getLogger("deadpool_ext")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def on_spare_wait(fn: Callable[[], None]) -> None:
    """Run ``fn()`` in a spare before it blocks for an assignment: what an integration can warm up before it
    knows its ranks (DeepSpeed: lazy imports, the communication op). A failure is logged, never raised."""
    warmups = context().spare_warmups
    if fn not in warmups:
        warmups.append(fn)


def init_distributed(backend: str | None = None, timeout_s: float | None = None, *, in_place: bool = False,
                     build_ahead: bool = False, fast: FastPaths | None = None) -> None:
    """Initialise the default process group from launcher environment variables (torchrun, deepspeed,
    deadpool-run). Idempotent. Raises a clear error when the variables are missing instead of falling back
    to MPI discovery as DeepSpeed does. Under deadpool-run a spare blocks here until it replaces a node.

    ``timeout_s``: the collective timeout; pass the config's ``hot_swap.collective_timeout_s`` (under
    deadpool-run it is only the backstop: the launcher's next generation cuts a dead one). Default: that key's
    default under deadpool-run, 300 s otherwise. ``in_place``: the config's ``hot_swap.in_place`` where the
    integration supports it (DeepSpeed): under deadpool-run the groups are swappable (``rebuild/swap.py``).
    ``build_ahead``: the config's ``hot_swap.spare_build_ahead``; with ``in_place`` a spare builds its groups solo
    for the ranks it shadows and returns at once, so that the script builds its engine before any failure
    (``rebuild/spare.py``); it waits for its assignment at the end of the engine's build. ``fast``: the runner's
    reading of both, with the real reason one is off, or the defaults assumed when no config was visible
    (``rebuild/fastpaths.py``); it replaces ``in_place`` and ``build_ahead``."""
    if dist.is_initialized():
        return
    # `kill -USR1 <pid>` prints every thread's stack: the first tool to reach for when a rank seems stuck.
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if fast is None:
        fast = FastPaths(in_place, in_place and build_ahead,
                         None if in_place and build_ahead else
                         f"init_distributed({'build_ahead' if in_place else 'in_place'}=False)")
    env = worker_env()
    if env.hot_swap is not None:
        from .rebuild.fastpaths import groups_in_place
        from .rebuild.worker import Membership, init_process_group, join_until_formed, teardown

        m = context().membership = Membership.start(env.hot_swap)
        timeout = HotSwapConfig().collective_timeout_s if timeout_s is None else timeout_s
        prepare = (_spare_slots(env) if env.hot_swap.role == "spare" and env.hot_swap.spare_slots == "prepare"
                   else None)
        if env.hot_swap.role == "spare":
            from .rebuild.spare import build_ahead as ahead

            if ahead(m, m.worker_id, m.node, timeout, fast=fast, while_waiting=prepare):
                destroy_groups_at_exit()
                return
            _warm_up_spare()
            log.info("spare %s on %s: ready, waiting for an assignment", m.worker_id, m.node)

        def form(assignment: Assignment) -> None:
            if env.hot_swap is not None and env.hot_swap.role == "spare":
                from .rebuild.spare import assigned

                context().spare.times.setdefault("assigned_at", time.time())
                assigned(m.worker_id, assignment)
            live = groups_in_place(fast, None if fast.known else m.job_fast_paths(), assignment.generation)
            init_process_group(assignment, m.worker_id, backend or default_backend(), timeout, in_place=live)
            destroy_groups_at_exit()

        # A peer that dies while the first generation forms (e.g. a spare joining as another node fails): the
        # launcher's next generation is joined instead of leaving, which would cost a spare.
        join_until_formed(m, 0, form, leave=teardown, what="could not form the process group", wait_s=None,
                          retry_wait_s=3 * timeout, while_waiting=prepare)
        return
    _init_from_launcher(env, backend or default_backend(), 300.0 if timeout_s is None else timeout_s)


def _init_from_launcher(env: WorkerEnv, backend: str, timeout_s: float) -> None:
    missing = env.missing_for_init()
    if missing:
        raise RuntimeError(
            f"deadpool_ext: cannot start torch.distributed: environment variables {missing} are not set. "
            "Launch with torchrun, the deepspeed launcher or deadpool-run, e.g. "
            "`torchrun --nproc-per-node 2 scripts/pretrain_gpt.py ...`"
        )
    assert env.rank is not None and env.world_size is not None and env.master_addr and env.master_port
    timeout = timedelta(seconds=timeout_s)
    # gloo is unauthenticated: listen on the interface towards MASTER_ADDR only (docs/security.md).
    pin_gloo_interface(env.master_addr)
    if env.agent_store:
        base = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"deadpool/attempt_{env.restart_count}", base)
        log.debug("process group on launcher store, prefix attempt_%s", env.restart_count)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        write_event(event="process_group", store="agent_attempt_prefixed", attempt=env.restart_count, rank=env.rank)
    else:
        # Not init_method="env://": its rank 0 serves the store on every interface (torch's TCPStore binds
        # "::" whatever the host); here rank 0 serves it on MASTER_ADDR only.
        if env.rank == 0:
            base, _ = serve_c10d_store(env.master_addr, env.world_size, port=env.master_port, timeout_s=timeout_s)
            context().served_stores.append(base)  # the c10d store rank 0 serves, alive as long as the process
        else:
            base = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=base, rank=env.rank, world_size=env.world_size, timeout=timeout)
        write_event(event="process_group", store="rank0_served", attempt=env.restart_count, rank=env.rank)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    destroy_groups_at_exit()


def destroy_groups_at_exit() -> None:
    """Destroy this process's process groups at interpreter exit, while the interpreter is still whole (idempotent).

    Why: gloo's worker threads may still hold the work objects of finished collectives, with tensors that hold
    Python references; if the groups are torn down during interpreter finalization instead, releasing those
    tensors takes the GIL of a dying interpreter and the process aborts ("terminate called without an active
    exception", SIGABRT) after the job itself has finished (pytorch/pytorch#179291). ``atexit`` runs handlers in
    reverse order of registration: this one is registered when the group is built, before any runtime registers
    its ``close``, so the snapshot worker has stopped before the groups go. Bounded: past 10 s (a group blocked on
    a dead peer) the exit goes on without it."""
    ctx = context()
    if ctx.exit_registered:
        return
    ctx.exit_registered = True
    import atexit

    atexit.register(_destroy_groups)


_GIL_YIELD_S = 0.05


def _destroy_groups(timeout_s: float = 10.0) -> None:
    import threading

    from .rebuild import swap

    def destroy() -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # a group whose peer is gone may refuse a clean shutdown; exiting anyway
            log.debug("destroy_process_group at exit: %s", exc)
        swap.forget_all()  # the swappable groups' communicators (frameworks still hold the groups themselves)

    t = threading.Thread(target=destroy, name="deadpool-exit-groups", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("process groups not destroyed within %.0f s at exit (a transfer blocked on a peer)", timeout_s)
    # Groups a framework still holds (torch's own gloo groups under DeepSpeed) keep their worker threads until
    # finalization: a worker that has just finished a collective releases its tensors next, which takes the GIL.
    # Hand the GIL over for a moment so that it does so while the interpreter is whole (the same abort otherwise).
    time.sleep(_GIL_YIELD_S)


def _spare_slots(env: WorkerEnv) -> Callable[[], None]:
    """A spare's wait also makes its snapshot slots, once their size is published (``snapshot/spare_slots.py``)."""
    from .snapshot import spare_slots

    hs, m = env.hot_swap, context().membership
    assert hs is not None and m is not None
    local = env.local_rank or 0
    root = hs.shm_root or spare_slots.SHM_ROOT
    return functools.partial(spare_slots.tick, m.store, root, hs.job_id, hs.node, local)


def _warm_up_spare() -> None:
    """What a spare can do before it knows its ranks, so that it is not the last one after an assignment
    (the callbacks integrations registered with :func:`on_spare_wait`)."""
    for fn in context().spare_warmups:
        try:
            fn()
        except Exception as exc:  # only an optimisation: the framework does it (or fails clearly) later
            log.warning("spare: warm-up %s failed (%s); it happens after the assignment instead",
                        getattr(fn, "__qualname__", fn), exc)

