"""Elastic restore: the newest complete version in node memory was taken by a world of another data-parallel
size (a shrink after a lost node with no spare, a grow, a relaunch at another size). Every new rank assembles
its new partitions from the old ranks' snapshots, element for element, without touching storage.

Collective over the new world, every rank, main thread (``SnapshotManager.restore_latest`` calls it first when
``elastic`` is on, and falls through to the ordinary restore when the newest complete version is of this
world's own layout):

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

import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..cluster.comm import allgather_json
from ..memory.shm import ShmSegment
from ..recovery.agree import NoCommonVersionError, RecoveryError
from ..recovery.reshard import (
    REPLICATED,
    AnyLayout,
    PartitionLayout,
    ReplicatedLayout,
    ReshardError,
    check_compatible,
    covered,
    layout_from_json,
    overlaps,
    replica_moves,
    with_rank,
)
from ..replicate.transport import FETCH_CHUNK_BYTES, BlobReceive, BlobSend
from .format import StreamVerifier
from .slots import probe_received, probe_slot, restore_from

if TYPE_CHECKING:
    from .manager import SnapshotManager

log = logging.getLogger("deadpool_ext")

_MAX_ROUNDS = 8


def _census(mgr: SnapshotManager) -> list[dict[str, Any]]:
    """Every complete copy in this node's directory (headers only): tier-1 slots and tier-2 replicas."""
    out: list[dict[str, Any]] = []
    if not os.path.isdir(mgr.dir):
        return out
    rules: dict[int, str] = {}  # world size -> the rule of its layout (a replicated one differs rank by rank)
    for fname in sorted(os.listdir(mgr.dir)):
        parts = fname.split(".")
        if len(parts) != 5 or parts[0] != "deadpool" or parts[1] != mgr.job_id or parts[2] not in ("snap", "replica"):
            continue
        try:
            seg = ShmSegment.open(fname, root=mgr.dir)
        except OSError:
            continue
        try:
            meta, _ = probe_slot(seg.buf, verify=False, restorable=True)
            if meta is None or type(meta.get("rank")) is not int or type(meta.get("world_size")) is not int:
                continue
            entry: dict[str, Any] = {"file": fname, "tier": 1 if parts[2] == "snap" else 2, "rank": meta["rank"],
                                     "world": meta["world_size"], "version": int(meta["version"]),
                                     "nbytes": int(meta["blob_nbytes"])}
            if rules.get(meta["world_size"], REPLICATED) == REPLICATED:
                _, state, _ = restore_from(seg.buf, verify=False)
                if isinstance(state.get("layout"), dict):
                    entry["layout"] = state["layout"]
                    rules[meta["world_size"]] = str(state["layout"].get("rule"))
            out.append(entry)
        finally:
            seg.close()
    return out


def _choose(reports: list[list[dict[str, Any]]], refused: set[tuple[int, str]]
            ) -> tuple[int, int, dict[int, tuple[int, dict[str, Any]]]] | None:
    """(world, version, old rank -> (provider, copy)) of the newest version some world holds completely."""
    have: dict[tuple[int, int], dict[int, list[tuple[int, int, dict[str, Any]]]]] = {}
    for provider, blobs in enumerate(reports):
        for b in blobs:
            if (provider, b["file"]) in refused or not 0 <= b["rank"] < b["world"]:
                continue
            have.setdefault((b["world"], b["version"]), {}).setdefault(b["rank"], []).append((b["tier"], provider, b))
    complete = [(v, w) for (w, v), ranks in have.items() if len(ranks) == w]
    if not complete:
        return None
    version, world = max(complete)
    chosen = {r: min(c, key=lambda x: (x[0], x[1])) for r, c in have[(world, version)].items()}
    return world, version, {r: (p, b) for r, (_, p, b) in chosen.items()}


def _old_layout(reports: list[list[dict[str, Any]]], world: int) -> AnyLayout:
    for blobs in reports:
        for b in blobs:
            if b["world"] == world and "layout" in b:
                return layout_from_json(b["layout"])
    raise RecoveryError(f"the snapshots of the world of {world} ranks carry no partition layout (taken by a "
                        "version of deadpool_ext or a framework that cannot reshard): cannot restore them at another "
                        "data-parallel size")


