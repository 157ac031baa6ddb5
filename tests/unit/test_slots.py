
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
    from deadpool_ext.snapshot.manager import trim_window

    values: list[float] = []
    for i in range(1000):
        values.append(float(i))
        trim_window(values, window=100)
        assert len(values) <= 200
    assert values[-1] == 999.0 and values == [float(i) for i in range(1000 - len(values), 1000)]
    short = [1.0, 2.0]
    trim_window(short, window=100)
    assert short == [1.0, 2.0]
