"""Process-group start-up that survives launcher restarts.

Why not plain ``init_process_group("env://")``: under torchrun (torch 2.13) workers share the launcher's
rendezvous TCPStore, which is kept across restart attempts without a per-attempt prefix
(pytorch/pytorch#135712). A relaunched gloo group can read the dead attempt's addresses and hang while
connecting. We build the group on the same store, prefixed by ``TORCHELASTIC_RESTART_COUNT``, so each attempt
has its own key space. Users run plain torchrun and need not set any variable.
"""
from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("deadpool_ext")

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


_membership = None


def membership():
    """The hot-swap membership client when launched by deadpool-run, else None."""
    return _membership


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from launcher environment variables (torchrun, deepspeed,
    deadpool-run). Idempotent. Raises a clear error when the variables are missing instead of falling back
    to MPI discovery as DeepSpeed does. Under deadpool-run a spare blocks here until it replaces a node."""
    global _membership
    if dist.is_initialized():
        return
    # `kill -USR1 <pid>` prints every thread's stack: the first tool to reach for when a rank seems stuck.
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get("DEADPOOL_STORE"):
        from .rebuild.worker import Membership, init_process_group

        _membership = Membership.from_env()
        if os.environ.get("DEADPOOL_ROLE") == "spare":
            _warm_up_spare()
            log.info("spare %s on %s: ready, waiting for an assignment", _membership.worker_id, _membership.node)
        # The first generation's collectives use the hot-swap budget (hot_swap.collective_timeout_s's default),
        # not the generic 300 s: it is only the backstop, since the launcher's next generation cuts this one.
        timeout_s = float(os.environ.get("DEADPOOL_COLLECTIVE_TIMEOUT_S", "60"))
        min_gen, wait_s = 0, None
        while True:
            assignment = _membership.join(min_gen, timeout_s=wait_s)
            try:
                init_process_group(assignment, _membership.worker_id, backend or default_backend(), timeout_s)
                return
            except RuntimeError as exc:
                # A peer died while this generation was forming (e.g. a spare joining as another node fails):
                # wait for the launcher's next generation instead of leaving, which would cost a spare.
                from .rebuild.worker import teardown

                log.warning("generation %d: could not form the process group (%s); waiting for the next "
                            "assignment", assignment.generation, " ".join(str(exc).split())[:300])
                _membership.report_failure(assignment.generation, repr(exc))
                teardown()
                min_gen, wait_s = assignment.generation + 1, 3 * timeout_s
    missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"deadpool_ext: cannot start torch.distributed: environment variables {missing} are not set. "
            "Launch with torchrun, the deepspeed launcher or deadpool-run, e.g. "
            "`torchrun --nproc-per-node 2 scripts/pretrain_gpt.py ...`"
        )
    backend = backend or default_backend()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"deadpool/attempt_{attempt}", base)
        log.debug("process group on launcher store, prefix attempt_%s", attempt)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _warm_up_spare() -> None:
    """What a spare can do before it knows its ranks, so that it is not the last one after an assignment:
    DeepSpeed's lazy imports and its communication op (see :mod:`deadpool_ext.integrations.deepspeed.warmup`)."""
    from .integrations.deepspeed.warmup import import_lazy_modules, preload_comm_op

    try:
        imports_s, op_s = import_lazy_modules(), preload_comm_op()
    except Exception as exc:  # only an optimisation: deepspeed.initialize does it (or fails clearly) later
        log.warning("spare: could not warm DeepSpeed up (%s); it does so after its assignment", exc)
        return
    if op_s is not None or imports_s > 0.01:
        log.info("spare: DeepSpeed warmed up while waiting (lazy imports %.2f s, comm op %s)", imports_s,
                 "n/a" if op_s is None else f"{op_s:.2f} s")


def default_job_id() -> str:
    """A name shared by every rank of one job, stable across restarts of the job's workers."""
    for key in ("DEADPOOL_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key)
        if value and value != "none":
            return "".join(c if c.isalnum() or c in "_-" else "_" for c in value)[:64]
    addr = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
    return "j" + hashlib.sha1(addr.encode()).hexdigest()[:12]


def node_name() -> str:
    """Failure-domain name of this process: the launcher's simulated node, else the host name."""
    return os.environ.get("DEADPOOL_NODE") or os.uname().nodename
