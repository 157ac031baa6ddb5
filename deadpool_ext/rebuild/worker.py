"""Worker side of the hot-swap protocol: join a generation, heartbeat, tear down, join the next one.

Call order (every worker started by deadpool-run; its variables are parsed once into
:class:`deadpool_ext.launcher.contract.HotSwapEnv`):

1. ``Membership.start(hot_swap_env)``; ``join(min_generation=0)`` blocks until an assignment includes this worker.
   Active workers return at once; spares block here (heartbeating) until they replace a failed node.
2. ``init_process_group(assignment)``: the generation's rendezvous under its own prefix, so nothing of a dead
   generation is ever read: in the job's authenticated coordination store (``store/rendezvous.py``; what
   deadpool-run publishes, ``master_port`` 0), or a c10d TCPStore at the assignment's ``master_port`` (test
   harnesses that serve one).
3. On a failure that ended the generation (the launcher published the next one: :meth:`Membership.verdict`,
   ``rebuild/cause.py``), the recovery driver (``rebuild/recover.py``) leaves it: ``teardown()`` cuts the
   generation's connections (``rebuild.notice``'s cut: peers still blocked in it get an error at once), destroys every
   process group and runs the teardown hooks the integrations registered (:func:`on_teardown`; DeepSpeed: its
   cached communicator state), or, in place, :func:`detach_generation`; then :func:`join_until_formed`, the one
   loop that joins the next generation until one forms. The heartbeat thread also watches ``assignment``: when the
   launcher publishes a newer generation it cuts the current one, so a rank blocked in a collective learns
   of the failure from the launcher instead of from a timeout.

Messages: the store keys this worker writes and reads (the assignment, the generation marker, heartbeats,
done, failed, fatal) are defined, with their writers, readers and values, in :mod:`deadpool_ext.launcher.keys`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ..cluster.assignment import Assignment
from ..cluster.netif import pin_gloo_interface
from ..launcher import keys, values
from ..launcher.contract import HotSwapEnv
from ..recovery.timeline import write_event
from ..store.base import parse_store_endpoints
from .context import context
from .notice import fence

log = logging.getLogger("deadpool_ext")
T = TypeVar("T")


class MembershipError(RuntimeError):
    pass


class Membership:
    def __init__(self, *, store_url: str, token: str, job_id: str, worker_id: str, node: str,
                 heartbeat_s: float = 0.5, watch_s: float = 0.5, timeout_s: float = 30.0, role: str = "active",
                 launcher_pid: int = 0) -> None:
        from ..store import connect

        self.worker_id, self.node, self.job_id, self.role = worker_id, node, job_id, role
        self.timeout_s = timeout_s
        self._launcher_pid = launcher_pid
        try:  # the fence never cuts the coordination store's connections (every member of an etcd cluster)
            ports = [port for _, port in parse_store_endpoints(store_url)[1]]
        except ValueError:
            ports = []
        fence().keep_remote_ports.update(ports)
        self.store = connect(store_url, token, job_id, timeout_s)
        self._values = values.StoreValues(self.store)  # reads through the store contract's bounded schemas
        # The heartbeat thread's own client, with a short request timeout: a member that accepts but never answers
        # (etcd without quorum) must not hold the heartbeat for the main client's timeout once the store is back.
        self._hb_store = connect(store_url, token, job_id, min(timeout_s, max(1.0, 4 * heartbeat_s)))
        self._hb_s = heartbeat_s
        self._watch_s = min(watch_s, heartbeat_s)
        self._stop = threading.Event()
        self.assignment: Assignment | None = None
        self._trained_in: int | None = None  # the generation this worker recorded its loop's end in
        threading.Thread(target=self._heartbeat, name="deadpool-heartbeat", daemon=True).start()

    @classmethod
    def start(cls, env: HotSwapEnv) -> Membership:
        """The membership client of a worker started by deadpool-run (installs the notice handler first)."""
        from . import notice

        notice.install()
        return cls(store_url=env.store_url, token=env.token, job_id=env.job_id, worker_id=env.worker_id,
                   node=env.node, heartbeat_s=env.heartbeat_s, watch_s=env.watch_s, role=env.role,
                   launcher_pid=env.launcher_pid)

    @property
    def generation(self) -> int:
        """The generation of this worker's current assignment (0 before its first)."""
        return self.assignment.generation if self.assignment is not None else 0

    def _heartbeat(self) -> None:
        """One thread, one store client: a heartbeat every ``heartbeat_s``; in between, a blocking wait (at most
        ``watch_s`` at a time) for the launcher's notification that the current generation is dead (store key
        ``gen/<g+1>``, written when generation g+1 is published). On it, this thread cuts the old generation's
        connections and stops the main thread's training step (both ``rebuild/notice.py``), so
        a survivor leaves a dead generation within a store round trip of the publication, whether it is
        blocked in a collective or computing."""
        from ..store.base import StoreError, StoreTimeout
        from . import notice, progress, warm

        # a spare's warm child: its parent is the warm parent, which dies with the launcher (rebuild/warm.py)
        launcher = warm.parent_pid() or self._launcher_pid
        next_hb = 0.0
        notified: int | None = None
        outage_since: float | None = None
        while not self._stop.is_set():
            if launcher and os.getppid() != launcher:
                # Orphaned: the launcher is gone, nobody will ever assign or fence us. Leave instead of
                # holding memory (and accelerators) forever; the node agent then frees the shared memory.
                log.error("launcher (pid %d) is gone; worker %s exits", launcher, self.worker_id)
                os._exit(70)
            try:
                now = time.monotonic()
                if now >= next_hb:
                    self._hb_store.set_json(keys.heartbeat(self.worker_id), keys.heartbeat_value(progress.sample()))
                    next_hb = now + self._hb_s
                    if outage_since is not None:
                        log.warning("worker %s: the store answers again after %.1fs", self.worker_id,
                                    time.monotonic() - outage_since)
                        outage_since = None
                f = fence()
                gen = f.generation
                if gen is None or gen == notified:
                    self._stop.wait(self._watch_s)  # a spare, or this generation's end is already handled
                    continue
                slice_s = max(0.01, min(self._watch_s, next_hb - time.monotonic()))
                try:
                    self._hb_store.wait([keys.generation(gen + 1)], slice_s)
                except StoreTimeout:
                    continue
                notified = gen
                why = f"the launcher published generation {gen + 1}"
                f.cut(gen, why)
                _abort_nccl_groups(why)
                notice.request(gen, why)
                notice.unheeded_report(gen, notice.UNHEEDED_REPORT_S)
            except StoreError as exc:
                # The store unreachable for a while (an etcd election, a partition, quorum lost): keep trying. The
                # launcher decides what an outage means (it pauses or stops this process); a heartbeat thread
                # that gave up would get a healthy worker fenced as hung once the store is back.
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("worker %s: heartbeat failed (%s); retrying", self.worker_id, exc)
                self._stop.wait(min(self._hb_s, 0.5))
            except Exception as exc:
                log.error("worker %s: heartbeat thread stops: %s: %s", self.worker_id, type(exc).__name__, exc)
                return

    def join(self, min_generation: int, timeout_s: float | None = None,
             while_waiting: Callable[[], None] | None = None) -> Assignment:
        """Block until an assignment of generation >= ``min_generation`` includes this worker; ``while_waiting()``
        is called on every turn of the wait (a spare's preparations; it keeps its own pace)."""
        deadline = time.time() + (timeout_s if timeout_s is not None else float("inf"))
        while True:
            if while_waiting is not None:
                while_waiting()
            published = self.published()
            if published is not None:
                a = published.assignment
                if a.generation >= min_generation and self.worker_id in a.ranks:
                    self.assignment = a
                    return a
                if published.stop:
                    raise MembershipError(f"launcher stopped the job: {published.stop}")
            if time.time() > deadline:
                raise MembershipError(f"worker {self.worker_id}: no assignment of generation >= {min_generation} "
                                      f"within {timeout_s:.0f}s (waited for store key {keys.ASSIGNMENT!r})")
            time.sleep(0.05)

    def published(self) -> values.Published | None:
        """The ``assignment`` the launcher published last, as read now (None: none yet, or unreadable)."""
        return self._values.get(keys.ASSIGNMENT, values.assignment)

    def job_fast_paths(self) -> values.JobFastPaths | None:
        """What the section the job's engine attached with says of the fast paths, as rank 0 wrote it at attach
        (None: no rank attached yet, or unreadable): ``rebuild/fastpaths.py``."""
        return self._values.get(keys.JOB_FAST_PATHS, values.fast_paths)

    def publish_fast_paths(self, in_place: bool, build_ahead: bool, why: str | None) -> None:
        self.store.set_json(keys.JOB_FAST_PATHS, keys.fast_paths_value(in_place, build_ahead, why))

    def verdict(self, generation: int, timeout_s: float) -> tuple[int | None, str | None]:
        """What the launcher made of ``generation`` after a failure in it, waiting at most ``timeout_s`` for it to
        publish a newer one: (the newest generation published, or None when nothing could be read; the stop
        message when it stopped the job, else None). The launcher sees every process and heartbeat, so a newer
        generation means this one lost a peer (or changes size); still ``generation`` at the deadline means it
        did not (``rebuild/cause.py``)."""
        deadline = time.monotonic() + timeout_s
        newest: int | None = None
        while True:
            published = self.published()
            if published is not None:
                newest = published.assignment.generation
                if published.stop:
                    return newest, published.stop
                if newest > generation:
                    return newest, None
            if time.monotonic() >= deadline:
                return newest, None
            time.sleep(0.05)

    def mark_trained(self, step: int, committed: int | None) -> None:
        """This worker's training loop ended after ``step`` with ``committed`` committed on every rank: the launcher
        then takes a node lost in what follows (a closing barrier, a final save) for no failure of the job's work
        (``launcher/decide.py`` ``work_done``). Best effort: without it such a loss is a failure as before."""
        try:
            self.store.set_json(keys.trained(self.worker_id), keys.trained_value(self.generation, step, committed))
            self._trained_in = self.generation
        except Exception as exc:
            log.warning("worker %s: could not record that its training loop ended (%s)", self.worker_id, exc)

    def report_failure(self, generation: int, what: str) -> None:
        try:
            self.store.set_json(keys.failure(generation, self.worker_id), keys.failure_value(what))
        except Exception:
            pass

    def mark_done(self) -> None:
        """Training finished on this worker: stop heartbeating; the launcher no longer watches for a hang
        while the interpreter shuts down (which can take seconds and stops the heartbeat thread). The script
        returned, so its loop ended too: unless the loop said so in this generation (``mark_trained``), the
        last step it noted is recorded as its end (a plain loop has no other end marker; ``launcher/done.py``)."""
        from . import progress

        step = progress.last_step()
        if step >= 0 and self._trained_in != self.generation:
            self.mark_trained(step, None)
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s
        while True:  # the launcher must learn it, or it takes the silence for a hang: retry through an outage
            try:
                self.store.set(keys.done(self.worker_id), keys.MARK)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    log.warning("worker %s: could not record that it finished (%s); its launcher reports its exit",
                                self.worker_id, exc)
                    return
                time.sleep(0.5)

    def report_fatal(self, what: str) -> None:
        """State that cannot be recovered: the launcher stops the job with this message."""
        try:
            self.store.compare_set(keys.FATAL, None, keys.fatal_value(what))
        except Exception:
            pass

    def close(self) -> None:
        self._stop.set()


