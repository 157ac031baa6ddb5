"""Issue 14 item 6: nothing read from a snapshot blob can run code, and every malformed blob is a
SnapshotFormatError (CorruptSnapshotError for damage), never another exception.

Blobs here are forged the way an attacker with write access to shared memory or a peer's link would: a real
blob's header is rewritten (its data section and checksums left intact, so the checksums still pass)."""
from __future__ import annotations

import json
import struct
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import deadpool_ext  # noqa: F401  (its __path__ is extended by a fixture)
from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot import skeleton as skeleton_codec
from deadpool_ext.snapshot.format import (
    MAGIC,
    MAX_DEPTH,
    SnapshotFormatError,
    deserialize,
    flatten_state,
    read_header,
    unflatten_state,
    verify_blob,
)
from deadpool_ext.snapshot.slots import probe_received, probe_slot, restore_from, serialize

# -- forging ------------------------------------------------------------------------------------------------


def _align(n: int) -> int:
    return (n + fmt.ALIGN - 1) // fmt.ALIGN * fmt.ALIGN


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data section) of a real blob."""
    n = fmt.header_len_of(blob)
    return json.loads(blob[fmt.PREFIX_LEN:fmt.PREFIX_LEN + n]), blob[_align(fmt.PREFIX_LEN + n):]


def forge(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """MAGIC, the header's length, the header (a dict is JSON-encoded as is), padding, ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    start = _align(fmt.PREFIX_LEN + len(raw))
    return MAGIC + struct.pack("<Q", len(raw)) + raw + bytes(start - fmt.PREFIX_LEN - len(raw)) + data


def slot_blob(version: int = 3) -> bytes:
    """A blob as the snapshot manager writes it into a slot."""
    state = {"tensors": {"w": torch.arange(8, dtype=torch.float32), "m": torch.ones(2, 3, dtype=torch.float64)},
             "state": {"global_steps": version, "lr": [0.1], "rng": (3, (1, 2), None)}}
    return serialize(state, {"version": version, "rank": 0, "world_size": 1})


_BASE = slot_blob()


def reforged(mutate: Any, blob: bytes | None = None) -> bytes:
    """``blob`` (default a slot blob) with its header dict passed through ``mutate`` (in place)."""
    header, data = _split(blob if blob is not None else _BASE)
    mutate(header)
    return forge(header, data)


def received(blob: bytes, piece: int = 37) -> tuple[dict[str, Any] | None, str | None]:
    """The check of ``blob`` as a fetch makes it: the body lands piece by piece into a zeroed buffer, a
    StreamVerifier fed as each piece lands, the MAGIC written last, then ``probe_received``."""
    buf = bytearray(len(blob))
    check = fmt.StreamVerifier(memoryview(buf))
    for a in range(fmt.BODY_START, len(blob), piece):
        buf[a:a + piece] = blob[a:a + piece]
        check.advance(min(a + piece, len(blob)))
    buf[:fmt.BODY_START] = blob[:fmt.BODY_START]
    return probe_received(memoryview(buf), check)


def assert_refused(blob: bytes, match: str | None = None) -> None:
    """Every reader refuses ``blob`` with SnapshotFormatError, and probe_slot gives a reason, not an error (also
    when the blob is checked while it arrives)."""
    for read in (read_header, verify_blob, lambda b: deserialize(b), lambda b: deserialize(b, verify=False),
                 lambda b: restore_from(b, verify=True)):
        with pytest.raises(SnapshotFormatError, match=match):
            read(blob)
    for meta, why in (probe_slot(blob, verify=True, restorable=True), received(blob)):
        assert meta is None and why


def assert_decode_refused(blob: bytes, match: str | None = None) -> None:
    """The header is well formed (read_header, verify pass) but decoding it is refused."""
    read_header(blob)
    verify_blob(blob)
    for read in (lambda b: deserialize(b), lambda b: deserialize(b, copy=False),
                 lambda b: restore_from(b, verify=True)):
        with pytest.raises(SnapshotFormatError, match=match):
            read(blob)
    for meta, why in (probe_slot(blob, verify=True, restorable=True), received(blob)):
        assert meta is None and why


def with_skeleton(skeleton: Any) -> bytes:
    header, data = _split(_BASE)
    header["skeleton"] = skeleton
    return forge(header, data)


# -- enum decoding never imports --------------------------------------------------------------------------


