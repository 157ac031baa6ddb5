"""Ping-pong snapshot slots in node-local shared memory, written chunk by chunk.

Each rank owns two slots (segments ``snap.r<rank>.0`` / ``.1``). A version is written into the slot that does
*not* hold the newest complete version, so one complete, consistent version always exists while the next is
written. The bytes of a slot are a blob of :mod:`deadpool_ext.snapshot.format` whose JSON header is padded to
a fixed reserved size, which puts the data section at a fixed offset: tensor bytes can be copied before the
checksums (which go in the header) are known.

Write protocol (:class:`SlotWriter`), in this order:

1. ``invalidate``: zero MAGIC, so a crash from here on leaves a slot that is recognised as torn;
2. ``copy``: tensor bytes, in chunks, and the checksums of derived tensors (the only phase that must finish
   before the next optimizer step);
3. ``seal``: header (with the checksums of the copied bytes), length, and MAGIC last.

The same writer makes every blob outside a slot too (:func:`write_blob` into any buffer, :func:`serialize` to
``bytes``: the header not padded, the gaps zeroed): there is one implementation of the framing's write side.

Checksums are taken of the bytes as written into the slot. On the CPU path they are computed in the copy's own
pass: each piece of at most :data:`FUSED_PIECE` bytes is copied and then hashed while it is still in cache, so the
captured bytes are read from memory once (by the copy) instead of twice. A copy on a CUDA side stream is
asynchronous, so its checksums are a second pass at ``seal``, after the stream has finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from . import format as fmt

FUSED_PIECE = 1 << 20
"""Bytes copied and then hashed at a time on the CPU path: small enough to be hashed from cache (L2 is 1-2 MiB
per core on current x86 servers), large enough that the per-piece call overhead is under 1%."""


def _align(n: int) -> int:
    return (n + fmt.ALIGN - 1) // fmt.ALIGN * fmt.ALIGN


@dataclass(kw_only=True, slots=True)
class PreparedSnapshot:
    """What the main thread hands to the copy worker: references to live tensors plus the layout."""

    version: int
    skeleton: Any
    tensors: list[torch.Tensor]
    entries: list[fmt.TensorEntry]
    data_nbytes: int
    meta: dict[str, Any]
    derived: list[tuple[str, torch.Tensor]]
    """Live tensors restore re-derives instead of copying: only their checksums are recorded, in the copy
    phase (``meta["derived"]``), while they still hold this version."""


def prepare(version: int, obj: Any, meta: dict[str, Any],
            derived: list[tuple[str, torch.Tensor]] | None = None) -> PreparedSnapshot:
    skeleton, tensors, names = fmt.flatten_state(obj)
    entries, data_nbytes = fmt.plan_layout(tensors, names)
    derived = list(derived or [])
    if derived:  # placeholders of the final length, so the header's size is known before hashing
        meta = {**meta, "derived": {name: fmt.PLACEHOLDER for name, _ in derived}}
    return PreparedSnapshot(version=version, skeleton=skeleton, tensors=tensors, entries=entries,
                            data_nbytes=data_nbytes, meta=meta, derived=derived)


def header_reserve(snap: PreparedSnapshot, late: int = 0) -> int:
    """Room for the header: today's size plus a quarter plus 8 KiB, because counters, learning rates and RNG
    states change the header's length (digits of numbers) from one version to the next while the data layout
    stays the same; plus ``late`` bytes for a section posted after the step (snapshot/late.py: the HF Trainer's
    log history, which grows every logged step). Slots are sized once per job (a restore keeps their size), so
    ``late`` covers the whole run. Sealing raises a clear error if a header ever outgrows it."""
    probe = header_nbytes(snap)
    return probe + probe // 4 + (8 << 10) + max(0, int(late))


def header_nbytes(snap: PreparedSnapshot) -> int:
    """The exact length of the snapshot's header (checksums have a fixed length: known before hashing)."""
    return len(fmt.build_header(snap.skeleton, snap.entries, snap.data_nbytes, [fmt.PLACEHOLDER] * len(snap.entries),
                                snap.meta))


def slot_nbytes(header_reserved: int, data_nbytes: int) -> int:
    return _align(fmt.PREFIX_LEN + header_reserved) + data_nbytes


def data_offset(header_reserved: int) -> int:
    return _align(fmt.PREFIX_LEN + header_reserved)


