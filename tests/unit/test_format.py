"""Unit tests for deadpool_ext.snapshot.format (pickle-free snapshot blobs)."""
from __future__ import annotations

import argparse
import enum
import math
import random
import re
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot.format import (
    MAGIC,
    CorruptSnapshotError,
    SnapshotFormatError,
    TensorEntry,
    bytes_checksum,
    deserialize,
    flatten_state,
    plan_layout,
    read_header,
    tensor_checksum,
    unflatten_state,
    verify_blob,
)
from deadpool_ext.snapshot.slots import blob_nbytes, serialize, write_blob


class LocalColor(enum.Enum):  # module is the test module: not an allowed enum prefix
    RED = 1


def assert_same(a, b, path="state"):
    """Recursive equality that checks exact types and bit-exact tensor/array contents (NaNs included)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path} key {k!r}"
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), path)
    else:
        assert a == b, path


def realistic_state() -> dict:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    base = torch.randn(6, 5)
    return {
        "module": OrderedDict(model.state_dict()),
        "optimizer": opt.state_dict(),  # int keys in "state", int lists in param_groups
        "tensors": {
            "f32": base, "bf16": base.to(torch.bfloat16), "f16": base.half(), "i64": torch.arange(-5, 5),
            "bool": base > 0, "noncontig": base.t(), "sliced": base[1:, ::2], "zero_dim": torch.tensor(3.5),
            "empty": torch.empty(0, 5), "u8": torch.randint(0, 255, (7,), dtype=torch.uint8),
        },
        "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "stage": ZeroStageEnum.optimizer_states,
        "np": {"f64": np.arange(12, dtype=np.float64).reshape(3, 4), "noncontig": np.arange(20).reshape(4, 5)[:, ::2],
               "empty": np.zeros((0, 3), np.float32), "scalar0d": np.array(5, dtype=np.int16),
               "big_endian": np.arange(4, dtype=">f4"), "f32": np.float32(1.5), "i64": np.int64(-7)},
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "floats": [math.inf, -math.inf, math.nan, -0.0, 5e-324, 0.1],
        "misc": (1, "a", None, True, b"\x00\xff", bytearray(b"xy"), 2**80),
        "args": argparse.Namespace(lr=0.1, name="run", stages=[1, 2]),
        "keys": {1: "int", "1": "str", (2, 3): "tuple", None: "none", 1.5: "float"},
        "dunder": {"__t__": 5, "x": 1},  # user dict that looks like a marker
        "empty_dict": {}, "empty_list": [], "empty_tuple": (),
    }


def test_round_trip_realistic_state():
    state = realistic_state()
    blob = serialize(state, meta={"step": 12, "rank": 3})
    for copy in (True, False):
        out, meta = deserialize(blob, copy=copy)
        assert meta == {"step": 12, "rank": 3}
        assert_same(state, out)
    assert type(out["optimizer"]["state"]) is dict and all(type(k) is int for k in out["optimizer"]["state"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_bit_exact_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    nbytes = 64 * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    raw[:8] = torch.tensor([0xFF, 0x7F, 0x01, 0xFF, 0x00, 0x80, 0xC0, 0x7F], dtype=torch.uint8)  # NaN-ish bits
    t = raw.view(dtype).reshape(8, -1)
    out, _ = deserialize(serialize({"t": t, "t_T": t.t()}))
    for k in ("t", "t_T"):
        src = t if k == "t" else t.t()
        assert out[k].dtype == dtype and out[k].shape == src.shape
        assert out[k].contiguous().view(torch.uint8).tolist() == src.contiguous().view(torch.uint8).tolist()


def test_rng_states_restore():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    out, _ = deserialize(serialize(state))
    random.setstate(out["python"])
    np.random.set_state(out["numpy"])
    torch.set_rng_state(out["torch"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_write_blob_matches_serialize():
    state = realistic_state()
    meta = {"step": 1}
    ref = serialize(state, meta)
    n_expected = blob_nbytes(state, meta)
    assert n_expected == len(ref)
    backing = bytearray(b"\xab" * (len(ref) + 100))  # stale junk must not leak into padding
    n = write_blob(memoryview(backing), state, meta)
    assert n == len(ref) and bytes(backing[:n]) == ref
    assert backing[n:] == b"\xab" * 100
    out, _ = deserialize(memoryview(backing)[:n])
    assert_same(state, out)


def test_write_blob_too_small():
    state = {"t": torch.zeros(100)}
    need = blob_nbytes(state)
    with pytest.raises(ValueError, match=rf"need {need} bytes, have {need - 1}"):
        write_blob(memoryview(bytearray(need - 1)), state)


def test_header_layout_and_checksums():
    state = {"a": torch.arange(3, dtype=torch.int32), "b": torch.ones(5, dtype=torch.bfloat16), "e": torch.empty(0)}
    blob = serialize(state, meta={"version": 7})
    assert blob[:8] == MAGIC
    (hlen,) = struct.unpack_from("<Q", blob, 8)
    header = read_header(blob)
    assert header["format"] == "deadpool-snapshot" and header["format_version"] == 1
    assert header["checksum_algo"] == "xxh3_64" and header["meta"] == {"version": 7}
    data_start = (16 + hlen + 63) // 64 * 64
    assert len(blob) == data_start + header["data_nbytes"]
    assert set(blob[16 + hlen:data_start]) <= {0}
    for ent, cs in zip(header["tensors"], header["checksums"]):
        assert ent["offset"] % 64 == 0
        assert cs == bytes_checksum(blob[data_start + ent["offset"]:data_start + ent["offset"] + ent["nbytes"]])
        assert cs == tensor_checksum(state[ent["name"]])
    assert [e["name"] for e in header["tensors"]] == ["a", "b", "e"]


def test_plan_layout_is_aligned_and_pure():
    ts = [torch.zeros(3), torch.zeros(0), torch.zeros(2, 2, dtype=torch.float64), torch.tensor(1, dtype=torch.int8)]
    entries, total = plan_layout(ts, ["a", "b", "c", "d"])
    assert entries[0] == TensorEntry("a", "float32", (3,), 0, 12)
    assert [e.offset for e in entries] == [0, 64, 64, 128]
    assert entries[3] == TensorEntry("d", "int8", (), 128, 1) and total == 129


def test_flatten_names_and_dedup():
    shared = torch.ones(2)
    state = {"optimizer": {"state": {0: {"exp_avg": shared}}}, "alias": shared}
    skeleton, tensors, names = flatten_state(state)
    assert names == ["optimizer.state.0.exp_avg"] and len(tensors) == 1
    out = unflatten_state(skeleton, tensors)
    assert out["alias"] is out["optimizer"]["state"][0]["exp_avg"]
    out2, _ = deserialize(serialize(state))
    assert out2["alias"] is out2["optimizer"]["state"][0]["exp_avg"]


def test_copy_semantics():
    backing = bytearray(blob_nbytes({"t": torch.zeros(4)}))
    write_blob(memoryview(backing), {"t": torch.zeros(4)})
    view, _ = deserialize(memoryview(backing), copy=False)
    owned, _ = deserialize(memoryview(backing), copy=True)
    view["t"][0] = 42.0  # writes through into backing
    assert owned["t"][0].item() == 0.0
    with pytest.raises(CorruptSnapshotError):
        verify_blob(backing)


def test_flipped_data_byte_raises():
    state = {"first": torch.zeros(10), "victim": torch.randn(32)}
    blob = bytearray(serialize(state))
    header = read_header(blob)
    ent = header["tensors"][1]
    data_end = len(blob) - header["data_nbytes"]
    blob[data_end + ent["offset"] + 5] ^= 0x01
    with pytest.raises(CorruptSnapshotError, match="victim"):
        deserialize(blob)
    with pytest.raises(CorruptSnapshotError, match="victim"):
        verify_blob(blob)
    deserialize(blob, verify=False)  # explicit opt-out still decodes


@pytest.mark.parametrize("cut", [1, 64, "header", 12, 4])
def test_truncated_blob_raises(cut):
    blob = serialize({"t": torch.randn(64), "x": "y" * 50})
    hlen = struct.unpack_from("<Q", blob, 8)[0]
    n = 16 + hlen // 2 if cut == "header" else (cut if cut < 16 else len(blob) - cut)
    with pytest.raises(CorruptSnapshotError if n >= 8 else SnapshotFormatError):
        deserialize(blob[:n])
    with pytest.raises(SnapshotFormatError):
        read_header(blob[:n])


def test_missing_magic_is_torn_or_foreign():
    blob = bytearray(serialize({"t": torch.randn(4)}))
    blob[:8] = bytes(8)  # what write_blob leaves behind if interrupted
    with pytest.raises(CorruptSnapshotError, match="torn"):
        deserialize(blob)
    blob[:8] = b"NOTOURS!"
    with pytest.raises(SnapshotFormatError, match="not a deadpool snapshot"):
        read_header(blob)


def test_unsupported_type_names_path():
    with pytest.raises(SnapshotFormatError, match=re.escape("state['a']['b'][1]")) as ei:
        flatten_state({"a": {"b": [1, lambda: 0]}})
    assert "function" in str(ei.value)
    with pytest.raises(SnapshotFormatError, match=r"LocalColor.*state\['c'\]\[0\]"):
        serialize({"c": (LocalColor.RED,)})
    with pytest.raises(SnapshotFormatError, match=r"set.*state\['s'\]"):
        serialize({"s": {1, 2}})


def test_decode_refuses_disallowed_enum_module():
    with pytest.raises(SnapshotFormatError, match="os.*not from an allowed"):
        unflatten_state({"__enum__": "os:PathLike", "v": 1}, [])
    with pytest.raises(SnapshotFormatError, match="not an Enum"):
        unflatten_state({"__enum__": "torch.nn:Linear", "v": 1}, [])


def test_cycle_rejected():
    loop: list = []
    loop.append(loop)
    with pytest.raises(SnapshotFormatError, match="cycle"):
        flatten_state({"l": loop})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip_to_cpu():
    t = torch.randn(5, 3, device="cuda").to(torch.bfloat16)
    out, _ = deserialize(serialize({"t": t, "nc": t.t()}))
    assert out["t"].device.type == "cpu" and torch.equal(out["t"], t.cpu()) and torch.equal(out["nc"], t.t().cpu())
    assert tensor_checksum(t) == tensor_checksum(t.cpu())


def test_module_has_no_pickle():
    src = Path(fmt.__file__).read_text()
    assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", src, re.M)
    assert "import pickle" not in src
    assert "torch.load(" not in src and "torch.save(" not in src and "pickle.load" not in src


# -- StreamVerifier: the check of a fetched blob while it arrives -----------------------------------------------
def _arriving(blob: bytes) -> bytearray:
    """The receiver's buffer before anything arrived: zeros (its MAGIC is written last, by the transport)."""
    return bytearray(len(blob))