def _abort_nccl_groups(why: str) -> None:
    """GPU path: a rank blocked in an NCCL collective with a dead peer is released by aborting its
    communicators (the fence cuts TCP only, and NCCL's own transports do not see a FIN). No-op for gloo
    (CPU). deadpool-run starts workers with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up, keep the
    process) unless set, so NCCL's watchdog does not end a survivor that is about to rebuild in-process.
    GPU-only: unit-tested with an NCCL stand-in (tests/unit/test_cuda_paths*.py); guarded so it never runs on CPU."""
    if not dist.is_initialized():
        return
    try:
        backend = dist.get_backend()
        if backend == "deadpool":  # in-place swap (rebuild/swap.py): the NCCL halves of the swappable groups
            from . import swap

            if swap.abort_device_communicators():
                log.warning("aborted the NCCL communicators of the dead generation (%s)", why)
            return
        if backend != "nccl":
            return
        dist.distributed_c10d._abort_process_group()  # every group, the default one included
        log.warning("aborted the NCCL communicators of the dead generation (%s)", why)
    except Exception as exc:  # already destroyed by the main thread, or an older torch without the API
        log.debug("NCCL abort: %s", exc)


def init_process_group(a: Assignment, worker_id: str, backend: str, timeout_s: float, *,
                       in_place: bool = False, solo: bool = True) -> None:
    """Build this process's default group for generation ``a``.

    ``in_place`` (``hot_swap.in_place``): the groups are swappable (``rebuild/swap.py``). A process that builds
    its first group in a generation after the first (a spare taking a node's place, or a worker whose first
    generation failed while forming) builds it *solo*: the survivors keep their framework objects and do not
    answer the collectives of an engine build, so the spare builds locally and joins the survivors before its
    restore (``Recovery.join_survivors``). In a resized generation (elastic shrink or grow, or ``solo=False``)
    every rank rebuilds, so the groups go live at once."""
    rank = a.ranks[worker_id]
    export_world(a, rank, a.nodes[worker_id])
    timeout = timedelta(seconds=timeout_s)
    _reset_group_names()
    from . import swap

    why = swap.unsupported() if in_place else None
    if why is not None:  # every rank runs the same torch: all of them decide alike
        log.warning("hot_swap.in_place: not with %s; survivors rebuild their engine after a failure", why)
    if in_place and why is None:
        swap.use()
        if a.generation > 0 and solo and not a.resized:
            context().pending_live = (a, worker_id, timeout_s)
            init_solo(rank, a.world_size, timeout_s)
            log.info("generation %d: rank %d of %d on node %s; building this rank's engine locally, it joins the "
                     "survivors' communicators at its restore", a.generation, rank, a.world_size, a.nodes[worker_id])
            return
        swap.set_mode("live")
        backend = swap.BACKEND
    store = _generation_store(a, timeout)
    _torch_init()(backend, store=store, rank=rank, world_size=a.world_size, timeout=timeout)
    log.info("generation %d: rank %d of %d on node %s", a.generation, rank, a.world_size, a.nodes[worker_id])


