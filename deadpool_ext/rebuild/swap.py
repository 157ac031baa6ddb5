"""In-place communicator swap: process groups whose communicator is replaced under the objects that hold them.

Why: a framework (DeepSpeed's engine and ZeRO optimizer, Accelerate, the HF Trainer, Lightning) keeps references
to the process groups it was built with, in dozens of places. Destroying the groups after a failure means
rebuilding every object that holds one, and keeping the old objects alive (the survivor's memory grew by the size
of a second engine per hot-swap). Here the groups themselves stay: each is a :class:`SwappableGroup` (a Python
``torch.distributed.ProcessGroup``, registered as the c10d backend ``"deadpool"``) that forwards every collective
to an *inner* process group. A hot-swap replaces only the inner groups, built on the new generation's store; every
reference a framework holds keeps working.

The inner communicator follows torch's ``"cpu:gloo,cuda:nccl"`` pattern: on a CPU-only job it is one gloo group;
with CUDA it is a :class:`DeviceSplit`, a gloo group for host tensors beside an NCCL group for device tensors, and
each collective goes to the one for its tensors' device. The group advertises CPU and CUDA, and torch and the
frameworks issue host-tensor collectives on the default group (object collectives, ``barrier``), which NCCL
refuses.

Modes of a process (the context's ``swap_mode``, set by the worker before any group exists):

- **live** (default): a group's inner communicator is built when the group is created, on the store torch gives.
- **solo**: a spare building its framework objects *before* it joins the survivors' collectives (survivors do
  not rebuild theirs, so nobody would answer). A solo group computes each collective locally as if every rank
  had contributed the same tensor (all-reduce SUM = size x own, all-gather = own repeated, broadcast = own, a
  point-to-point receive = own, a send dropped):
  exact for the symmetric set-up collectives frameworks issue (shapes, counts, flags) and harmless for values
  (weights, optimizer state) that the restore from memory overwrites next. :func:`go_live` then swaps every
  group onto the generation's real communicator, collective for collective with the survivors' swap.

Call order (every rank of a generation):

1. ``use()`` before the default group is created (``rebuild.worker.init_process_group``), then torch's
   ``init_process_group(backend=BACKEND, ...)``; frameworks create subgroups with ``new_group`` as usual (the
   default backend is this one, so they are swappable too); ``backend=GLOO_BACKEND`` makes a swappable group
   whose inner communicator is always gloo (the snapshot side group).
2. Failure: :func:`detach` (every inner group of the dead generation parked, further use raises
   :class:`GroupDetached`), then after the next assignment :func:`go_live(store, generation)` on every rank:
   each group (ascending creation order; a rank only builds the groups it is in, which cannot deadlock) gets a
   new inner communicator under ``<group name>/`` of the generation's store; its ``check``
   (``rebuild/worker.py`` ``_check_same_groups``) first compares every rank's list of groups (a mismatch is an
   error naming both lists, never a hang).

Ranks keep their rank through a swap (the spare takes the failed node's ranks); a rank change is refused, except
a spare's, before it goes live: built solo for one rank, it may take another of the same world (:func:`relabel`,
when :func:`relabel_refusal` finds every group it is in spanning the world).
"""
from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import progress
from .context import context

log = logging.getLogger("deadpool_ext")

BACKEND = "deadpool"
"""The c10d backend name of swappable groups whose inner communicator is the default one: gloo on a CPU-only job,
gloo for host tensors beside NCCL for device tensors with CUDA (:class:`DeviceSplit`)."""
GLOO_BACKEND = "deadpool_gloo"
"""Swappable groups whose inner communicator is always gloo (host-memory traffic, e.g. snapshots)."""

# Every collective of torch 2.x's ProcessGroup; each is forwarded unchanged to the inner process group.
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "barrier", "monitored_barrier", "reduce",
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "all_gather_single_coalesced", "_allgather_base",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter",
    "send", "recv", "recv_anysource", "_start_coalescing", "_end_coalescing",
)


class GroupDetached(RuntimeError):
    """A collective on a group whose generation is gone (between :func:`detach` and :func:`go_live`)."""


class SwapError(RuntimeError):
    """The groups cannot be swapped in place (ranks differ in their groups, or a rank changed)."""