@pytest.mark.parametrize("piece", [7, 64, 1000, 1 << 20])
def test_stream_verifier_checks_a_blob_piece_by_piece(piece):
    """Pieces of any size, each advanced as it lands: the result is the one-pass check's, and everything but the
    last piece was hashed before finish (the overlap with the transfer)."""
    state = {"a": torch.randn(300), "b": torch.arange(1000, dtype=torch.int64), "c": torch.zeros(0), "d": torch.ones(5)}
    blob = serialize(state, {"version": 3})
    buf = _arriving(blob)
    check = fmt.StreamVerifier(memoryview(buf))
    for a in range(8, len(blob), piece):  # the body: bytes 8.. (MAGIC travels last)
        b = min(a + piece, len(blob))
        buf[a:b] = blob[a:b]
        check.advance(b)
        assert check.problem is None
    buf[:8] = MAGIC
    last = len(blob) - max(range(8, len(blob), piece))
    assert check.finish() is None
    header = read_header(blob)
    data = sum(t["nbytes"] for t in header["tensors"])
    assert check.hashed_early >= data - last, (check.hashed_early, data, last)
    assert deserialize(buf)[0]["b"].equal(state["b"])


def test_stream_verifier_names_the_damaged_tensor_as_soon_as_it_is_in():
    state = {"first": torch.zeros(100), "victim": torch.randn(100), "after": torch.randn(1000)}
    blob = bytearray(serialize(state))
    header = read_header(blob)
    start = len(blob) - header["data_nbytes"]
    victim = header["tensors"][1]
    blob[start + victim["offset"] + 3] ^= 0x10
    buf = _arriving(blob)
    check = fmt.StreamVerifier(memoryview(buf))
    end_of_victim = start + victim["offset"] + victim["nbytes"]
    buf[8:end_of_victim] = blob[8:end_of_victim]
    check.advance(end_of_victim)  # "after" has not arrived yet
    assert check.problem is not None and "victim" in check.problem and "checksum mismatch" in check.problem
    buf[end_of_victim:] = blob[end_of_victim:]
    assert "victim" in (check.finish() or "")