@pytest.fixture(params=["deadpool_ext", "torch"])
def planted_module(request, tmp_path, monkeypatch):
    """A module ``<package>.planted_evil`` under a package the old decoder allowed by prefix (found through a
    temp dir added to the package's path) whose import-time code creates a marker file. Yields (module name,
    marker path)."""
    package = sys.modules[request.param]
    marker = tmp_path / "imported.marker"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "planted_evil.py").write_text(textwrap.dedent(f"""
        import enum
        open({str(marker)!r}, "w").write("ran")
        class Color(enum.Enum):
            RED = 1
    """))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(pkg)])
    name = f"{request.param}.planted_evil"
    yield name, marker
    sys.modules.pop(name, None)


def test_forged_enum_naming_an_unimported_module_never_imports_it(planted_module):
    name, marker = planted_module
    blob = with_skeleton({"tensors": {}, "state": {"c": {"__enum__": f"{name}:Color", "v": 1}}})
    assert_decode_refused(blob, match="not an Enum type a snapshot may hold")
    assert not marker.exists(), "decoding a blob ran a module's import-time code"
    assert name not in sys.modules


def test_codec_modules_have_no_dynamic_import_pickle_or_eval():
    import ast

    for module in (fmt, skeleton_codec):
        tree = ast.parse(open(module.__file__).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"importlib", "pickle", "cPickle", "dill", "cloudpickle", "marshal", "runpy"}, module
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not called & {"__import__", "eval", "exec", "compile"}, module


def test_loaded_enum_outside_the_table_is_refused():
    from deadpool_ext.chaos.catalogue import Fault  # a real Enum in an allowed-by-prefix module, already loaded

    spec = f"{Fault.__module__}:{Fault.__qualname__}"
    member = next(iter(Fault))
    with pytest.raises(SnapshotFormatError, match="not an Enum type a snapshot may hold"):
        unflatten_state({"__enum__": spec, "v": member.value}, [])
    with pytest.raises(SnapshotFormatError, match="not one a snapshot may hold"):
        flatten_state({"fault": member})  # and what the reader refuses, the writer refuses


def test_table_enum_whose_module_is_not_loaded_is_refused_not_imported(monkeypatch):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    blob = serialize({"stage": ZeroStageEnum.optimizer_states})
    assert deserialize(blob)[0] == {"stage": ZeroStageEnum.optimizer_states}  # the table's enum round-trips
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.zero.config")
    with pytest.raises(SnapshotFormatError, match="not loaded in this process"):
        deserialize(blob)
    assert "deepspeed.runtime.zero.config" not in sys.modules


# -- nesting ------------------------------------------------------------------------------------------------


def test_deeply_nested_header_is_a_format_error_not_recursion_error():
    depth = 100_000
    header = (b'{"format":"deadpool-snapshot","format_version":1,"checksum_algo":"xxh3_64","data_nbytes":0,'
              b'"tensors":[],"checksums":[],"meta":{},"skeleton":' + b"[" * depth + b"]" * depth + b"}")
    assert_refused(forge(header), match="malformed snapshot header")


def test_nesting_beyond_64_levels_is_refused_on_read():
    skeleton: Any = 1
    for _ in range(MAX_DEPTH + 1):
        skeleton = [skeleton]
    assert_refused(with_skeleton({"tensors": {}, "state": {"x": skeleton}}), match="nested deeper")
    with pytest.raises(SnapshotFormatError, match="nested deeper"):
        unflatten_state(skeleton, [])


def test_state_nested_too_deep_is_refused_on_write():
    deep: Any = 1
    for _ in range(5000):  # the old encoder recursed until RecursionError
        deep = [deep]
    with pytest.raises(SnapshotFormatError, match="nested deeper than 64"):
        serialize({"x": deep})
    ok: Any = 1
    for _ in range(MAX_DEPTH):
        ok = [ok]
    assert deserialize(serialize(ok))[0] == ok  # 64 nested lists: exactly the limit
    with pytest.raises(SnapshotFormatError, match="nested deeper than 64"):
        serialize([ok])


def test_tuple_and_int_key_dict_levels_count_on_both_sides():
    # Each tuple is two JSON levels, each dict with a non-str key three: the writer refuses what the reader would.
    for wrap in (lambda x: (x,), lambda x: {1: x}):
        obj: Any = 1
        while True:
            try:
                blob = serialize(obj)
            except SnapshotFormatError as exc:
                assert "nested deeper" in str(exc)
                break
            assert deserialize(blob)[0] == obj
            obj = wrap(obj)