_lock = threading.Lock()  # guards the context's swappable_groups (the mode and the groups: rebuild/context.py)


def set_mode(mode: str) -> None:
    """``"live"`` or ``"solo"`` (see the module docstring) for the groups created from now on."""
    if mode not in ("live", "solo"):
        raise ValueError(f"swap mode must be 'live' or 'solo', got {mode!r}")
    context().swap_mode = mode


def mode() -> str:
    return context().swap_mode


def default_inner() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def build_inner(kind: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """The inner communicator of a swappable group: gloo (``kind`` "gloo"), or for "nccl" a :class:`DeviceSplit`
    of gloo for host tensors and NCCL for device tensors, each on its own prefix of ``store`` (as torch prefixes
    each device's backend)."""
    if kind == "nccl":  # GPU path (guarded: never built on CPU machines)
        return DeviceSplit(cpu=build_backend("gloo", dist.PrefixStore("cpu/", store), rank, size, timeout),
                           device=build_backend("nccl", dist.PrefixStore("cuda/", store), rank, size, timeout))
    return build_backend(kind, store, rank, size, timeout)


def build_backend(kind: str, store: Any, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A real torch ProcessGroup with one backend (gloo for host tensors, NCCL for CUDA ones)."""
    pg = dist.ProcessGroup(store, rank, size)
    if kind == "nccl":  # GPU path (guarded: never built on CPU machines)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
        btype, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        btype, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    backend._set_sequence_number_for_group()
    pg._set_default_backend(btype)
    pg._register_backend(device, btype, backend)
    return pg


class DeviceSplit:
    """torch's ``cpu:gloo,cuda:nccl`` pattern as an inner communicator: every collective goes to ``cpu`` (gloo)
    when its tensors are in host memory and to ``device`` (NCCL) otherwise. A collective without tensors
    (``barrier``, ``_start_coalescing``) goes by the device in its options or arguments, host when none is
    named; ``monitored_barrier`` exists only in gloo."""

    def __init__(self, cpu: Any, device: Any) -> None:
        self.cpu, self.device = cpu, device

    def pick(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The communicator collective ``name`` called with these arguments goes to."""
        if name == "monitored_barrier":
            return self.cpu
        dev = _device_of([*args, *kwargs.values()])
        return self.cpu if dev is None or dev.type == "cpu" else self.device

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.pick(name, args, kwargs), name)(*args, **kwargs)
        return call


def _device_of(items: list[Any], depth: int = 0) -> torch.device | None:
    """The device of the first tensor in ``items`` (nested lists, as collectives take them); else a device that
    an options object (``BarrierOptions.device``) or an argument names; None if there is none."""
    for x in items:
        if isinstance(x, torch.Tensor):
            return x.device
        if isinstance(x, (list, tuple)) and depth < 3:
            found = _device_of(list(x), depth + 1)
            if found is not None:
                return found
    for x in items:
        if isinstance(x, torch.device):
            return x
        dev = getattr(x, "device", None)
        if isinstance(dev, torch.device):
            return dev
    return None


class _Dead:
    """The inner group between a generation's end and the next one: every collective raises."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __getattr__(self, name: str) -> Any:
        def refuse(*_a: Any, **_k: Any) -> Any:
            raise GroupDetached(f"process group used after its generation ended ({self.why})")
        return refuse


class _Solo:
    """Collectives computed locally, as if every rank of ``size`` contributed this rank's tensors."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @staticmethod
    def _done() -> Any:
        """A completed Work (the collective ran synchronously)."""
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.set_result([])
        return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]

    def _reduce(self, t: torch.Tensor, op: Any) -> None:
        if op == dist.ReduceOp.SUM:
            t.mul_(self.size)
        elif op == dist.ReduceOp.PRODUCT:
            t.pow_(self.size)
        # MIN, MAX, AVG, BAND, BOR, BXOR(of equal values is 0 only for even sizes: not used by frameworks' set-up)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        for t in tensors:
            self._reduce(t, op)
        return self._done()

    allreduce_coalesced = allreduce

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._done()

    def barrier(self, opts: Any = None) -> Any:
        return self._done()

    def monitored_barrier(self, *_a: Any, **_k: Any) -> None:
        return None

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for outs, inp in zip(outputs, inputs):
            for o in outs:
                o.copy_(inp)
        return self._done()

    allgather_coalesced = allgather

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        for chunk in output.view(self.size, -1):
            chunk.copy_(inp.reshape(-1))
        return self._done()

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i)
        return self._done()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        for o, ins in zip(outputs, inputs):
            o.copy_(ins[self.rank])
            self._reduce(o, op)
        return self._done()

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        output.copy_(inp.reshape(self.size, -1)[self.rank].view_as(output))
        self._reduce(output, op)
        return self._done()

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return self._done()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for o in outputs:
            o.copy_(inputs[self.rank])
        return self._done()

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, out_splits: Any = None,
                          in_splits: Any = None, opts: Any = None) -> Any:
        if out_splits or in_splits:
            raise SwapError("solo process group: all_to_all_single with uneven splits during a spare's set-up")
        mine = inp.reshape(self.size, -1)[self.rank]
        for chunk in output.view(self.size, -1):
            chunk.copy_(mine)
        return self._done()

    alltoall_base = all_to_all_single

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather(outputs, inputs, opts) if outputs and outputs[0] else self._done()

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        if inputs and inputs[0]:
            outputs[0].copy_(inputs[0][self.rank])
        return self._done()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        """Sent to a peer that is not there yet: dropped (its receive on the peer's side is answered below)."""
        return self._done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        """Received from a peer that sent what this rank holds, the rule of every solo collective: the buffer is
        left as it is. Sound for the one point-to-point exchange a framework's build makes, DeepSpeed's
        ``PipelineEngine.__init__`` warm-up (every stage sends its neighbour the scalar 0.0 into a buffer that
        already holds 0.0); training's exchanges never run solo (the spare waits at the end of its build)."""
        return self._done()

    def _start_coalescing(self, *_a: Any) -> None:
        return None

    def _end_coalescing(self, *_a: Any) -> Any:
        return self._done()

    def __getattr__(self, name: str) -> Any:
        def refuse(*_a: Any, **_k: Any) -> Any:
            raise SwapError(f"solo process group: {name} cannot be computed locally (a spare's framework set-up "
                            "used a receive from any source or an uneven collective); set hot_swap.in_place: false")
        return refuse


