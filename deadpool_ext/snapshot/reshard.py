"""Elastic restore: the newest complete version in node memory was taken by a world of another data-parallel
size (a shrink after a lost node with no spare, a grow, a relaunch at another size). Every new rank assembles
its new partitions from the old ranks' snapshots, element for element, without touching storage.

Collective over the new world, every rank, main thread. The restore executor (:mod:`.restore`) runs it when the
planner (:func:`.plan.plan_elastic`) chose an elastic plan; this module holds steps 4 and 5 (the moves and the
assembly), the census is :meth:`.tier1.TierOneStore.census`:

1. **census**: the first rank of each node lists every snapshot copy in its node's directory (tier-1 slots of
   whichever ranks ran there, tier-2 replicas held there), headers only; all-gathered (JSON);
2. **choose**: the newest version of which some world has a copy of every one of its ranks (a tier-1 slot is
   preferred to a replica, then the lowest provider); the old ranks' layouts from one of their headers;
3. **check before use**: each provider verifies the checksums of every copy it will serve; a refused copy is
   logged and excluded, and everyone chooses again (the next copy: the replica, or an older version);
4. **move**: for each old rank a new rank needs (:func:`deadpool_ext.recovery.reshard.needed_sources`), its
   provider sends the blob (pairwise, in one global order: no deadlock), signed like every tier-2 transfer; the
   receiver verifies it again, copies the overlap into its new partitions and drops it (one transient blob);
5. **restore**: every element of the new partitions is accounted for, then the adapter restores them
   (parameters derived from the masters) with the small state of the lowest old rank it drew from.

A replicated layout (``rule="replicated"``: Megatron-Core without the distributed optimizer) has no partitions
to cut: step 4 gives each new rank the whole copy of one old rank of its model-parallel shard (its own copy
where it serves one, :func:`deadpool_ext.recovery.reshard.replica_moves`), and step 5 restores that.

Memory: the node's copies are read where they lie (mapped files); a rank holds its new partitions plus one
received blob at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..memory.shm import ShmSegment
from ..recovery.reshard import PartitionLayout, ReshardError, covered, layout_from_json, overlaps
from ..replicate.transport import FETCH_CHUNK_BYTES, BlobReceive, BlobSend, Transport
from .format import StreamVerifier
from .plan import ElasticPlan, RecoveryError
from .slots import probe_received, restore_from


class _Received:
    """The most bytes this rank received in one blob during the moves."""

    max_bytes = 0


def _incoming(me: int, directory: str, transport: Transport, plan: ElasticPlan, received: _Received
              ) -> Iterator[tuple[int, dict[str, torch.Tensor], dict[str, Any]]]:
    """Run the moves (every rank, the same order): serve the copies this rank provides, and yield (old rank,
    tensors, state) of each copy this rank receives, checked (checksums, version, rank, layout). The tensors
    are views of a mapped or received buffer, valid until the next item."""
    olds, version = plan.olds, plan.version
    for r, n in plan.moves:
        provider, b = plan.providers[r]
        if me not in (provider, n):
            continue
        seg = ShmSegment.open(b["file"], root=directory) if me == provider else None
        try:
            if me == n and me == provider:
                assert seg is not None
                buf: Any = seg.buf
            elif me == provider:
                assert seg is not None
                transport.exchange([BlobSend(n, seg.tensor()[:b["nbytes"]])], [], FETCH_CHUNK_BYTES)
                continue
            else:
                into = torch.empty(b["nbytes"], dtype=torch.uint8)
                received.max_bytes = max(received.max_bytes, b["nbytes"])
                buf = memoryview(into.numpy())  # type: ignore[arg-type]  # a uint8 ndarray is a buffer
                check = StreamVerifier(buf)  # checksums checked while the copy arrives
                refused = transport.exchange(
                    [], [BlobReceive(provider, into, b["nbytes"], check.advance)], FETCH_CHUNK_BYTES)
                got, why = probe_received(buf, check)
                if refused or got is None or int(got["version"]) != version or got.get("rank") != r:
                    raise RecoveryError(f"rank {me}: rank {r}'s copy of step {version} received from rank "
                                        f"{provider} is unusable ({why or 'refused by the transport'})")
            tensors, state, _ = restore_from(buf, verify=False)
            try:
                same = layout_from_json(state.get("layout")) == olds[r]
            except ReshardError:
                same = False
            if not same:
                raise RecoveryError(f"rank {me}: rank {r}'s copy of step {version} has another partition layout "
                                    "than the world it belongs to")
            yield r, tensors, state
            del tensors, state, buf
        finally:
            if seg is not None:
                seg.close()


def assemble(me: int, directory: str, transport: Transport, plan: ElasticPlan
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[int], dict[str, int]]:
    """Run the moves; return this rank's new partitions, the small state of the lowest old rank it drew from,
    the old ranks it drew from, and the memory it held beyond the state."""
    new, olds = plan.news[me], plan.olds
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    received = _Received()
    scalars: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] | None = None
    drawn: list[int] = []
    for r, tensors, state in _incoming(me, directory, transport, plan, received):
        old = olds[r]
        assert isinstance(old, PartitionLayout)
        _copy_overlap(tensors, old, new, out, filled, scalars)
        if meta is None:
            meta = state
        drawn.append(r)
    assert meta is not None, "a new rank drew from no old rank"
    want = covered(new)
    per_group = {(name.split(".")[0], ".".join(name.split(".")[2:])): t.dtype for name, t in out.items()}
    for (kind, key), dtype in sorted(per_group.items()):
        for g in range(len(new.part)):
            name = f"{kind}.{g}" + (f".{key}" if key else "")
            if name not in out:  # a group with no element here (all padding): zeros, as a fresh engine has
                out[name] = torch.zeros(new.part[g], dtype=dtype)
            if filled.get(name, 0) != want[g]:
                raise RecoveryError(f"rank {me}: resharded {name} has {filled.get(name, 0)} of its {want[g]} "
                                    "elements")
    out.update(scalars)
    return out, meta, drawn, _memory(out, received)


def assemble_whole(me: int, directory: str, transport: Transport, plan: ElasticPlan
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[int], dict[str, int]]:
    """Replicated layout: run the moves; this rank's state is the one copy it receives (or serves itself),
    taken whole (one transient copy of the state, then copied into the framework's tensors)."""
    received = _Received()
    got: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
    for r, tensors, state in _incoming(me, directory, transport, plan, received):
        assert got is None, "a new rank of a replicated layout draws from one old rank"
        got = (r, {name: t.clone() for name, t in tensors.items()}, state)
    if got is None:
        raise RecoveryError(f"rank {me}: no copy of step {plan.version} reached this rank")
    r, out, meta = got
    return out, meta, [r], _memory(out, received)


def _memory(out: dict[str, torch.Tensor], received: _Received) -> dict[str, int]:
    """What the restore held beyond the state (its record: ``assembled_bytes``, ``received_max_bytes``)."""
    return {"assembled_bytes": sum(t.numel() * t.element_size() for t in out.values()),
            "received_max_bytes": received.max_bytes}


def _copy_overlap(tensors: dict[str, torch.Tensor], old: PartitionLayout, new: PartitionLayout,
                  out: dict[str, torch.Tensor], filled: dict[str, int], scalars: dict[str, torch.Tensor]) -> None:
    """Copy what ``new`` takes from ``old``'s partitions: masters and every per-element optimizer moment (a
    tensor of the partition's length); the per-group scalars (Adam's ``step``) are taken once, from group 0."""
    kinds: dict[str, str] = {}  # suffix after "<kind>.<g>." -> kind ("master" or "optim")
    for name, t in tensors.items():
        kind, _, rest = name.partition(".")
        if kind not in ("master", "optim"):
            continue  # parameter buffers: derived from the masters
        g_s, _, key = rest.partition(".")
        g = int(g_s)
        if t.numel() == old.part[g] and t.dim() == 1:
            kinds[key if kind == "optim" else ""] = kind
        elif kind == "optim" and g == 0:
            for ng in range(len(new.part)):
                scalars.setdefault(f"optim.{ng}.{key}", t.clone())
    for c in overlaps(old, new):
        for key, kind in kinds.items():
            src_name = f"{kind}.{c.src_group}" + (f".{key}" if key else "")
            dst_name = f"{kind}.{c.dst_group}" + (f".{key}" if key else "")
            src = tensors[src_name]
            dst = out.get(dst_name)
            if dst is None:
                dst = out[dst_name] = torch.zeros(new.part[c.dst_group], dtype=src.dtype)
            dst[c.dst_offset:c.dst_offset + c.length].copy_(src[c.src_offset:c.src_offset + c.length])
            filled[dst_name] = filled.get(dst_name, 0) + c.length