def test_deep_header_meta_is_refused_on_write():
    meta: Any = {}
    for _ in range(MAX_DEPTH + 1):
        meta = {"m": meta}
    with pytest.raises(SnapshotFormatError, match="meta nested deeper"):
        serialize({}, meta)


# -- shapes -------------------------------------------------------------------------------------------------


def _set_tensor(i: int, **fields: Any) -> Any:
    return lambda h: h["tensors"][i].update(fields)


def _entry_index(name: str) -> int:
    header, _ = _split(slot_blob())
    return next(i for i, e in enumerate(header["tensors"]) if e["name"] == f"tensors.{name}")


def test_negative_shape_is_a_format_error():
    # 8 float32 elements as (-1, -8): the product still matches nbytes, which the old check was content with.
    assert_refused(reforged(_set_tensor(_entry_index("w"), shape=[-1, -8])), match="non-negative")


def test_huge_shape_of_an_empty_tensor_is_a_format_error():
    # An empty tensor (nbytes 0, placed properly after the others) whose shape overflows torch's strides.
    header, data = _split(slot_blob())
    end = _align(header["data_nbytes"])
    header["tensors"].append({"name": "e", "dtype": "float32", "shape": [0, 2**62, 4], "offset": end, "nbytes": 0})
    header["checksums"].append(fmt.bytes_checksum(b""))
    header["data_nbytes"] = end
    assert_refused(forge(header, data + bytes(end - len(data))), match="too large")


@pytest.mark.parametrize("shape", [[8.0], ["8"], [True, 8], 8, None, {"0": 8}, [1] * (fmt.MAX_NDIM + 1)],
                         ids=["float", "string", "bool", "scalar", "null", "object", "too-many-dims"])
def test_shape_of_the_wrong_type_is_a_format_error(shape):
    assert_refused(reforged(_set_tensor(_entry_index("w"), shape=shape)), match="shape")


# -- dtypes, offsets, counts, fields -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float128", "object", ["float32"], None, 4, "torch.float32"])
def test_unknown_tensor_dtype_is_a_format_error(dtype):
    assert_refused(reforged(_set_tensor(_entry_index("w"), dtype=dtype)), match="dtype")


@pytest.mark.parametrize("dtype", ["|O", "i4,f8", "(2,)<f4", "<U0", "V0", "|b1", 4])
def test_unplain_numpy_dtype_is_a_format_error(dtype):
    # A numpy array over raw bytes: object, structured, sub-array or empty dtypes are refused before numpy sees
    # them ("|b1" is plain: it is refused because tensor 0 does not hold raw bytes).
    raw = {"__np__": 0, "dtype": dtype, "shape": [8]}
    assert_decode_refused(with_skeleton({"tensors": {}, "state": {"x": raw}}), match="dtype|raw bytes")


def test_overlapping_offsets_are_a_format_error():
    def mutate(h: dict[str, Any]) -> None:
        h["tensors"][1]["offset"] = h["tensors"][0]["offset"]  # two tensors over the same bytes

    assert_refused(reforged(mutate), match="after the previous tensor")


@pytest.mark.parametrize("offset", [8, 10**12, -64, 64.0, "64", True],
                         ids=["misaligned", "out-of-range", "negative", "float", "string", "bool"])
def test_bad_offset_is_a_format_error(offset):
    assert_refused(reforged(_set_tensor(_entry_index("m"), offset=offset)), match="offset")


@pytest.mark.parametrize("field,value", [
    ("data_nbytes", float), ("data_nbytes", str), ("data_nbytes", lambda n: -1), ("format_version", lambda v: True),
    ("checksums", lambda c: "".join(c)), ("tensors", lambda t: {}), ("meta", lambda m: "version"),
    ("meta", lambda m: [["version", 3]]),
], ids=["data_nbytes-float", "data_nbytes-str", "data_nbytes-negative", "format_version-bool", "checksums-str",
        "tensors-object", "meta-str", "meta-list"])
def test_header_field_of_the_wrong_type_is_a_format_error(field, value):
    # The value is made from the real one (e.g. the right data_nbytes as a float), so only its type is wrong.
    assert_refused(reforged(lambda h: h.__setitem__(field, value(h[field]))))