class SwappableGroup(dist.ProcessGroup):
    """A process group whose communicator (``inner``) can be replaced; see the module docstring."""

    def __init__(self, rank: int, size: int, inner: Any, kind: str, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's (rank, size) overload
        self._rank, self._size = rank, size
        self.inner = inner
        self.kind = kind
        self.timeout = timeout
        self.generation = 0

    def size(self) -> int:
        return self._size

    def rank(self) -> int:  # torch's is fixed at construction; :func:`relabel` changes this one
        if context().rank_watch is not None:  # a spare building ahead: who reads its rank (rank_reads.py)
            from .rank_reads import note

            note()
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return str(dist.distributed_c10d._world.pg_names.get(self, ""))

    @property
    def pg_name(self) -> str:
        return self.group_name

    def __repr__(self) -> str:
        return f"SwappableGroup(rank {self._rank} of {self._size}, {type(self.inner).__name__}, gen {self.generation})"

    def _inner_for(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inner = self.inner  # read once: a hot-swap may replace it meanwhile
        return inner.pick(name, args, kwargs) if isinstance(inner, DeviceSplit) else inner


def _forward(name: str) -> Any:
    def call(self: SwappableGroup, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner_for(name, args, kwargs)
        if self.kind == "gloo" and threading.get_ident() == progress.MAIN:  # the training thread's waits, timed
            return progress.timed(getattr(inner, name), args, kwargs)
        return getattr(inner, name)(*args, **kwargs)
    call.__name__ = name
    return call


for _name in COLLECTIVES:
    setattr(SwappableGroup, _name, _forward(_name))


def _creator(kind: str) -> Any:
    def create(store: Any, rank: int, size: int, timeout: timedelta) -> SwappableGroup:
        k = default_inner() if kind == "default" else kind
        inner = _Solo(rank, size) if mode() == "solo" else build_inner(k, store, rank, size, timeout)
        g = SwappableGroup(rank, size, inner, k, timeout)
        with _lock:
            context().swappable_groups.append(weakref.ref(g))
        return g
    return create


SUPPORTED_TORCH = ("2.4", "2.14")
"""torch versions whose process-group internals this module relies on: a Python ``ProcessGroup`` subclass as a
c10d backend, ``_world.pg_map`` / ``pg_names`` / ``pg_group_ranks``, ``ProcessGroup._register_backend``,
``_create_work_from_future``. Tested with 2.13."""


def unsupported() -> str | None:
    """Why the in-place swap cannot be used with this torch (None: it can)."""
    from packaging.version import Version

    v = Version(torch.__version__.split("+")[0])
    lo, hi = (Version(x) for x in SUPPORTED_TORCH)
    if not lo <= v < hi:
        return f"torch {v} (the in-place swap supports torch >={lo},<{hi})"
    c10d = dist.distributed_c10d
    for owner, name in ((c10d, "_world"), (torch._C._distributed_c10d, "_create_work_from_future"),
                        (dist.ProcessGroup, "_register_backend"), (dist.Backend, "register_backend")):
        if not hasattr(owner, name):
            return f"torch {v} has no {getattr(owner, '__name__', owner)}.{name}"
    return None


_registered = False  # process-wide: torch's backend registry (dist.Backend.register_backend) is per process


def use() -> None:
    """Register the backends (idempotent). After this, ``init_process_group(backend=BACKEND)`` makes swappable
    groups, and so does every ``new_group`` that names no backend."""
    global _registered
    if _registered:
        return
    dist.Backend.register_backend(BACKEND, _creator("default"), devices=["cpu", "cuda"])
    dist.Backend.register_backend(GLOO_BACKEND, _creator("gloo"), devices=["cpu", "cuda"])
    _registered = True


def active() -> bool:
    """True when this process's default group is swappable."""
    return dist.is_initialized() and isinstance(dist.distributed_c10d._get_default_group(), SwappableGroup)


def side_backend() -> str:
    """The backend for a host-memory side group: swappable gloo when the default group is swappable."""
    return GLOO_BACKEND if active() else "gloo"


def groups() -> list[SwappableGroup]:
    """The live swappable groups this rank is a member of, in creation order."""
    with _lock:
        refs = context().swappable_groups
        alive = [g for g in (r() for r in refs) if g is not None]
        refs[:] = [weakref.ref(g) for g in alive]
    names = dist.distributed_c10d._world.pg_names
    alive = [g for g in alive if g in names]  # destroyed groups are no longer torch's
    return sorted(alive, key=lambda g: _order(names[g]))


def _order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


def describe() -> list[list[Any]]:
    """[name, global ranks] of every group this rank is in: what every rank must agree on before a swap."""
    ranks = dist.distributed_c10d._world.pg_group_ranks
    return [[g.group_name, sorted(ranks.get(g, {}).keys())] for g in groups()]


def detach(why: str) -> int:
    """Park every group's inner communicator (the dead generation's): later collectives raise GroupDetached.
    Returns how many groups were detached. Cheap and local: nothing is destroyed (gloo's destructor may block
    on a dead peer; the parked objects stay referenced and finish on their own)."""
    n = 0
    for g in groups():
        if not isinstance(g.inner, _Dead):
            context().graveyard.bury(g.inner)
            g.inner = _Dead(why)
            n += 1
    return n


def go_live(store: Any, generation: int, rank: int, check: Any = None) -> int:
    """Give every group a real communicator of ``generation`` built on ``store`` (the generation's store):
    the default group first, then ``check()`` (e.g. that every rank lists the same groups), then the others in
    creation order. Collective over each group. Returns how many groups were swapped."""
    default = dist.distributed_c10d._get_default_group()
    if dist.get_rank() != rank:
        raise SwapError(f"rank changed from {dist.get_rank()} to {rank}: groups cannot be swapped in place")
    world = dist.distributed_c10d._world
    rest = [g for g in groups() if g is not default]
    n = 0
    for g in ([default] if isinstance(default, SwappableGroup) else []) + rest:
        name = g.group_name
        prefix = dist.PrefixStore(f"{name}/", store)
        old = g.inner
        g.inner = build_inner(g.kind, dist.PrefixStore("swap/", prefix), g._rank, g._size, g.timeout)
        g.generation = generation
        if not isinstance(old, _Dead):
            context().graveyard.bury(old)
        backend_name, _ = world.pg_map[g]
        # torch keeps each group's store (new_group's rendezvous barrier uses the default group's)
        world.pg_map[g] = (backend_name, store if g is default else prefix)
        n += 1
        if g is default and check is not None:
            check()
    context().graveyard.reap()  # the dead generations' communicators: see Graveyard (rebuild/context.py)
    return n


def relabel_refusal(world_size: int) -> str | None:
    """Why this process's groups cannot take another rank of the same world (None: they can): every group it is in
    must span the whole world in rank order (then a group's rank is the global rank), and no group may exist that it
    is not in (torch counts every ``new_group``, also one this rank is not a member of)."""
    world = dist.distributed_c10d._world
    full = list(range(world_size))
    numbered = sum(1 for g in world.pg_map if str(world.pg_names.get(g, "")).isdigit())
    if world.group_count != numbered or any(g not in world.pg_names for g in world.pg_group_ranks):
        return (f"{max(1, world.group_count - numbered)} process group(s) were made without this rank (a subgroup "
                "of the world: model, pipeline or expert parallelism)")
    for g, ranks in world.pg_group_ranks.items():
        if sorted(ranks.items()) != list(zip(full, full)):
            return f"process group {world.pg_names[g]!r} spans ranks {sorted(ranks)}, not the whole world"
    return None


def relabel(rank: int) -> int:
    """A spare built solo for one rank takes ``rank`` of the same world (``rebuild/spare.py``): every swappable
    group answers ``rank`` from now on (their inner communicators are solo until :func:`go_live`). Call only when
    :func:`relabel_refusal` is None. Returns how many groups were relabelled."""
    n = 0
    for g in groups():
        g._rank = rank
        if isinstance(g.inner, _Solo):
            g.inner.rank = rank
        n += 1
    return n


def abort_device_communicators() -> int:
    """GPU path, from the heartbeat thread at the launcher's notice (``worker._abort_nccl_groups``): abort the
    device half (NCCL) of every swappable group's inner communicator. A rank blocked in an NCCL collective with a
    dead peer is released only by an abort (the fence cuts TCP; NCCL's own transports do not see a FIN); the
    aborted communicators are the dead generation's, which :func:`detach` parks and :func:`go_live` replaces.
    Returns how many were aborted (0 on a CPU-only job: no :class:`DeviceSplit`)."""
    with _lock:
        alive = [g for g in (r() for r in context().swappable_groups) if g is not None]
    n = 0
    for g in alive:
        inner = g.inner
        if isinstance(inner, DeviceSplit):
            try:
                inner.device.abort()
                n += 1
            except Exception as exc:  # noqa: BLE001 - already aborted or torn down: nothing left to release
                log.debug("abort of %r's device communicator: %s", g, exc)
    return n


def forget_all() -> None:
    """At exit: drop every communicator this module references (live and dead generations'), on the calling
    thread, so their destructors run now and not during interpreter finalization."""
    with _lock:
        alive = [g for g in (r() for r in context().swappable_groups) if g is not None]
    held = [g.inner for g in alive] + context().graveyard.take_buried()
    for g in alive:
        g.inner = _Dead("process exiting")
    held.clear()


class SoloStore(dist.Store):
    """The default group's store in solo mode: an in-process key-value store whose counters count every rank
    at once (``add(k, n)`` adds ``size x n``), so torch's rendezvous barriers of ``new_group`` pass locally."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._kv: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        self._kv[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        if key not in self._kv:
            raise RuntimeError(f"solo store: key {key!r} was never set (a spare's set-up waited for another rank)")
        return self._kv[key]

    def add(self, key: str, value: int) -> int:
        cur = int(self._kv.get(key, b"0")) + int(value) * self._size
        self._kv[key] = str(cur).encode()
        return cur

    def check(self, keys: list[str]) -> bool:
        return all(k in self._kv for k in keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        missing = [k for k in keys if k not in self._kv]
        if missing:
            raise RuntimeError(f"solo store: keys {missing} were never set (a spare's set-up waited for another rank)")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        cur = self._kv.get(key)
        exp = expected if isinstance(expected, bytes) else str(expected).encode()
        if cur is None and not exp or cur == exp:
            self.set(key, desired)
        return self._kv.get(key, exp)

    def delete_key(self, key: str) -> bool:
        return self._kv.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._kv)