def elastic_restore(mgr: SnapshotManager, newer_than: int | None) -> tuple[bool, int | None]:
    """(handled, version): handled False when the newest complete version is this world's own (the ordinary
    restore applies) or there is nothing in memory; True with the restored version, or with None when the
    memory tiers hold nothing newer than ``newer_than`` (a tier-3 base already loaded)."""
    t0 = time.perf_counter()
    me, world_new = mgr.rank, mgr.world
    nodes = allgather_json(mgr.node, group=mgr.group)
    reporter = nodes.index(mgr.node) == me
    reports = allgather_json(_census(mgr) if reporter else [], group=mgr.group)
    refused: set[tuple[int, str]] = set()
    new_json = mgr.adapter.partition_layout()
    # A replicated layout names each rank's shard: every rank needs all of the new world's (one exchange).
    news_replicated = ([ReplicatedLayout.from_json(j) for j in allgather_json(new_json, group=mgr.group)]
                       if isinstance(new_json, dict) and new_json.get("rule") == REPLICATED else None)
    for _ in range(_MAX_ROUNDS):
        pick = _choose(reports, refused)
        if pick is None:
            return False, None
        world_old, version, providers = pick
        same_layout = world_old == world_new and (new_json is None or _old_layout(reports, world_old).dp
                                                  == layout_from_json(new_json).dp)
        if same_layout:
            return False, None  # this world's own snapshots: the ordinary restore
        if newer_than is not None and version <= newer_than:
            if me == 0:
                log.info("memory tiers hold step %d (a world of %d ranks), not newer than the tier-3 base of step "
                         "%d: keeping the base", version, world_old, newer_than)
            return True, None
        if new_json is None:
            why = getattr(mgr.adapter, "why_no_layout", lambda: "")()
            raise RecoveryError(f"the newest state in memory (step {version}) was taken by a world of {world_old} "
                                f"ranks, this one has {world_new}, and this engine's state cannot be resharded"
                                + (f" ({why})" if why else ""))
        new = layout_from_json(new_json)
        olds: Mapping[int, AnyLayout]
        news: list[PartitionLayout] = []
        try:
            base = _old_layout(reports, world_old)
            if news_replicated is not None:
                if not isinstance(base, ReplicatedLayout):
                    raise ReshardError(f"the snapshots' partition rule {base.rule!r} differs from this job's "
                                       f"{REPLICATED!r}")
                replicas = _old_replicas(providers)
                moves = replica_moves(replicas, news_replicated, {r: p for r, (p, _) in providers.items()})
                olds = replicas
            else:
                assert isinstance(new, PartitionLayout)
                if not isinstance(base, PartitionLayout):
                    raise ReshardError(f"the snapshots' partition rule {base.rule!r} differs from this engine's "
                                       f"{new.rule!r}")
                check_compatible(base, new)
                if base.dp != world_old or new.dp != world_new:
                    raise ReshardError(f"resharding covers data parallelism only (dp {base.dp} of {world_old} "
                                       f"ranks -> dp {new.dp} of {world_new})")
                parts = {r: with_rank(base, world_old, r, base.part) for r in range(world_old)}
                news = [with_rank(new, world_new, n, new.part) for n in range(world_new)]
                moves = [(r, n) for r in range(world_old) for n in range(world_new) if overlaps(parts[r], news[n])]
                olds = parts
        except ReshardError as exc:
            raise RecoveryError(f"cannot reshard step {version} from {world_old} to {world_new} ranks: {exc}") from None
        bad = _check_served(mgr, providers, moves, version)
        problems = [p for p in allgather_json(bad, group=mgr.group) if p]
        if problems:
            for p in problems:
                refused.add((p["provider"], p["file"]))
            if me == 0:
                log.warning("elastic restore of step %d refused before use: %s; choosing again from the other copies",
                            version, "; ".join(f"rank {p['rank']}'s copy {p['file']} on rank {p['provider']} "
                                               f"({p['why']})" for p in problems))
            continue
        if me == 0:
            tiers = [providers[r][1]["tier"] for r in sorted({r for r, _ in moves})]
            log.info("elastic: restoring step %d of a world of %d ranks onto %d ranks, resharded from memory "
                     "(%d copies from tier 1, %d from tier 2 replicas; no storage read)", version, world_old,
                     world_new, tiers.count(1), tiers.count(2))
        if news_replicated is not None:
            tensors, meta, drawn = _assemble_whole(mgr, providers, moves, olds, version)
        else:
            tensors, meta, drawn = _assemble(mgr, providers, moves, olds, news[me], version)
        mgr.adapter.restore_resharded(tensors, meta)
        del tensors
        mgr.note_resharded(version, {"outcome": "resharded", "version": version, "from_world": world_old,
                                     **getattr(mgr, "reshard_memory", {}),
                                     "to_world": world_new, "tier3_base": newer_than, "refused_before_use": sorted(
                                         f"{p}:{f}" for p, f in refused),
                                     "providers": {str(r): [p, b["tier"]] for r, (p, b) in sorted(providers.items())}},
                           drawn, time.perf_counter() - t0)
        log.info("rank %d: new %s from old ranks %s in %.2f s", me, "state taken whole" if news_replicated is not None
                 else "partition assembled", drawn, time.perf_counter() - t0)
        return True, version
    raise NoCommonVersionError(f"elastic restore: every candidate copy was refused after {_MAX_ROUNDS} rounds")