def test_tensor_and_checksum_counts_must_agree():
    assert_refused(reforged(lambda h: h["checksums"].pop()), match="one length")
    assert_refused(reforged(lambda h: h["tensors"][0].__setitem__("extra", 1)), match="keys")
    assert_refused(reforged(lambda h: h["checksums"].__setitem__(0, 7)), match="16-digit")


def test_header_not_ascii_json_is_a_format_error():
    header, data = _split(slot_blob())
    # UTF-16 JSON: json.loads(bytes) would detect and accept it; the format is ASCII.
    assert_refused(forge(json.dumps(header).encode("utf-16"), data), match="malformed snapshot header")
    text = json.dumps(header).replace('"format_version": 1', '"format_version": NaN')
    assert_refused(forge(text.encode(), data))


def test_header_longer_than_allowed_is_refused_before_parsing():
    blob = bytearray(slot_blob())
    blob[fmt.HEADER_LEN_SLICE] = fmt.pack_header_len(fmt.MAX_HEADER_BYTES + 1)
    with pytest.raises(SnapshotFormatError, match="over the"):
        read_header(bytes(blob))


# -- skeleton markers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    {"__device__": "nonsense"}, {"__device__": ["cpu"]}, {"__size__": [10**30]}, {"__size__": [-1]},
    {"__dict__": {"ab": "cd"}}, {"__dict__": [[1]]}, {"__odict__": "xy"}, {"__tuple__": "ab"},
    {"__ns__": [1]}, {"__f__": "1.5"}, {"__f__": 1}, {"__bytes__": "not base64!"}, {"__bytes__": 5},
    {"__dtype__": "float128"}, {"__dtype__": ["float32"]}, {"__t__": 0, "extra": 1},
    {"__nps__": "|O", "b64": ""}, {"__nps__": "<f8", "b64": "AAAA"}, {"__nps__": "i4,f8", "b64": ""},
    {"__np__": 0, "dtype": "<f4", "shape": [-1]}, {"__np__": 0, "dtype": "|O", "shape": [8]},
    {"__np__": 0, "dtype": "(1000000000000,)f8", "shape": [1]}, {"__np__": 0, "dtype": "<f4"},
    {"__enum__": "deepspeed.runtime.zero.config:ZeroStageEnum", "v": 99},
    {"__enum__": ["deepspeed.runtime.zero.config:ZeroStageEnum"], "v": 1}, {"__enum__": 7, "v": 1},
    {"__t__": 99}, {"__t__": -1}, {"__t__": True}, {"__t__": "0"},
], ids=lambda v: json.dumps(v)[:40])
def test_malformed_marker_is_a_format_error(value):
    # Tensor 0 of the slot blob is 8 float32: the numpy cases point at it as if it held an array's raw bytes.
    import deepspeed.runtime.zero.config  # noqa: F401  (the table's enum is loaded, as in a real restore)

    assert_decode_refused(with_skeleton({"tensors": {}, "state": {"x": value}}))


def test_slot_blob_of_another_structure_is_refused_by_restore():
    # Checksums pass and the skeleton decodes, but it is not {"tensors": {...}, "state": {...}}.
    for skeleton in ([1, 2], {"tensors": [], "state": {}}, {"tensors": {"w": 1}, "state": {}}, {"state": {}}):
        blob = with_skeleton(skeleton)
        deserialize(blob)
        with pytest.raises(SnapshotFormatError, match="not a snapshot slot"):
            restore_from(blob, verify=True)
        meta, why = probe_slot(blob, verify=True, restorable=True)
        assert meta is None and "not a snapshot slot" in why


@pytest.mark.parametrize("meta", [{}, {"version": "3"}, {"version": -1}, {"version": 3.0}, {"version": True}])
def test_slot_without_a_valid_version_is_refused_by_probe(meta):
    blob = reforged(lambda h: h.__setitem__("meta", meta))
    read_header(blob)
    m, why = probe_slot(blob, verify=True)
    assert m is None and "version" in why


# -- fuzz: nothing escapes but SnapshotFormatError (CorruptSnapshotError is one) ------------------------------

_BASE_HEADER, _BASE_DATA = _split(_BASE)

_json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                 | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
                 | st.sampled_from(sorted(skeleton_codec._MARKERS) + ["float32", "<f8", "|O", "cpu", "nan", "inf"]))
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6) | st.sampled_from(sorted(skeleton_codec._MARKERS)), inner,
                                       max_size=4), max_leaves=30)


