"""Tier 2: copies of each rank's newest snapshot in other nodes' memory.

Placement is :func:`deadpool_ext.cluster.placement.replica_holders` (never the rank's own node). Transfers run
on the snapshot side group (gloo), from the background worker, after the local copy is sealed: the sender
ships the blob body, then its 8-byte MAGIC; the receiver clears its replica's MAGIC first and writes the
received MAGIC only after the body has fully arrived, so an interrupted transfer leaves a replica that is
recognised as torn, never one that looks complete.

Window to know about: a holder keeps one replica per source (memory bound 2 + replication factor). While
version v+1 is streaming in, the replica of v is being overwritten; if the source's node is lost inside that
window (the transfer time, ~0.1 s per 200 MB here), its state is not in peer memory and recovery reports it
(or, with a persistent tier, falls back to it).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..cluster.comm import allgather_json
from ..cluster.placement import PlacementError, replica_holders, replicas_held_by
from ..cluster.topology import Topology
from ..memory.shm import ShmSegment, segment_name
from .slots import probe_slot

log = logging.getLogger("deadpool_ext")


class PeerReplicator:
    """Call order: ``__init__`` (all ranks, collective) -> ``setup(nbytes)`` (all ranks, collective, once the
    slot size is known) -> ``replicate`` per version (all ranks, worker thread) -> at restore ``scan`` then
    ``serve_fetches`` (all ranks, main thread)."""

    def __init__(self, *, rank: int, node: str, factor: int, group: Any, shm_dir: str, job_id: str) -> None:
        self.rank, self.group, self.dir, self.job_id = rank, group, shm_dir, job_id
        nodes = allgather_json(node, group=group)
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
        self.sources = replicas_held_by(self.holders).get(rank, ())
        self.sizes: dict[int, int] = {}
        self.replicas: dict[int, ShmSegment] = {}
        if rank == 0 and factor:
            log.info("tier 2 placement (rank -> holders): %s", {r: list(h) for r, h in sorted(self.holders.items())})

    def _replica_name(self, src: int) -> str:
        return segment_name(self.job_id, "replica", src, f"h{self.rank}")

    def setup(self, slot_nbytes: int) -> None:
        if self.sizes:
            return
        sizes = allgather_json(slot_nbytes, group=self.group)
        self.sizes = {r: int(s) for r, s in enumerate(sizes)}
        for src in self.sources:
            self.replicas[src] = ShmSegment.create(self._replica_name(src), self.sizes[src], root=self.dir, touch=True)

    def held_nbytes(self) -> int:
        return sum(s.nbytes for s in self.replicas.values())

    def replicate(self, slot: torch.Tensor, blob_len: int) -> None:
        if not self.factor:
            return
        ops = []
        for h in self.holders[self.rank]:
            ops.append(dist.P2POp(dist.isend, slot[8:blob_len], h, self.group))
            ops.append(dist.P2POp(dist.isend, slot[:8].clone(), h, self.group))
        magics: dict[int, torch.Tensor] = {}
        for src in self.sources:
            rep = self.replicas[src].tensor()
            rep[:8].zero_()
            magics[src] = torch.zeros(8, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, rep[8:blob_len], src, self.group))
            ops.append(dist.P2POp(dist.irecv, magics[src], src, self.group))
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        for src, magic in magics.items():
            self.replicas[src].tensor()[:8].copy_(magic)

    def scan(self, *, verify: bool, world: int) -> dict[int, tuple[int, int]]:
        """Versions of verified replicas this rank holds: source -> (version, blob size)."""
        found: dict[int, tuple[int, int]] = {}
        prefix = segment_name(self.job_id, "replica", 0, f"h{self.rank}").split(".r0.")[0] + ".r"
        if not os.path.isdir(self.dir):
            return found
        for fname in sorted(os.listdir(self.dir)):
            if not (fname.startswith(prefix) and fname.endswith(f".h{self.rank}")):
                continue
            seg = ShmSegment.open(fname, root=self.dir)
            meta, why = probe_slot(seg.buf, verify=verify)
            src = int(fname[len(prefix):].split(".")[0])
            if meta is None:
                log.warning("tier 2: replica of rank %d held here is unusable (%s); ignored", src, why)
            elif meta.get("rank") == src and meta.get("world_size") == world:
                found[src] = (int(meta["version"]), int(meta["blob_nbytes"]))
            seg.close()
        return found

    def serve_fetches(self, fetch: dict[int, tuple[int, int]], into: torch.Tensor | None) -> None:
        """Send held replicas to the ranks that lost theirs; receive ours into ``into`` if we are one."""
        ops = []
        magic = torch.zeros(8, dtype=torch.uint8)
        for dst, (holder, nbytes) in sorted(fetch.items()):
            if holder == self.rank:
                seg = ShmSegment.open(self._replica_name(dst), root=self.dir)
                buf = seg.tensor()
                ops.append(dist.P2POp(dist.isend, buf[8:nbytes], dst, self.group))
                ops.append(dist.P2POp(dist.isend, buf[:8].clone(), dst, self.group))
            if dst == self.rank:
                assert into is not None
                into[:8].zero_()
                ops.append(dist.P2POp(dist.irecv, into[8:nbytes], holder, self.group))
                ops.append(dist.P2POp(dist.irecv, magic, holder, self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if self.rank in fetch and into is not None:
            into[:8].copy_(magic)
