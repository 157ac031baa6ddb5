"""A spare's snapshot slots, made while it waits for an assignment (off the recovery path).

A spare learns its rank, and so which slots it needs, only when it takes a failed node's place; making two
slots then (allocating and zero-filling the shared memory, then faulting every page in) was ~0.1 s of the
spare's restore for GPT small, while the survivors had theirs. So the spare makes them while it waits.

Call order:

1. every rank, at its first snapshot, publishes its slot size and how many tier-2 replica buffers it holds in the
   job's store (``slots/<rank>`` and ``held/<rank>``: :func:`publish_slot_size`, from ``SnapshotManager._allocate``);
2. a spare, while it waits for an assignment (``distributed.init_distributed`` passes :func:`tick` as
   ``Membership.join``'s ``while_waiting``), once sizes are published creates and pre-faults two segments of the
   largest size, and as many more as the most replica buffers any rank holds, in its node's directory under names
   of its own (kind ``prep``: the census and every scan ignore them) and keeps them (:func:`tick`);
3. at its restore, ``TierOneStore.open_slots`` (snapshot/tier1.py) calls :func:`take`: two prepared files are
   renamed to the slots' names and opened at the slot's exact size (its pages already allocated: a shrink frees the
   tail). A prepared segment in another directory than the store's (a config that moved ``local.shm_root``) is
   removed instead;
4. at its first replication after the restore, its replicator makes the buffers it holds for its sources
   (``replicate/peer.py`` ``setup``) from the others (:func:`adopt`, the same rename), instead of allocating and
   faulting them in then, in the snapshot worker, while the redone step runs.

A segment left unused when the spare ends is removed with its node's directory.

The launcher removes the node's directory, prepared segments included, when the job ends.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..launcher import keys, values
from ..memory.shm import SHM_ROOT, ShmSegment, ShmSpaceError, ensure_private_dir, job_shm_dir, segment_name

log = logging.getLogger("deadpool_ext")

__all__ = ["SHM_ROOT", "adopt", "publish_slot_size", "release", "take", "tick"]
KIND = "prep"
# Process-wide: a spare makes its two slots once in its life, while it waits before its first generation.
_prepared: list[ShmSegment] = []  # the two slots first, then the replica buffers
_state = {"done": False, "next": 0.0}


def publish_slot_size(store: Any, rank: int, nbytes: int, held: int = 0) -> None:
    """Rank ``rank``'s slot size and how many replica buffers it holds, for spares preparing theirs (best effort: a
    snapshot never fails for it)."""
    try:
        store.set_json(keys.slot_size(rank), int(nbytes))
        store.set_json(keys.held_buffers(rank), int(held))
    except Exception as exc:
        log.debug("slots/%d not published: %s", rank, exc)


def _most_held(store: Any) -> int:
    counts = []
    for key, raw in store.list(keys.HELD_BUFFERS).items():
        try:
            counts.append(values.held_buffers(key, raw))
        except values.BadValue:
            continue
    return max(counts, default=0)


def _largest(store: Any) -> int | None:
    sizes = []
    for key, raw in store.list(keys.SLOT_SIZES).items():
        try:
            sizes.append(values.slot_size(key, raw))
        except values.BadValue:
            continue
    return max(sizes) if sizes else None


def tick(store: Any, shm_root: str, job_id: str, node: str, local_index: int) -> None:
    """A spare's wait, once a second at most: make the two slots as soon as their size is known (once)."""
    now = time.monotonic()
    if _state["done"] or now < _state["next"]:
        return
    _state["next"] = now + 1.0
    try:
        nbytes = _largest(store)
    except Exception as exc:
        log.debug("slot sizes unreadable: %s", exc)
        return
    if nbytes is None:
        return
    try:
        held = _most_held(store)
    except Exception as exc:
        log.debug("replica buffer counts unreadable: %s", exc)
        held = 0
    _state["done"] = True
    directory = job_shm_dir(shm_root, job_id, node)
    t0 = time.perf_counter()
    try:
        ensure_private_dir(directory)
        for i in range(2 + held):
            _prepared.append(ShmSegment.create(segment_name(job_id, KIND, local_index, i), nbytes, root=directory,
                                               touch=True))
    except (OSError, ShmSpaceError, ValueError) as exc:
        log.warning("spare: snapshot slots not prepared while waiting (%s); they are made at the restore", exc)
        release()
        return
    log.info("spare: 2 snapshot slots%s of %.1f MB allocated and touched while waiting (%.2f s)",
             f" and {held} replica buffer(s)" if held else "", nbytes / 1e6, time.perf_counter() - t0)


def take(directory: str, job_id: str, rank: int, nbytes: int) -> list[ShmSegment] | None:
    """The two slots of ``rank`` made from the prepared segments (renamed, opened at ``nbytes``), or None
    when there are none for ``directory``."""
    if not _prepared:
        return None
    if any(os.path.dirname(os.fspath(seg.path)) != os.path.abspath(directory) for seg in _prepared):
        release()
        return None
    if len(_prepared) < 2:
        release()
        return None
    return [_rename(_prepared.pop(0), directory, segment_name(job_id, "snap", rank, i), nbytes) for i in (0, 1)]


def adopt(directory: str, name: str, nbytes: int) -> ShmSegment | None:
    """A replica buffer ``name`` of ``nbytes`` made from a prepared segment (renamed, opened at ``nbytes``), or None
    when none is left, none is as large, or they are in another directory (then the caller makes it)."""
    if not _prepared or _prepared[0].nbytes < nbytes \
            or os.path.dirname(os.fspath(_prepared[0].path)) != os.path.abspath(directory):
        return None
    return _rename(_prepared.pop(0), directory, name, nbytes)


def _rename(seg: ShmSegment, directory: str, name: str, nbytes: int) -> ShmSegment:
    os.rename(seg.path, os.path.join(directory, name))
    seg.close()
    return ShmSegment.create(name, nbytes, root=directory, touch=True)


def release() -> None:
    """Drop the prepared segments (unused)."""
    for seg in _prepared:
        seg.close()
        seg.unlink()
    _prepared.clear()