class SlotWriter:
    """Writes one prepared snapshot into a slot buffer (a writable uint8 tensor over shared memory)."""

    def __init__(self, slot: torch.Tensor, header_reserved: int, chunk_bytes: int) -> None:
        self.slot = slot
        self.header_reserved = header_reserved
        self.chunk_bytes = max(1 << 16, chunk_bytes)
        self.checksums: list[str] | None = None
        """Per-entry checksums computed by ``copy`` in its own pass (CPU path), else ``None`` (``seal`` hashes)."""

    def invalidate(self) -> None:
        self.slot[fmt.MAGIC_SLICE].zero_()

    def copy(self, snap: PreparedSnapshot, stream: Any = None) -> None:
        base = data_offset(self.header_reserved)
        need = base + snap.data_nbytes
        if need > self.slot.numel():
            raise ValueError(f"snapshot needs {need} bytes but the slot has {self.slot.numel()}")
        fused = stream is None
        checksums: list[str] = []
        piece = min(self.chunk_bytes, FUSED_PIECE) if fused else self.chunk_bytes
        for entry, t in zip(snap.entries, snap.tensors):
            if entry.nbytes == 0:
                checksums.append(fmt.bytes_checksum(b""))
                continue
            src = fmt._byte_view(t)
            dst = self.slot[base + entry.offset: base + entry.offset + entry.nbytes]
            if not fused:
                for off in range(0, entry.nbytes, piece):
                    end = min(off + piece, entry.nbytes)
                    dst[off:end].copy_(src[off:end], non_blocking=True)
                continue
            h = xxhash.xxh3_64()
            out = fmt._as_bytes_mv(dst.numpy())
            for off in range(0, entry.nbytes, piece):
                end = min(off + piece, entry.nbytes)
                dst[off:end].copy_(src[off:end])
                h.update(out[off:end])  # the piece just written, still in cache
            checksums.append(fmt.hex_digest(h.intdigest()))
        # With a stream the copies are only enqueued here: the caller waits for an event recorded after them
        # (memory/pinned.py SideStream.copy) before it reports the copy done.
        self.checksums = checksums if fused else None
        for name, t in snap.derived:
            snap.meta["derived"][name] = fmt.tensor_checksum(t)

    def seal(self, snap: PreparedSnapshot) -> int:
        """Write the header with the checksums of the copied bytes (hashed here unless ``copy`` did), then the
        length and MAGIC; returns the blob length."""
        base = data_offset(self.header_reserved)
        checksums = self.checksums
        if checksums is None:  # the copy was asynchronous (CUDA stream): hash the slot's bytes now
            checksums = []
            for e in snap.entries:
                view = self.slot[base + e.offset: base + e.offset + e.nbytes]
                checksums.append(fmt.bytes_checksum(view.numpy()) if e.nbytes else fmt.bytes_checksum(b""))
        header = fmt.build_header(snap.skeleton, snap.entries, snap.data_nbytes, checksums, snap.meta)
        if len(header) > self.header_reserved:
            raise ValueError(f"snapshot header grew to {len(header)} bytes, over the {self.header_reserved} reserved")
        padded = header + b" " * (self.header_reserved - len(header))
        self.slot[fmt.PREFIX_LEN:fmt.PREFIX_LEN + self.header_reserved].copy_(
            torch.frombuffer(bytearray(padded), dtype=torch.uint8))
        self.slot[fmt.HEADER_LEN_SLICE].copy_(torch.frombuffer(bytearray(fmt.pack_header_len(self.header_reserved)),
                                                               dtype=torch.uint8))
        self.slot[fmt.MAGIC_SLICE].copy_(torch.frombuffer(bytearray(fmt.MAGIC), dtype=torch.uint8))
        return base + snap.data_nbytes


def blob_nbytes(obj: Any, meta: dict[str, Any] | None = None) -> int:
    """Exact size of ``serialize(obj, meta)`` without copying tensor data (lets callers size a buffer)."""
    snap = prepare(0, obj, dict(meta or {}))
    return slot_nbytes(header_nbytes(snap), snap.data_nbytes)