def test_stream_verifier_refuses_a_header_changed_after_it_was_checked():
    blob = serialize({"t": torch.randn(64)}, {"version": 1})
    buf = _arriving(blob)
    check = fmt.StreamVerifier(memoryview(buf))
    buf[8:] = blob[8:]
    check.advance(len(blob))
    i = bytes(buf).index(b'"version":1')
    buf[i + 10:i + 11] = b"2"  # same length, another version: checksums of the data still match
    assert check.finish() == "the header changed after its checksums were checked"


def test_stream_verifier_malformed_or_missing_header():
    blob = bytearray(serialize({"t": torch.randn(4)}))
    short = fmt.StreamVerifier(memoryview(bytearray(7)))
    assert short.finish() == "not a deadpool snapshot (7 bytes: its header never arrived)"
    buf = bytearray(len(blob))
    buf[8:16] = struct.pack("<Q", fmt.MAX_HEADER_BYTES + 1)
    check = fmt.StreamVerifier(memoryview(buf))
    check.advance(16)  # an over-long header length is refused at once, not waited for
    assert check.problem is not None and "over the" in check.problem
    junk = bytearray(blob)
    junk[16:20] = b"!!!!"
    check = fmt.StreamVerifier(memoryview(junk))
    assert "malformed snapshot header" in (check.finish() or "")


def test_pieces_are_the_same_on_both_sides_and_cover_the_body():
    from deadpool_ext.replicate.transport import pieces

    assert pieces(8, 8, 4) == [(8, 8)] and pieces(8, 100, None) == [(8, 100)] and pieces(8, 12, 4) == [(8, 12)]
    got = pieces(8, 1000, 64)
    assert got[0] == (8, 72) and got[-1][1] == 1000 and all(b - a <= 64 for a, b in got)
    assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))
