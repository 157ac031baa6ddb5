"""Tier 2: copies of each rank's newest snapshot in other nodes' memory.

Placement is :func:`deadpool_ext.cluster.placement.replica_holders` (never the rank's own node). Transfers go
through a :class:`deadpool_ext.replicate.transport.Transport` (gloo point-to-point on the snapshot side group
by default), from the background worker, after the local copy is sealed; the transport guarantees that an
interrupted transfer leaves a replica that is recognised as torn, never one that looks complete.

Replicas are double-buffered like the local slots (``replication.double_buffer``, default on): version v+1
streams into the holder's other buffer while v stays complete. With a single buffer per source the memory
bound is (2 + factor) x state instead of 2 x (1 + factor), but there is a window: while v+1 streams in, v is
being overwritten, and a source lost inside that window (its transfer time; a process killed mid-transfer
is exactly that) has no complete copy in peer memory. The tests hit that window often enough on tiny models
that double buffering is the default.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ..cluster.comm import CommError, allgather_json
from ..cluster.placement import PlacementError, replica_holders, replicas_held_by
from ..cluster.topology import Topology
from ..config import ConfigError
from ..memory.shm import ShmSegment, segment_name
from ..snapshot.slots import probe_slot
from .auth import UNSIGNED, BlobSigner
from .gloo import GlooTransport
from .transport import FETCH_CHUNK_BYTES, BlobReceive, BlobSend, Transport

log = logging.getLogger("deadpool_ext")


class PeerReplicator:
    """Call order: ``__init__`` (all ranks, collective) -> ``setup(nbytes)`` (all ranks, collective, once the
    slot size is known) -> ``replicate`` per version (all ranks, worker thread) -> at restore ``scan`` then
    ``serve_fetches`` (all ranks, main thread)."""

    def __init__(self, *, rank: int, node: str, factor: int, group: Any, shm_dir: str, job_id: str,
                 double_buffer: bool = True, kind: str = "replica", nbuf: int | None = None,
                 transport: Transport | None = None, signer: BlobSigner = UNSIGNED) -> None:
        # kind "replica": full snapshots (bases), rotating buffers; "dreplica": differentials, a ring of nbuf
        # entries indexed by the caller (the same index as the source's own ring).
        self.kind = kind
        self.nbuf = nbuf if nbuf is not None else (2 if double_buffer else 1)
        self.rank, self.group, self.dir, self.job_id = rank, group, shm_dir, job_id
        self.transport = transport if transport is not None else GlooTransport(group, signer, rank=rank)
        peers = allgather_json({"node": node, "key": signer.fingerprint()}, group=group)
        for r, p in enumerate(peers):  # the same list on every rank: all raise alike
            if not (isinstance(p, dict) and isinstance(p.get("node"), str)
                    and (p.get("key") is None or isinstance(p.get("key"), str))):
                raise CommError(f"rank {r} sent a malformed tier-2 placement message (node name, key fingerprint)")
        _same_key_everywhere([p["key"] for p in peers])
        nodes = [str(p["node"]) for p in peers]
        self.topology = Topology.from_node_list(nodes)
        n_nodes = len(self.topology.nodes)
        if factor > 0 and n_nodes == 1:
            if rank == 0:
                log.warning("replication.factor=%d but all %d ranks are on one node (%s): no other failure domain "
                            "exists, so tier 2 (peer memory) is off. Set local.simulate_nodes to test it on one host.",
                            factor, len(nodes), nodes[0])
            factor = 0
        try:
            self.holders = replica_holders(self.topology, factor)
        except PlacementError as exc:
            raise PlacementError(f"deadpool config: deadpool.replication.factor: {exc}") from None
        self.factor = factor
        if rank == 0 and factor and kind == "replica":
            log.info("tier 2: snapshot blobs between peers are %s", "signed (HMAC-SHA256 with the checkpoint key)"
                     if signer.enabled else "not signed (no checkpoint key set; checksums only)")
        self.sources = replicas_held_by(self.holders).get(rank, ())
        self.sizes: dict[int, int] = {}
        self.replicas: dict[int, list[ShmSegment]] = {}
        self._latest: dict[int, int] = {}  # source -> buffer index holding its newest complete replica
        self._pruned = False  # stale buffers of an earlier placement removed (after the first replication)
        self._pending: int | None = None  # a restore's slot size: the buffers are made at the first replication
        self.adopt: Callable[[str, int], ShmSegment | None] | None = None
        """Where a replica buffer may come from before it is made here: ``(name, nbytes) -> segment or None`` (a
        spare's buffers prepared while it waited, ``snapshot/spare_slots.py``); full snapshots only."""
        if rank == 0 and factor and kind == "replica":
            log.info("tier 2 placement (rank -> holders): %s", {r: list(h) for r, h in sorted(self.holders.items())})

    def _replica_name(self, src: int, buf: int) -> str:
        return segment_name(self.job_id, self.kind, src, f"h{self.rank}b{buf}")

    def setup(self, slot_nbytes: int) -> None:
        """Collective on the side group: exchange slot sizes, then make (or re-attach to) and pre-fault the buffers
        this rank holds for its sources."""
        if self.sizes:
            return
        sizes = allgather_json(slot_nbytes, group=self.group)
        self.sizes = {r: int(s) for r, s in enumerate(sizes)}
        for src in self.sources:
            self.replicas[src] = [self._buffer(self._replica_name(src, b), self.sizes[src]) for b in range(self.nbuf)]

    def _buffer(self, name: str, nbytes: int) -> ShmSegment:
        seg = self.adopt(name, nbytes) if self.adopt is not None and self.kind == "replica" else None
        return seg if seg is not None else ShmSegment.create(name, nbytes, root=self.dir, touch=True)

    def held_buffers(self) -> int:
        """How many replica buffers this rank holds (known before :meth:`setup`): its sources x its buffers."""
        return len(self.sources) * self.nbuf if self.factor else 0

    def setup_later(self, slot_nbytes: int) -> None:
        """After a restore: :meth:`setup` runs at the first :meth:`replicate`, in the snapshot worker, off the
        recovery path (a spare makes its replica buffers there: for 125M parameters over 3 ranks, two buffers of
        ~0.5 GB, allocated and faulted in, most of a second). Every rank restores, so every rank's worker runs it
        first, in the same order on the side group."""
        if not self.sizes:
            self._pending = slot_nbytes

    def close(self) -> None:
        """Close this replicator's mappings of the replica buffers it holds (the files stay: the restore and a
        successor find them by name). Called when an in-place hot-swap replaces the replicator."""
        self.transport.closed = True
        for segs in self.replicas.values():
            for seg in segs:
                seg.close()
        self.replicas.clear()

    def held_nbytes(self) -> int:
        return sum(s.nbytes for segs in self.replicas.values() for s in segs)

    def replicate(self, slot: torch.Tensor, blob_len: int, buf: int | None = None) -> None:
        """Send this rank's blob to its holders and receive its sources' blobs (into ``buf``, or the buffer
        after the newest complete one)."""
        if not self.factor:
            return
        if not self.sizes and self._pending is not None:
            self.setup(self._pending)
        sends = [BlobSend(h, slot[:blob_len]) for h in self.holders[self.rank]]
        targets: dict[int, int] = {}
        receives = []
        for src in self.sources:
            target = buf if buf is not None else (self._latest.get(src, self.nbuf - 1) + 1) % self.nbuf
            targets[src] = target
            # The source's blob length, not ours: ranks' partitions and headers differ in size.
            receives.append(BlobReceive(src, self.replicas[src][target].tensor(), self.sizes[src]))
        refused = self.transport.exchange(sends, receives)
        for src, target in targets.items():
            if src not in refused:  # a refused blob left its buffer torn: the previous one stays the newest
                self._latest[src] = target
        if not self._pruned:
            self._pruned = True
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Remove replica buffers held here for sources of an earlier placement (after a hot-swap that changed
        it, or a restart at another size). Called once this placement has a complete replica of every source:
        until then they may still be the only copy a restore can fetch."""
        stale = [(src, fname) for src, _, fname in self._held_files() if src not in self.sources]
        freed = 0
        for _, fname in stale:
            path = os.path.join(self.dir, fname)
            try:
                freed += os.stat(path).st_blocks * 512
                os.unlink(path)
            except FileNotFoundError:
                continue
        if stale:
            log.info("tier 2: rank %d dropped %d stale %s buffer(s) of an earlier placement (sources %s, %.1f MB)",
                     self.rank, len(stale), self.kind, sorted({s for s, _ in stale}), freed / 1e6)

    def _held_files(self) -> list[tuple[int, int, str]]:
        """(source, buffer, file name) of every replica buffer this rank holds on disk."""
        out: list[tuple[int, int, str]] = []
        if not os.path.isdir(self.dir):
            return out
        tag = f".h{self.rank}b"
        for fname in sorted(os.listdir(self.dir)):
            parts = fname.split(".")
            # deadpool.<job>.replica.r<src>.h<holder>b<buf>
            if (len(parts) == 5 and parts[1] == self.job_id and parts[2] == self.kind
                    and ("." + parts[4]).startswith(tag)):
                out.append((int(parts[3][1:]), int(parts[4][len(tag) - 1:]), fname))
        return out

    def scan(self, *, verify: bool, world: int) -> dict[int, dict[int, int]]:
        """Verified replicas this rank holds: source -> {version: blob size}."""
        found: dict[int, dict[int, int]] = {}
        self._where: dict[tuple[int, int], str] = {}
        for src, buf, fname in self._held_files():
            seg = ShmSegment.open(fname, root=self.dir)
            meta, why = probe_slot(seg.buf, verify=verify)
            if meta is None and why is None:
                pass  # allocated, never written
            elif meta is None:
                log.warning("tier 2: %s buffer %d of rank %d held here is unusable (%s); ignored",
                            "replica" if self.kind == "replica" else "differential replica", buf, src, why)
            elif meta.get("rank") == src and meta.get("world_size") == world:
                version = int(meta["version"])
                found.setdefault(src, {})[version] = int(meta["blob_nbytes"])
                self._where[(src, version)] = fname
                if version == max(found[src]):
                    self._latest[src] = buf
            seg.close()
        return found

    def serve_fetches(self, version: int, fetch: dict[int, tuple[int, int]], into: torch.Tensor | None,
                      versions: dict[int, int] | None = None,
                      progress: Callable[[int], None] | None = None) -> bool:
        """Send held replicas to the ranks that lost theirs; receive ours into ``into`` if we are one.
        ``versions``: per-destination version, where ranks restore different bases (differential mode).
        ``progress``: called as our blob's pieces land (``FETCH_CHUNK_BYTES``), so its checksums are checked while
        the rest arrives (:class:`~deadpool_ext.snapshot.format.StreamVerifier`).
        False if the blob received into ``into`` was refused (left torn: the caller's check refuses it)."""
        sends, receives = [], []
        for dst, (holder, nbytes) in sorted(fetch.items()):
            if holder == self.rank:
                seg = ShmSegment.open(self._where[(dst, (versions or {}).get(dst, version))], root=self.dir)
                sends.append(BlobSend(dst, seg.tensor()[:nbytes]))
            if dst == self.rank:
                assert into is not None
                receives.append(BlobReceive(holder, into, nbytes, progress))
        return not self.transport.exchange(sends, receives, FETCH_CHUNK_BYTES)


def _same_key_everywhere(fingerprints: list[str | None]) -> None:
    """Every rank signs with the same key, or none does (collective input: the same list on every rank, so
    every rank raises the same error)."""
    if len(set(fingerprints)) <= 1:
        return
    groups: dict[str, list[int]] = {}
    for r, f in enumerate(fingerprints):
        groups.setdefault("no key" if f is None else f"key {f}", []).append(r)
    raise ConfigError("deadpool config: the checkpoint key (deadpool.key_env) differs across ranks: "
                      + "; ".join(f"{k} on ranks {v}" for k, v in sorted(groups.items()))
                      + " (key fingerprints shown, never keys); set the same key on every rank, or none",
                      key="deadpool.key_env")