def write_blob(buf: Any, obj: Any, meta: dict[str, Any] | None = None) -> int:
    """Write the blob of ``obj`` into ``buf`` (any writable buffer) with the slots' writer: MAGIC cleared first,
    tensor bytes copied and hashed once, header unpadded, MAGIC last; the gaps are zeroed (nothing stale in the
    blob). Returns its length."""
    snap = prepare(0, obj, dict(meta or {}))
    reserved = header_nbytes(snap)
    total = slot_nbytes(reserved, snap.data_nbytes)
    mv = fmt._as_bytes_mv(buf)
    if mv.readonly:
        raise ValueError("write_blob needs a writable buffer")
    if len(mv) < total:
        raise ValueError(f"buffer too small for snapshot: need {total} bytes, have {len(mv)}")
    dst = torch.frombuffer(mv, dtype=torch.uint8, count=total)
    writer = SlotWriter(dst, reserved, FUSED_PIECE)
    writer.invalidate()
    writer.copy(snap)
    base = data_offset(reserved)
    pos = fmt.PREFIX_LEN + reserved  # zero what no entry covers: header end -> data, and between entries
    for entry in snap.entries:
        dst[pos:base + entry.offset].zero_()
        pos = base + entry.offset + entry.nbytes
    writer.seal(snap)
    return total


def serialize(obj: Any, meta: dict[str, Any] | None = None) -> bytes:
    """The whole blob as ``bytes``; not for the hot path (one extra copy)."""
    out = bytearray(blob_nbytes(obj, meta))
    write_blob(memoryview(out), obj, meta)
    return bytes(out)


def probe_slot(buf: Any, *, verify: bool, restorable: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """(header meta, None) for a complete (and, with ``verify``, checksum-clean) slot; (None, reason) otherwise.
    A buffer that was never written (allocated, all zero) gives (None, None): nothing to warn about.

    Complete means decodable, not just sealed: the header is valid, its meta names a version and the skeleton
    decodes (views, nothing copied); with ``restorable`` also into the tensors and state :func:`restore_from`
    hands out. So a malformed copy is refused here, as a reason the restore logs before it falls back to the
    next source, and never fails later, once it was chosen."""
    if not any(bytes(buf[:fmt.PREFIX_LEN])) and not _any_nonzero(buf):
        return None, None
    if bytes(buf[fmt.MAGIC_SLICE]) == fmt.QUARANTINED:
        return None, "quarantined by the numerical canary"
    try:
        header = fmt.read_header(buf)
        if verify:
            fmt.verify_blob(buf)
        meta = dict(header.get("meta") or {})
        version = meta.get("version")
        if type(version) is not int or version < 0:
            raise fmt.SnapshotFormatError(f"header meta has no version (a non-negative integer), got {version!r}")
        if restorable:
            restore_from(buf, verify=False)
        else:
            fmt.deserialize(buf, verify=False, copy=False)
    except fmt.SnapshotFormatError as exc:
        return None, str(exc)
    header_len = fmt.header_len_of(buf)
    meta["blob_nbytes"] = data_offset(header_len) + int(header["data_nbytes"])
    return meta, None


def probe_received(buf: Any, check: fmt.StreamVerifier | None) -> tuple[dict[str, Any] | None, str | None]:
    """The check before use of a copy, as :func:`probe_slot` with ``verify`` and ``restorable``: with ``check`` (a
    blob fetched from a peer) its checksums were checked as it arrived and the rest are now; without (a local slot)
    all of them now. Then MAGIC, header and decodability."""
    why = check.finish() if check is not None else None
    if why is not None:
        return None, why
    return probe_slot(buf, verify=check is None, restorable=True)


def _any_nonzero(buf: Any) -> bool:
    import numpy as np

    return bool(np.frombuffer(fmt._as_bytes_mv(buf), dtype=np.uint8).any())


def restore_from(buf: Any, *, verify: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Decode a slot into (named tensors as views into ``buf``, adapter state, header meta); a blob that is not
    a slot's ``{"tensors": {name: tensor}, "state": {...}}`` raises SnapshotFormatError."""
    obj, meta = fmt.deserialize(buf, verify=verify, copy=False)
    if (type(obj) is not dict or obj.keys() != {"tensors", "state"} or type(obj["tensors"]) is not dict
            or type(obj["state"]) is not dict
            or not all(type(k) is str and isinstance(v, torch.Tensor) for k, v in obj["tensors"].items())):
        raise fmt.SnapshotFormatError("not a snapshot slot: the blob must hold {'tensors': {name: tensor}, "
                                      "'state': {...}}")
    return obj["tensors"], obj["state"], meta