def _every_reader(blob: bytes) -> None:
    """Call every reader of a blob; only SnapshotFormatError may escape, probe_slot never raises."""
    for read in (read_header, verify_blob, lambda b: deserialize(b), lambda b: deserialize(b, verify=False),
                 lambda b: deserialize(b, verify=False, copy=False), lambda b: restore_from(b, verify=False)):
        try:
            read(blob)
        except SnapshotFormatError:
            pass
    for verify in (False, True):
        for restorable in (False, True):
            meta, why = probe_slot(blob, verify=verify, restorable=restorable)
            assert (meta is None) or (why is None and type(meta["version"]) is int)
    got, why = received(blob)  # checked while it arrives: the same answer as the check after it arrived
    assert (got is None) == (probe_slot(blob, verify=True, restorable=True)[0] is None), why


@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    _every_reader(data)


@given(st.binary(max_size=1024), st.binary(max_size=512))
def test_fuzz_random_header_behind_magic(header, data):
    _every_reader(forge(header, data))


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(_BASE) - 1), st.integers(0, 255)), max_size=8),
       st.integers(min_value=0, max_value=len(_BASE)))
def test_fuzz_mutated_valid_blob(flips, keep):
    blob = bytearray(_BASE)
    for i, b in flips:
        blob[i] = b
    _every_reader(bytes(blob[:keep]))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


_HEADER_PATHS = [p for p in _paths(_BASE_HEADER) if p]


@given(st.lists(st.tuples(st.sampled_from(_HEADER_PATHS), _json), min_size=1, max_size=3))
def test_fuzz_spliced_json_header(splices):
    header = json.loads(json.dumps(_BASE_HEADER))
    for path, value in splices:
        node = header
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier splice replaced this path's parent
    _every_reader(forge(header, _BASE_DATA))


@given(_json)
def test_fuzz_skeleton(skeleton):
    tensors = [torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float32)]
    try:
        unflatten_state(skeleton, tensors)
    except SnapshotFormatError:
        pass
    _every_reader(with_skeleton(skeleton))


_state_leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
                 | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
                 | st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 5))
                 | st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 5)))
_states = st.recursive(_state_leaves, lambda inner: st.lists(inner, max_size=3)
                       | st.builds(tuple, st.lists(inner, max_size=3))
                       | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), inner, max_size=3),
                       max_leaves=40)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(_states)
def test_fuzz_round_trip(state):
    """What the writer accepts the reader gives back exactly; what it refuses is a SnapshotFormatError."""
    try:
        blob = serialize(state, {"version": 1})
    except SnapshotFormatError:
        return
    out, meta = deserialize(blob)
    assert _same(state, out) and meta == {"version": 1}


# -- the restore path: a malformed copy is a refused copy, and the restore falls back -----------------------


def _forge_newest_and_restore(shm_root, mutate):
    """Forge the newest slot's header, then restore as a restarted worker: (version, adapter, the slots the scan
    refused as (kind, index), the newest slot's index)."""
    from deadpool_ext.testing.memory_job import (
        Adapter,
        manager,
        rewrite_header,
        run_steps,
        slot_of,
        slot_path,
        world_of_one,
    )

    with world_of_one():
        run_steps(shm_root, 2)
        newest = slot_of(shm_root, 2)
        rewrite_header(slot_path(shm_root, newest), mutate)
        adapter = Adapter()
        m = manager(shm_root, adapter)
        try:
            version = m.restore_latest()
            refused = [(kind, i) for kind, i, _ in m.store.unusable]
        finally:
            m.close()
    return version, adapter, refused, newest


@pytest.mark.parametrize("forgery", ["device", "structure", "negative-shape", "enum"])
def test_forged_newest_slot_is_refused_and_restore_falls_back(shm_root, forgery):
    def mutate(h):
        if forgery == "device":
            h["skeleton"]["state"]["steps"] = {"__device__": "nonsense"}
        elif forgery == "structure":
            h["skeleton"] = [h["skeleton"]]
        elif forgery == "negative-shape":
            h["tensors"][0]["shape"] = [-1, -64]
        else:
            h["skeleton"]["state"]["steps"] = {"__enum__": "deadpool_ext.chaos.catalogue:Fault", "v": "kill"}

    version, adapter, refused, newest = _forge_newest_and_restore(shm_root, mutate)
    assert version == 1 and adapter.steps == 1 and torch.equal(adapter.w, torch.full((64,), 1.0))
    assert refused == [("slot", newest)]  # the forged slot refused by the scan; the restore fell back to step 1
