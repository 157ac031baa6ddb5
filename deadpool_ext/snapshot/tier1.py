"""Tier 1: a rank's snapshot segments in its node's shared memory, and nothing else.

:class:`TierOneStore` is the only owner of a rank's segments: the two ping-pong slots of its bases
(``snap.r<rank>.0/1``, :mod:`.slots`) and the ring of its differentials (``diff.r<rank>.<j>``). It opens and sizes
them (pre-touched, page-locked on GPU hosts: :mod:`deadpool_ext.memory.pinned`), says what they hold (headers, or
checksums too) and lists every copy in the node's directory for an elastic restore (:meth:`census`). It decides
nothing about versions (:mod:`.plan`) and moves no bytes between ranks (:mod:`deadpool_ext.replicate`).

Call order (one rank, its own threads):

1. ``TierOneStore(dir, job_id, rank, pinner, ring_size)``;
2. the first snapshot sizes the slots (:meth:`open_slots`) and, in differential mode, the ring (:meth:`open_ring`);
   a restore opens what it restores from the same way (a fetch: at the fetched blob's size);
3. the writer thread writes into :attr:`slots` / :attr:`ring` (:class:`.slots.SlotWriter`) and records the newest
   complete base in :attr:`latest`;
4. :meth:`close` at an in-place hot-swap (the segments stay in shared memory for the restore), then
   :meth:`reset`; :meth:`release` at the end.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..memory.pinned import HostPinner
from ..memory.shm import ShmSegment, segment_name
from ..recovery.reshard import REPLICATED
from . import spare_slots
from .slots import probe_slot, restore_from

log = logging.getLogger("deadpool_ext")

SLOT_KIND = "snap"
DIFF_KIND = "diff"
REPLICA_KIND = "replica"


@dataclass(kw_only=True, slots=True)
class OwnCopies:
    """What a rank's own segments hold: version -> blob size, and where (slot / ring entry)."""

    bases: dict[int, int] = field(default_factory=dict)
    diffs: dict[int, int] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)
    ring_of: dict[int, int] = field(default_factory=dict)


