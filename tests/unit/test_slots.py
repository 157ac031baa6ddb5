
import pytest
import torch

from deadpool_ext.memory.shm import ShmSegment
from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot.slots import SlotWriter, header_reserve, prepare, probe_slot, restore_from, slot_nbytes


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tensors": {"params.0": torch.randn(1000, generator=g).to(torch.bfloat16),
                        "master.0": torch.randn(1000, generator=g),
                        "optim.0.step": torch.tensor(3.0)},
            "state": {"global_steps": 3, "rng": {"torch": torch.get_rng_state()}, "lr": [0.1]}}


def _write(tmp_path, obj, version=3, chunk=1 << 16):
    snap = prepare(version, obj, {"version": version, "rank": 0, "world_size": 1})
    reserve = header_reserve(snap)
    seg = ShmSegment.create("deadpool.t.snap.r0.0", slot_nbytes(reserve, snap.data_nbytes), root=tmp_path)
    w = SlotWriter(seg.tensor(), reserve, chunk)
    w.invalidate()
    w.copy(snap)
    return seg, w, snap


def test_roundtrip_bit_exact(tmp_path):
    obj = _state()
    seg, w, snap = _write(tmp_path, obj)
    w.seal(snap)
    meta, why = probe_slot(seg.buf, verify=True)
    assert why is None and meta["version"] == 3
    tensors, state, _ = restore_from(seg.buf, verify=True)
    for k, t in obj["tensors"].items():
        assert torch.equal(tensors[k].view(torch.uint8) if t.dtype == torch.bfloat16 else tensors[k],
                           t.view(torch.uint8) if t.dtype == torch.bfloat16 else t)
    assert state["global_steps"] == 3 and torch.equal(state["rng"]["torch"], obj["state"]["rng"]["torch"])


def test_torn_slot_is_rejected(tmp_path):
    seg, w, snap = _write(tmp_path, _state())  # copied but never sealed: MAGIC is zero
    meta, why = probe_slot(seg.buf, verify=True)
    assert meta is None and "torn" in why


def test_corrupt_slot_is_rejected(tmp_path):
    seg, w, snap = _write(tmp_path, _state())
    w.seal(snap)
    seg.tensor()[-100] ^= 0xFF
    meta, why = probe_slot(seg.buf, verify=True)
    assert meta is None and "checksum mismatch" in why
    with pytest.raises(fmt.CorruptSnapshotError):
        restore_from(seg.buf, verify=True)


def test_reseal_after_invalidate_keeps_slot_readable_with_new_version(tmp_path):
    seg, w, snap = _write(tmp_path, _state())
    w.seal(snap)
    snap2 = prepare(4, _state(1), {"version": 4, "rank": 0, "world_size": 1})
    w.invalidate()
    assert probe_slot(seg.buf, verify=False)[0] is None
    w.copy(snap2)
    w.seal(snap2)
    assert probe_slot(seg.buf, verify=True)[0]["version"] == 4


def test_timings_are_a_bounded_window():
    from deadpool_ext.snapshot.stats import trim_window

    values: list[float] = []
    for i in range(1000):
        values.append(float(i))
        trim_window(values, window=100)
        assert len(values) <= 200
    assert values[-1] == 999.0 and values == [float(i) for i in range(1000 - len(values), 1000)]
    short = [1.0, 2.0]
    trim_window(short, window=100)
    assert short == [1.0, 2.0]


def test_checksums_taken_in_the_copy_pass_match_the_slot_bytes(tmp_path, monkeypatch):
    """CPU path: each piece is hashed right after it is copied; the header's checksums are those of the bytes in
    the slot (a tensor spanning several pieces, one smaller than a piece, an empty one), and seal hashes nothing."""
    import deadpool_ext.snapshot.slots as slots

    monkeypatch.setattr(slots, "FUSED_PIECE", 1 << 16)  # pieces of 64 KiB: the 1 MiB tensor spans 4
    g = torch.Generator().manual_seed(1)
    obj = {"tensors": {"big": torch.randn(1 << 18, generator=g), "small": torch.randn(7, generator=g),
                       "empty": torch.zeros(0)}, "state": {}}
    seg, w, snap = _write(tmp_path, obj, chunk=1 << 16)
    assert w.checksums is not None and len(w.checksums) == len(snap.entries)
    monkeypatch.setattr(fmt, "bytes_checksum", lambda *_a: pytest.fail("seal hashed again"))
    w.seal(snap)
    monkeypatch.undo()
    header = fmt.read_header(seg.buf)
    base = len(seg.buf) - header["data_nbytes"]
    for e, digest in zip(header["tensors"], header["checksums"]):
        assert digest == fmt.bytes_checksum(bytes(seg.buf[base + e["offset"]: base + e["offset"] + e["nbytes"]]))
    assert probe_slot(seg.buf, verify=True)[1] is None


def test_asynchronous_copy_hashes_at_seal(tmp_path):
    """With a stream (the CUDA side stream: the copy is asynchronous) the copies are only enqueued: the writer never
    synchronizes the stream (the caller waits for an event after the copies, memory/pinned.py SideStream.copy:
    tests/unit/test_cuda_paths.py), and the bytes are hashed at seal; a stand-in stream object shows the path on
    CPU."""
    class _Stream:
        synced = 0

        def synchronize(self):
            _Stream.synced += 1

    obj = _state()
    snap = prepare(3, obj, {"version": 3})
    reserve = header_reserve(snap)
    seg = ShmSegment.create("deadpool.t.snap.r0.1", slot_nbytes(reserve, snap.data_nbytes), root=tmp_path)
    w = SlotWriter(seg.tensor(), reserve, 1 << 16)
    w.invalidate()
    w.copy(snap, _Stream())
    assert w.checksums is None and _Stream.synced == 0
    w.seal(snap)
    assert probe_slot(seg.buf, verify=True)[1] is None