def _check_served(mgr: SnapshotManager, providers: dict[int, tuple[int, dict[str, Any]]],
                  moves: list[tuple[int, int]], version: int) -> dict[str, Any] | None:
    """Checksums of the copies this rank serves (the first refused one reported)."""
    needed = {r for r, _ in moves}
    for r in sorted(needed):
        provider, b = providers[r]
        if provider != mgr.rank:
            continue
        seg = ShmSegment.open(b["file"], root=mgr.dir)
        try:
            meta, why = probe_slot(seg.buf, verify=True, restorable=True)
        finally:
            seg.close()
        if meta is None or int(meta["version"]) != version or meta.get("rank") != r:
            return {"provider": mgr.rank, "file": b["file"], "rank": r, "why": why or "changed since the census"}
    return None


def _old_replicas(providers: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, ReplicatedLayout]:
    """Each old rank's replicated layout, from the census entry of the copy chosen for it."""
    out: dict[int, ReplicatedLayout] = {}
    for r, (_, b) in sorted(providers.items()):
        layout = layout_from_json(b.get("layout"))
        if not isinstance(layout, ReplicatedLayout):
            raise ReshardError(f"rank {r}'s copy {b['file']} carries a {layout.rule!r} layout among replicated ones")
        out[r] = layout
    return out


class _Received:
    """The most bytes this rank received in one blob during the moves."""

    max_bytes = 0


def _incoming(mgr: SnapshotManager, providers: dict[int, tuple[int, dict[str, Any]]], moves: list[tuple[int, int]],
              olds: Mapping[int, AnyLayout], version: int, received: _Received
              ) -> Iterator[tuple[int, dict[str, torch.Tensor], dict[str, Any]]]:
    """Run the moves (every rank, the same order): serve the copies this rank provides, and yield (old rank,
    tensors, state) of each copy this rank receives, checked (checksums, version, rank, layout). The tensors
    are views of a mapped or received buffer, valid until the next item."""
    me = mgr.rank
    for r, n in moves:
        provider, b = providers[r]
        if me not in (provider, n):
            continue
        seg = ShmSegment.open(b["file"], root=mgr.dir) if me == provider else None
        try:
            if me == n and me == provider:
                assert seg is not None
                buf: Any = seg.buf
            elif me == provider:
                assert seg is not None
                mgr.peers.transport.exchange([BlobSend(n, seg.tensor()[:b["nbytes"]])], [], FETCH_CHUNK_BYTES)
                continue
            else:
                into = torch.empty(b["nbytes"], dtype=torch.uint8)
                received.max_bytes = max(received.max_bytes, b["nbytes"])
                buf = memoryview(into.numpy())  # type: ignore[arg-type]  # a uint8 ndarray is a buffer
                check = StreamVerifier(buf)  # checksums checked while the copy arrives
                refused = mgr.peers.transport.exchange(
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


def _assemble(mgr: SnapshotManager, providers: dict[int, tuple[int, dict[str, Any]]], moves: list[tuple[int, int]],
              olds: Mapping[int, AnyLayout], new: PartitionLayout, version: int
              ) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[int]]:
    """Run the moves; return this rank's new partitions, the small state of the lowest old rank it drew from,
    and the old ranks it drew from."""
    me = mgr.rank
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    received = _Received()
    scalars: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] | None = None
    drawn: list[int] = []
    for r, tensors, state in _incoming(mgr, providers, moves, olds, version, received):
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
    mgr.reshard_memory = {"assembled_bytes": sum(t.numel() * t.element_size() for t in out.values()),
                          "received_max_bytes": received.max_bytes}
    return out, meta, drawn


def _assemble_whole(mgr: SnapshotManager, providers: dict[int, tuple[int, dict[str, Any]]],
                    moves: list[tuple[int, int]], olds: Mapping[int, AnyLayout], version: int
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[int]]:
    """Replicated layout: run the moves; this rank's state is the one copy it receives (or serves itself),
    taken whole (one transient copy of the state, then copied into the framework's tensors)."""
    received = _Received()
    got: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
    for r, tensors, state in _incoming(mgr, providers, moves, olds, version, received):
        assert got is None, "a new rank of a replicated layout draws from one old rank"
        got = (r, {name: t.clone() for name, t in tensors.items()}, state)
    if got is None:
        raise RecoveryError(f"rank {mgr.rank}: no copy of step {version} reached this rank")
    r, out, meta = got
    mgr.reshard_memory = {"assembled_bytes": sum(t.numel() * t.element_size() for t in out.values()),
                          "received_max_bytes": received.max_bytes}
    return out, meta, [r]


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