def _torch_init() -> Callable[..., Any]:
    # torch's own function, never a wrapper around it (the runner makes a *script's* call a no-op once a group
    # exists: patches/torch_init_process_group_once.py); a generation's group must always be built.
    return getattr(dist.init_process_group, "__wrapped__", dist.init_process_group)


def init_solo(rank: int, world_size: int, timeout_s: float) -> None:
    """This process's default group as rank ``rank`` of ``world_size``, *solo* (``rebuild/swap.py``): a spare builds
    its framework objects alone, after its assignment or ahead of any failure (``rebuild/spare.py``), and joins the
    survivors' communicators before its restore."""
    from . import swap

    swap.use()
    swap.set_mode("solo")
    _torch_init()(swap.BACKEND, store=swap.SoloStore(world_size), rank=rank, world_size=world_size,
                  timeout=timedelta(seconds=timeout_s))


def node_rank(a: Assignment, worker_id: str) -> int:
    """The index of ``worker_id``'s node among the generation's nodes, ordered by their lowest rank."""
    return a.active_nodes().index(a.nodes[worker_id])


def export_world(a: Assignment, rank: int, node: str) -> None:
    """The world of generation ``a`` as rank ``rank`` on ``node``'s place, in the environment: for frameworks that
    read it there (DeepSpeed's init_distributed, device selection, Lightning's ranks from the node rank);
    deadpool_ext itself takes it from the assignment."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.world_size), MASTER_ADDR=a.master_addr,
                      MASTER_PORT=str(a.master_port), GROUP_RANK=str(a.active_nodes().index(node)))


def _generation_store(a: Assignment, timeout: timedelta) -> Any:
    """The generation's rendezvous store, prefixed by the generation so nothing of a dead generation is ever
    read: the job's coordination store (authenticated with the token) when the assignment names no c10d port.
    Starts the fence's record of this generation's sockets."""
    fence().begin(a.generation)
    pin_gloo_interface(a.master_addr)   # gloo is unauthenticated: listen towards the launcher's --host only
    # Rendezvous may wait longer than a collective: a survivor still blocked in the previous generation is
    # only released by that generation's collective timeout, and must still find the others waiting.
    if a.master_port == 0:
        from ..store.rendezvous import TokenStore, generation_prefix

        m = context().membership
        if m is None:
            raise RuntimeError(f"generation {a.generation}: its rendezvous is in the job's store, but this process "
                               "has no membership client (not started by deadpool-run?)")
        return TokenStore(m.store, generation_prefix(a.generation), 3 * timeout,
                          dead_key=keys.generation(a.generation + 1))
    base = dist.TCPStore(a.master_addr, a.master_port, a.world_size, is_master=False, timeout=3 * timeout)
    return dist.PrefixStore(f"deadpool/gen{a.generation}", base)


def pending_live() -> tuple[Assignment, str, float] | None:
    """(assignment, worker id, collective timeout) in a process whose groups were built solo and have not
    joined their generation yet (a spare that took a node's place: ``Recovery.join_survivors``), else None."""
    return context().pending_live


def went_live() -> None:
    """The solo-built process joined its generation's communicators."""
    context().pending_live = None


def join_until_formed(m: Membership, min_generation: int, form: Callable[[Assignment], T], *,
                      leave: Callable[[], None], what: str, wait_s: float | None, retry_wait_s: float,
                      first: Assignment | None = None, while_waiting: Callable[[], None] | None = None,
                      fatal: tuple[type[BaseException], ...] = ()) -> T:
    """THE loop that joins the next generation until one forms (a worker's first join, a spare joining the
    survivors, every recovery): join a generation >= ``min_generation`` that includes this worker (``first``:
    already joined; ``wait_s``: the wait for it, None: unbounded; ``while_waiting`` as in
    :meth:`Membership.join`) and ``form(assignment)`` on it.

    A failure while it forms is decided by its cause, as a failed step is (``rebuild/cause.py``): it is logged
    (``what``), reported (``failed/<g>/<worker>``) and ``leave()`` drops what was built; if the launcher then
    publishes a newer generation within ``retry_wait_s`` (a peer was lost while this one formed), that one is
    joined; if it stops the job, :class:`MembershipError` says so; otherwise the failure is raised unchanged.
    ``fatal``: failures after which no generation can help (state gone, groups that cannot be swapped): reported
    to the launcher as fatal (it stops the job) and raised."""
    from .cause import failure_cause

    a = first
    while True:
        if a is None:
            a = m.join(min_generation, timeout_s=wait_s, while_waiting=while_waiting)
        try:
            return form(a)
        except fatal as exc:
            write_event(event="recovery_fatal", generation=a.generation, world_size=a.world_size,
                        error=type(exc).__name__)
            m.report_fatal(str(exc))
            raise
        except Exception as exc:
            log.warning("generation %d: %s (%s); waiting for the launcher's next generation", a.generation, what,
                        " ".join(str(exc).split())[:300])
            m.report_failure(a.generation, repr(exc))
            leave()
            published, stop = m.verdict(a.generation, retry_wait_s)
            if stop is not None:
                raise MembershipError(f"launcher stopped the job: {stop}") from exc
            if failure_cause(a.generation, published, stopped_by_notice=False) is None:
                raise
            min_generation, a, wait_s = a.generation + 1, None, retry_wait_s


def swap_into(a: Assignment, worker_id: str, timeout_s: float) -> None:
    """Every swappable group of this process gets a communicator of generation ``a`` (collective on each group,
    in creation order). The ranks' lists of groups are compared first, over the default group."""
    from . import swap

    rank = a.ranks[worker_id]
    export_world(a, rank, a.nodes[worker_id])
    store = _generation_store(a, timedelta(seconds=timeout_s))
    swap.set_mode("live")
    n = swap.go_live(store, a.generation, rank, check=_check_same_groups)
    log.info("generation %d: rank %d of %d on node %s (%d process group(s) swapped in place)", a.generation, rank,
             a.world_size, a.nodes[worker_id], n)


def _check_same_groups() -> None:
    """Every group a rank lists must be listed alike (name and members) by each of its members."""
    from ..cluster.comm import allgather_json
    from . import swap

    mine = swap.describe()
    everyone = allgather_json(mine)
    for r, listed in enumerate(everyone):
        for name, members in listed:
            for m in members:
                if [name, members] not in everyone[m]:
                    raise swap.SwapError(
                        f"process groups differ between ranks: rank {r} has group {name!r} of ranks {members}, "
                        f"rank {m} does not (its groups: {everyone[m]}); set deadpool.hot_swap.in_place: false")


def detach_generation(why: str) -> None:
    """In-place path: cut the dead generation's connections and park its communicators (nothing destroyed)."""
    from . import swap

    f = fence()
    if f.generation is not None:
        f.cut(f.generation, why)
    swap.detach(why)


def _reset_group_names() -> None:
    """Restart torch's process-group name counter, so the default group of every generation is named alike on
    every rank. torch names unnamed groups by a process-global counter that it bumps *before* the rendezvous
    and only resets when the default group is destroyed: a rank whose previous attempt failed while forming
    the group (a peer died during recovery) would otherwise publish its address under "1" while the others
    wait under "0", and the generation could never form (found by test_failure_during_recovery on a loaded
    host). Names need not be unique across generations: each has its own store prefix."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def teardown(timeout_s: float = 30.0) -> None:
    """Destroy every process group and DeepSpeed's cached communicator state, keeping the process.

    Bounded: gloo's shutdown joins its worker threads, and a worker blocked on a peer that is itself shutting
    down waits for the group's timeout. Past ``timeout_s`` this raises :class:`MembershipError`: the rank
    leaves (its process exits) and the launcher replaces its node, instead of everyone hanging."""
    f = fence()
    if f.generation is not None:
        f.cut(f.generation, "teardown")
    if dist.is_initialized():
        # Process groups of dead generations, kept referenced on purpose (Graveyard, rebuild/context.py): gloo's
        # destructor may block on a dead peer until the group's timeout.
        context().graveyard.keep(list(dist.distributed_c10d._world.pg_map.keys()))
        done = threading.Event()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a group whose peer died may refuse a clean shutdown; it is gone either way
                log.debug("destroy_process_group: %s", exc)
            finally:
                done.set()

        threading.Thread(target=destroy, name="deadpool-teardown", daemon=True).start()
        if not done.wait(timeout_s):
            raise MembershipError(f"could not destroy the old process groups within {timeout_s:.0f}s (a transfer is "
                                  "blocked on a peer); leaving so the launcher replaces this node")
    for hook in context().teardown_hooks:
        hook()


def on_teardown(fn: Callable[[], None]) -> None:
    """Run ``fn()`` at every teardown, after the process groups are destroyed: a framework's process-wide
    caches of the dead world (DeepSpeed registers the reset of its communicator state). Idempotent per fn."""
    hooks = context().teardown_hooks
    if fn not in hooks:
        hooks.append(fn)