class TierOneStore:
    def __init__(self, directory: str, job_id: str, rank: int, pinner: HostPinner, ring_size: int) -> None:
        self.dir = directory
        self.job_id = job_id
        self.rank = rank
        self.pinner = pinner
        self.unusable: list[tuple[str, int, str]] = []
        """(kind, index, why) of each segment the last :meth:`scan` refused (``slot`` / ``differential ring
        entry``): not this user's, a link, a torn or forged header; the restore falls back to the next source."""
        self.reset(ring_size)

    def reset(self, ring_size: int) -> None:
        """No segment open (construction, and after :meth:`close` at an in-place hot-swap)."""
        self.slots: list[ShmSegment | None] = [None, None]
        self.header_reserved = 0
        """Header room of the slots, fixed at the first snapshot (or taken from the blob a restore used)."""
        self.ring: list[ShmSegment | None] = [None] * ring_size
        self.ring_header_reserved = 0
        self.latest: tuple[int, int] | None = None
        """(version, slot) of the newest complete base in the slots."""

    # -- segments -------------------------------------------------------------------------------------------
    def _name(self, kind: str, index: int) -> str:
        return segment_name(self.job_id, kind, self.rank, index)

    def file_nbytes(self, kind: str, index: int) -> int:
        """Size of a segment this rank left in the directory (a restarted process re-attaches at that size)."""
        return os.path.getsize(os.path.join(self.dir, self._name(kind, index)))

    def slot(self, index: int) -> ShmSegment:
        seg = self.slots[index]
        assert seg is not None, "tier-1 slot used before it was opened"
        return seg

    def ring_entry(self, index: int) -> ShmSegment:
        seg = self.ring[index]
        assert seg is not None, "differential ring entry used before it was opened"
        return seg

    def open_slots(self, nbytes: int) -> None:
        """Both slots at ``nbytes`` (existing files are reused, resized ones replaced); a spare's prepared
        segments are taken first (:mod:`.spare_slots`)."""
        made = spare_slots.take(self.dir, self.job_id, self.rank, nbytes) if self.slots == [None, None] else None
        if made is not None:
            for i, ready in enumerate(made):
                self.slots[i] = ready
                self.pinner.pin(ready)
            return
        self._open(self.slots, SLOT_KIND, nbytes)

    def open_ring(self, nbytes: int) -> None:
        self._open(self.ring, DIFF_KIND, nbytes)

    def _open(self, segs: list[ShmSegment | None], kind: str, nbytes: int) -> None:
        for i, seg in enumerate(segs):
            if seg is None or seg.nbytes != nbytes:
                if seg is not None:
                    self.pinner.close(seg)  # unregistered (GPU) before it is unmapped
                seg = ShmSegment.create(self._name(kind, i), nbytes, root=self.dir, touch=True)
                segs[i] = seg
                self.pinner.pin(seg)

    def close_unused(self) -> None:
        """No restore after all (nothing to restore, or nothing newer than a tier-3 base): close slots a restore
        opened before its first snapshot, so the first snapshot sizes them as on a fresh start."""
        if not self.header_reserved:
            for i, seg in enumerate(self.slots):
                if seg is not None:
                    self.pinner.close(seg)
                    self.slots[i] = None

    def close(self) -> None:
        """Close this rank's handles (an in-place hot-swap); the segments stay where the restore finds them."""
        for seg in [*self.slots, *self.ring]:
            if seg is not None:
                self.pinner.close(seg)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in [*self.slots, *self.ring] if s is not None)

    # -- what the segments hold -------------------------------------------------------------------------------
    def scan(self, *, world: int, verify: bool, ring: bool) -> OwnCopies:
        """This rank's own complete copies (headers only, or with ``verify`` every checksum too) of a world of
        ``world`` ranks: its slots, and with ``ring`` its differential ring."""
        out = OwnCopies()
        self.unusable = []
        files = [(SLOT_KIND, i) for i in (0, 1)] + [(DIFF_KIND, j) for j in range(len(self.ring) if ring else 0)]
        for kind, i in files:
            name = self._name(kind, i)
            if not os.path.exists(os.path.join(self.dir, name)):
                continue
            what = "slot" if kind == SLOT_KIND else "differential ring entry"
            try:
                seg = ShmSegment.open(name, root=self.dir)
            except OSError as exc:  # refused (not this user's, a link) or gone: not a copy to restore from
                self.unusable.append((what, i, str(exc)))
                log.warning("tier 1: %s %d of rank %d unusable (%s); falling back to the next source", what, i,
                            self.rank, exc)
                continue
            try:
                meta, why = probe_slot(seg.buf, verify=verify, restorable=True)
            finally:
                seg.close()
            if meta is None and why is None:
                pass  # allocated, never written
            elif meta is None:
                self.unusable.append((what, i, str(why)))
                log.warning("tier 1: %s %d of rank %d unusable (%s); falling back to the next source", what, i,
                            self.rank, why)
            elif meta.get("world_size") != world or meta.get("rank") != self.rank:
                log.warning("tier 1: %s %d was written by rank %s of a world of %s; ignored", what, i,
                            meta.get("rank"), meta.get("world_size"))
            elif kind == SLOT_KIND:
                out.bases[int(meta["version"])] = int(meta["blob_nbytes"])
                out.slot_of[int(meta["version"])] = i
            else:
                out.diffs[int(meta["version"])] = int(meta["blob_nbytes"])
                out.ring_of[int(meta["version"])] = i
        return out

    def census(self) -> list[dict[str, Any]]:
        """Every complete copy in this node's directory, whichever rank wrote it (headers only): tier-1 slots
        and tier-2 replicas, as ``{file, tier, rank, world, version, nbytes[, layout]}`` (the input of
        :func:`.plan.plan_elastic`)."""
        out: list[dict[str, Any]] = []
        if not os.path.isdir(self.dir):
            return out
        rules: dict[int, str] = {}  # world size -> the rule of its layout (a replicated one differs rank by rank)
        for fname in sorted(os.listdir(self.dir)):
            parts = fname.split(".")
            if (len(parts) != 5 or parts[0] != "deadpool" or parts[1] != self.job_id
                    or parts[2] not in (SLOT_KIND, REPLICA_KIND)):
                continue
            try:
                seg = ShmSegment.open(fname, root=self.dir)
            except OSError:
                continue
            try:
                meta, _ = probe_slot(seg.buf, verify=False, restorable=True)
                if meta is None or type(meta.get("rank")) is not int or type(meta.get("world_size")) is not int:
                    continue
                entry: dict[str, Any] = {"file": fname, "tier": 1 if parts[2] == SLOT_KIND else 2,
                                         "rank": meta["rank"], "world": meta["world_size"],
                                         "version": int(meta["version"]), "nbytes": int(meta["blob_nbytes"])}
                if rules.get(meta["world_size"], REPLICATED) == REPLICATED:
                    _, state, _ = restore_from(seg.buf, verify=False)
                    if isinstance(state.get("layout"), dict):
                        entry["layout"] = state["layout"]
                        rules[meta["world_size"]] = str(state["layout"].get("rule"))
                out.append(entry)
            finally:
                seg.close()
        return out

    def check_copy(self, fname: str, *, rank: int, version: int) -> str | None:
        """The checksums of a copy in the directory (one this rank serves to an elastic restore): None when it is
        complete, clean and still rank ``rank``'s step ``version``, else why not."""
        seg = ShmSegment.open(fname, root=self.dir)
        try:
            meta, why = probe_slot(seg.buf, verify=True, restorable=True)
        finally:
            seg.close()
        if meta is None or int(meta["version"]) != version or meta.get("rank") != rank:
            return why or "changed since the census"
        return None
