"""Trust (issue 14), storage / tier 3: nothing read from a checkpoint's storage runs code, escapes its place or
ends in a traceback; with a checkpoint key, only what the key signed is used.

Attacker model: write access to the storage (the base directory, its records, ``latest``, the shared /tmp).
Each attack case is one test named after it; ``test_fuzz_*`` feed the record parsers random documents and bytes
(the registered hypothesis profile, ``tests/security/conftest.py``): only the documented error types escape.

Real DeepSpeed objects: a 1-rank gloo world and a tiny GPT-2 engine (ZeRO-2, CPU) built once per module; bases
are written by the real ``Tier3Persister`` and loaded by the real ``resume_from_tier3`` (what ``--load`` runs).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import stat
import subprocess
import sys
import uuid

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from deadpool_ext.commands.verify import authenticity_note
from deadpool_ext.persist import sign
from deadpool_ext.persist.atomic import IncompleteCheckpointError, parse_manifest, write_manifest
from deadpool_ext.persist.download import CacheDirError, cache_dir_for, download, ensure_private_dir
from deadpool_ext.persist.layout import (
    COMMIT,
    LATEST,
    VersionInfo,
    check_file_name,
    parse_commit,
    parse_rank_manifest,
    read_commit,
    read_latest,
)
from deadpool_ext.persist.records import BadRecordError, CheckpointTrustError, UnsafeNameError, UnsafePathError
from deadpool_ext.persist.safe_load import UntrustedCheckpointError, restricted_load
from deadpool_ext.persist.sign import KEY_ENV, KeyConfigError, SignatureError
from deadpool_ext.persist.storage import open_storage
from deadpool_ext.testing.launch import REPO, base_env
from tests.conftest import one_rank_gloo_world
from tests.log_interface import assert_refusal

KEY = "k" * 32
TAG = "global_step2"


# -- helpers ------------------------------------------------------------------------------------------------
class _RunsCode:
    """Pickles to ``os.system("touch <marker>")``: unpickling it anywhere creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_pt(marker: str) -> bytes:
    """A torch.save file (zip format, like DeepSpeed's) whose pickle runs a command when unpickled."""
    buf = io.BytesIO()
    torch.save({"module": {"w": torch.zeros(2)}, "payload": _RunsCode(marker)}, buf)
    return buf.getvalue()


def _entry(data: bytes) -> dict:
    return {"nbytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}


def forge_file(url: str, tag: str, name: str, data: bytes, *, listed: bool = True) -> None:
    """Replace (or add) ``tag/name`` and, when ``listed``, update the commit record and the rank manifests to the
    new size and checksum: intact but forged (what an attacker with write access does without the key)."""
    with open(os.path.join(url, tag, name), "wb") as fh:
        fh.write(data)
    if not listed:
        return
    cpath = os.path.join(url, tag, COMMIT)
    rec = json.load(open(cpath))
    rank = rec["files"].get(name, {}).get("rank", 0)
    rec["files"][name] = {**_entry(data), "rank": rank}
    rec["total_bytes"] = sum(e["nbytes"] for e in rec["files"].values())
    rec.pop("signature", None)
    json.dump(rec, open(cpath, "w"))
    mpath = os.path.join(url, tag, f"deadpool_manifest.rank{rank}.json")
    if os.path.exists(mpath):
        man = json.load(open(mpath))
        man["files"][name] = _entry(data)
        man.pop("signature", None)
        json.dump(man, open(mpath, "w"))


def write_record(url: str, tag: str, rec: object, raw: bytes | None = None) -> None:
    os.makedirs(os.path.join(url, tag), exist_ok=True)
    with open(os.path.join(url, tag, COMMIT), "wb") as fh:
        fh.write(raw if raw is not None else json.dumps(rec).encode())


def valid_record(files: dict[str, bytes], tag: str = TAG) -> dict:
    entries = {n: {**_entry(d), "rank": 0} for n, d in files.items()}
    return {"format": "deadpool-tier3/1", "version": int(tag[len("global_step"):]), "tag": tag, "files": entries,
            "total_bytes": sum(e["nbytes"] for e in entries.values()), "world_size": 1, "dp_world_size": 1,
            "zero_stage": 2, "published_at": 1.0, "write_s": 0.1}


def small_base(url: str, tag: str = TAG) -> dict:
    """A base with one small (harmless) torch.save file, committed."""
    buf = io.BytesIO()
    torch.save({"module": {"w": torch.ones(3)}}, buf)
    data = buf.getvalue()
    os.makedirs(os.path.join(url, tag), exist_ok=True)
    with open(os.path.join(url, tag, "mp_rank_00_model_states.pt"), "wb") as fh:
        fh.write(data)
    rec = valid_record({"mp_rank_00_model_states.pt": data}, tag)
    write_record(url, tag, rec)
    with open(os.path.join(url, LATEST), "w") as fh:
        fh.write(tag)
    return rec


def cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deadpool_ext.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=base_env({"PYTHONPATH": REPO, **(env or {})}))


def verify_json(url: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    """``deadpool verify URL --json``: its exit status and its decisions (authenticity, each base's verdict)."""
    res = cli("verify", url, "--json", env=env)
    return res.returncode, json.loads(res.stdout)


# -- a real DeepSpeed engine in a 1-rank gloo world (module scope) ---------------------------------------------
@pytest.fixture(scope="module")
def engine():
    import deepspeed

    from deadpool_ext.training.models import build_gpt

    with one_rank_gloo_world():
        with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
            cfg = json.load(fh)
        cfg.pop("deadpool", None)
        cfg["zero_optimization"] = {"stage": 2}
        torch.manual_seed(0)
        model = build_gpt("tiny")
        eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        ids = torch.arange(64).reshape(4, 16) % 200
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        yield eng  # later tests build their own world: this one is gone after the module


def real_base(engine, url: str, steps: tuple[int, ...] = (2,), key: str | None = None) -> None:
    """Bases written by the real tier-3 persister (background writer, commit record last)."""
    from deadpool_ext.config import PersistConfig
    from deadpool_ext.integrations.deepspeed.tier3 import Tier3Persister

    before = engine.checkpoint_engine
    p = Tier3Persister(engine, PersistConfig(url=url, interval=0, keep_last=10), key=key)
    try:
        for s in steps:
            assert p.save(s)
            assert p.writer.wait_idle(120)
            assert p.writer.history[-1].get("published"), p.writer.history[-1]
    finally:
        p.close()
        engine.checkpoint_engine = before


def model_file(url: str, tag: str = TAG) -> str:
    return "mp_rank_00_model_states.pt" if os.path.exists(os.path.join(url, tag, "mp_rank_00_model_states.pt")) \
        else "zero_pp_rank_0_mp_rank_00_model_states.pt"


# == 1. code from storage =======================================================================================
def test_forged_pickle_in_base_never_runs_on_load(engine, tmp_path):
    """--load (resume_from_tier3): a .pt replaced by a code-running pickle, record and manifest updated."""
    from deadpool_ext.integrations.deepspeed.resume import NoVerifiedBaseError, resume_from_tier3

    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    real_base(engine, url)
    forge_file(url, TAG, model_file(url), evil_pt(marker))
    with pytest.raises(NoVerifiedBaseError) as exc:
        resume_from_tier3(engine, url)
    assert not os.path.exists(marker), "the forged pickle ran"
    assert list(exc.value.refused) == [TAG] and any(
        "posix.system" in why and "not in the checkpoint allowlist" in why for why in exc.value.refused[TAG])


def test_forged_newest_base_is_refused_and_previous_loaded(engine, tmp_path):
    from deadpool_ext.integrations.deepspeed.resume import resume_from_tier3

    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    real_base(engine, url, steps=(2, 4))
    forge_file(url, "global_step4", model_file(url, "global_step4"), evil_pt(marker))
    version, _ = resume_from_tier3(engine, url)
    assert version == 2 and not os.path.exists(marker)


def test_forged_plain_directory_loaded_after_load_never_runs(engine, tmp_path):
    """--load on a directory without commit records falls back to engine.load_checkpoint (pretrain.py): the
    engine is left with our checkpoint engine, so that load is weights-only too."""
    from deadpool_ext.integrations.deepspeed.checkpoint_engine import DeadpoolCheckpointEngine
    from deadpool_ext.integrations.deepspeed.resume import resume_from_tier3

    url, marker = str(tmp_path / "plain"), str(tmp_path / "PWNED")
    os.makedirs(os.path.join(url, TAG))
    with open(os.path.join(url, TAG, "mp_rank_00_model_states.pt"), "wb") as fh:
        fh.write(evil_pt(marker))
    with open(os.path.join(url, LATEST), "w") as fh:
        fh.write(TAG)
    before = engine.checkpoint_engine
    try:
        assert resume_from_tier3(engine, url) == (None, {})
        assert isinstance(engine.checkpoint_engine, DeadpoolCheckpointEngine)
        with pytest.raises(UntrustedCheckpointError, match="posix.system"):
            engine.load_checkpoint(url)  # what pretrain.py does next
    finally:
        engine.checkpoint_engine = before
    assert not os.path.exists(marker)


def test_forged_pickle_never_runs_in_checkpoint_engine_load(tmp_path):
    """The load itself (after verification, e.g. a file swapped in between) unpickles weights-only."""
    from deadpool_ext.integrations.deepspeed.checkpoint_engine import DeadpoolCheckpointEngine

    marker = str(tmp_path / "PWNED")
    d = tmp_path / TAG
    d.mkdir()
    data = evil_pt(marker)
    (d / "mp_rank_00_model_states.pt").write_bytes(data)
    ckpt = DeadpoolCheckpointEngine(0)
    ckpt.mark_verified(str(d), {"mp_rank_00_model_states.pt": _entry(data)})
    with pytest.raises(UntrustedCheckpointError, match="posix.system"):
        ckpt.load(str(d / "mp_rank_00_model_states.pt"))
    assert not os.path.exists(marker)


def test_unlisted_file_in_verified_base_is_not_opened(tmp_path):
    from deadpool_ext.integrations.deepspeed.checkpoint_engine import DeadpoolCheckpointEngine

    marker = str(tmp_path / "PWNED")
    d = tmp_path / TAG
    d.mkdir()
    (d / "mp_rank_01_model_states.pt").write_bytes(evil_pt(marker))
    ckpt = DeadpoolCheckpointEngine(0)
    ckpt.mark_verified(str(d), {"mp_rank_00_model_states.pt": {"nbytes": 1, "xxh3_64": "0" * 16}})
    with pytest.raises(UntrustedCheckpointError, match="not listed in the verified commit record"):
        ckpt.load(str(d / "mp_rank_01_model_states.pt"))
    assert not os.path.exists(marker)


def test_forged_pickle_never_runs_on_export(engine, tmp_path):
    from deadpool_ext.integrations.deepspeed.export import ExportError, export_safetensors

    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    real_base(engine, url)
    forge_file(url, TAG, model_file(url), evil_pt(marker))
    with pytest.raises(ExportError, match="posix.system"):
        export_safetensors(url, str(tmp_path / "m.safetensors"), cache_root=str(tmp_path / "cache"), log=print)
    assert not os.path.exists(marker) and not (tmp_path / "m.safetensors").exists()


def test_unlisted_pickle_globbed_by_zero_to_fp32_never_runs_on_export(engine, tmp_path):
    """zero_to_fp32 globs *_model_states.pt: a file planted beside the base (not in its record) is never seen."""
    from deadpool_ext.integrations.deepspeed.export import export_safetensors

    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    real_base(engine, url)
    forge_file(url, TAG, "mp_rank_01_model_states.pt", evil_pt(marker), listed=False)
    out = export_safetensors(url, str(tmp_path / "m.safetensors"), cache_root=str(tmp_path / "cache"), log=print)
    assert not os.path.exists(marker)
    assert out["tensors"] > 0 and out["authenticated"] is False


def test_forged_pickle_never_runs_in_reshard_conversion(engine, tmp_path):
    """ds_to_universal (dp change) calls torch.load(weights_only=False) on every optim file it globs."""
    from deadpool_ext.integrations.deepspeed.reshard import convert_to_universal

    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    real_base(engine, url)
    optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    forge_file(url, TAG, optim, evil_pt(marker))
    with pytest.raises(UntrustedCheckpointError, match="posix.system"):
        convert_to_universal(os.path.join(url, TAG), str(tmp_path / "uni" / TAG))
    assert not os.path.exists(marker)


def test_stale_universal_conversion_is_never_reused(engine, tmp_path):
    """The old converter skipped everything when a DONE marker was in its (predictable) output folder."""
    from deadpool_ext.integrations.deepspeed.reshard import convert_to_universal

    url = str(tmp_path / "t3")
    real_base(engine, url)
    out = tmp_path / "uni" / TAG
    (out / "zero").mkdir(parents=True)
    (out / ".deadpool_universal_done").write_text("planted")
    (out / "zero" / "planted.pt").write_bytes(b"x")
    convert_to_universal(os.path.join(url, TAG), str(out))
    assert not (out / "zero" / "planted.pt").exists() and not (out / ".deadpool_universal_done").exists()
    assert (out / "zero").is_dir() and any((out / "zero").iterdir())


def test_resume_loads_a_real_base_weights_only(engine, tmp_path):
    """The allowlist is enough for what DeepSpeed writes: a genuine base resumes (through our loader only)."""
    from deadpool_ext.integrations.deepspeed.resume import resume_from_tier3

    url = str(tmp_path / "t3")
    real_base(engine, url)
    version, client = resume_from_tier3(engine, url)
    assert version == 2 and isinstance(client, dict)


def test_megatron_metadata_pickle_never_runs(tmp_path):
    """torch_dist's .metadata is plain pickle: read by the restricted unpickler only."""
    from deadpool_ext.integrations.megatron.allowlist import dcp_metadata_table

    marker = str(tmp_path / "PWNED")
    with pytest.raises(UntrustedCheckpointError, match="posix.system"):
        restricted_load(pickle.dumps(_RunsCode(marker)), dcp_metadata_table(), "x/.metadata")
    assert not os.path.exists(marker)


def test_megatron_metadata_naming_a_path_outside_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from deadpool_ext.integrations.megatron.checkpoint import _data_only

    base = tmp_path / "iter_0000005"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(base)), no_dist=True)
    listed = set(os.listdir(base))
    target = {"w": torch.zeros(4)}
    with _data_only(str(base), listed):  # the genuine metadata loads
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(base)), no_dist=True)
    assert target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    md = pickle.loads((base / ".metadata").read_bytes())
    md.storage_data = {k: _StorageInfo("../../outside.distcp", v.offset, v.length)
                       for k, v in md.storage_data.items()}
    (base / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeNameError, match="outside.distcp"), _data_only(str(base), listed):
        dcp.load({"w": torch.zeros(4)}, storage_reader=dcp.FileSystemReader(str(base)), no_dist=True)


# == 2. names that escape ===================================================================================
def test_commit_record_naming_absolute_path_is_refused(tmp_path):
    url = str(tmp_path / "t3")
    rec = small_base(url)
    rec["files"] = {"/etc/hostname": {"nbytes": 1, "xxh3_64": "0" * 16, "rank": 0}}
    rec["total_bytes"] = 1
    write_record(url, TAG, rec)
    with pytest.raises(UnsafeNameError, match="/etc/hostname"):
        read_commit(open_storage(url, create=False), TAG)


def test_download_never_writes_outside_its_cache(tmp_path):
    """An object store key may literally hold '../': the old download joined it under its cache and wrote there."""
    storage = open_storage(f"memory://dl-{uuid.uuid4().hex[:8]}")
    name = "../../escaped.txt"
    storage.fs.pipe_file(f"{storage.root}/{TAG}/{name}", b"owned")  # the attacker's object, key as is
    info = VersionInfo(2, TAG, {"files": {name: _entry(b"owned")}})  # as a record that was never validated
    dest = tmp_path / "cache" / "u"
    with pytest.raises(UnsafeNameError):
        download(storage, info, str(dest))
    assert not [p for p in tmp_path.rglob("escaped.txt*")]


def plant_symlink(tmp_path, url: str) -> None:
    """A base whose record lists an optimizer file that is a symbolic link to a file outside."""
    small_base(url)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"secret bytes")
    os.makedirs(os.path.join(url, TAG), exist_ok=True)
    link = os.path.join(url, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.symlink(outside, link)
    rec = json.load(open(os.path.join(url, TAG, COMMIT)))
    rec["files"]["zero_pp_rank_0_mp_rank_00_optim_states.pt"] = {**_entry(b"secret bytes"), "rank": 0}
    rec["total_bytes"] = sum(e["nbytes"] for e in rec["files"].values())
    write_record(url, TAG, rec)


def test_symlink_planted_in_base_is_not_followed(tmp_path):
    url = str(tmp_path / "t3")
    plant_symlink(tmp_path, url)
    code, out = verify_json(url)  # the CLI's line: the refusal table (section 6)
    assert code == 1 and [b["verdict"] for b in out["bases"]] == ["bad"] and len(out["problems"]) == 1
    with pytest.raises(UnsafePathError):
        open_storage(url, create=False).open_read(f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_storage_refuses_paths_leaving_its_root(tmp_path):
    s = open_storage(str(tmp_path / "t3"))
    for rel in ("../x", "/etc/passwd", "a/../../x", "a//b"):
        with pytest.raises(UnsafePathError):
            s.open_read(rel)


def test_latest_naming_a_path_outside_is_refused(tmp_path):
    url = str(tmp_path / "t3")
    small_base(url)
    (tmp_path / "t3" / LATEST).write_text("../../etc")
    with pytest.raises(BadRecordError, match="expected global_step"):
        read_latest(open_storage(url, create=False))
    code, out = verify_json(url)  # inspect's line: the refusal table (section 6)
    assert code == 1 and out["latest"] is None and [b["verdict"] for b in out["bases"]] == ["ok"]


def test_megatron_latest_naming_a_path_outside_is_refused(tmp_path):
    from deadpool_ext.integrations.megatron.checkpoint import latest_base

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt").mkdir()
    for bad in ("../elsewhere", "/etc", "iter_0000008/../../elsewhere", "iter_12"):
        (tmp_path / "ckpt" / "latest").write_text(bad)
        with pytest.raises(UnsafeNameError, match="expected iter_"):
            latest_base(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "latest").write_text("iter_0000008\n")
    assert latest_base(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "iter_0000008")


def test_megatron_manifest_naming_a_path_outside_is_refused(tmp_path):
    from deadpool_ext.integrations.megatron.checkpoint import verify_base

    base = tmp_path / "iter_0000008"
    base.mkdir()
    (base / "common.pt").write_bytes(b"x")
    write_manifest(str(base), "base", ["common.pt"])
    man = json.load(open(base / "deadpool_manifest.base.json"))
    for bad in ("..", "../../outside", "notes.txt"):
        man["files"] = {"common.pt": man["files"]["common.pt"], bad: {"nbytes": 1, "xxh3_64": "0" * 16}}
        json.dump(man, open(base / "deadpool_manifest.base.json", "w"))
        with pytest.raises(UnsafeNameError, match="file name"):
            verify_base(str(base))


# == 3. malformed records: one line, never a traceback =============================================================
MALFORMED = {
    "json_list": b'[{"format": "deadpool-tier3/1"}]',
    "size_as_string": None,  # built from a valid record below
    "missing_field": None,
    "bad_utf8": b'{"format": "deadpool-tier3/1", "files": {"\xff\xfe": 1}}',
    "huge_number": None,
    "huge_integer_literal": None,
    "nan": None,
    "deep_nesting": b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    "duplicate_key": None,
    "truncated": b'{"format": "deadpool-tier3/1", "files": {',
    "empty_file": b"",
}


def _malformed(case: str, good: dict) -> bytes:
    raw = MALFORMED[case]
    if raw is not None:
        return raw
    rec = json.loads(json.dumps(good))
    name = next(iter(rec["files"]))
    if case == "size_as_string":
        rec["files"][name]["nbytes"] = str(rec["files"][name]["nbytes"])
    elif case == "missing_field":
        del rec["files"][name]["xxh3_64"]
    elif case == "huge_number":
        rec["files"][name]["nbytes"] = 10 ** 30
    elif case == "huge_integer_literal":
        return json.dumps(rec).replace(f'"nbytes": {good["files"][name]["nbytes"]}', '"nbytes": ' + "9" * 5000).encode()
    elif case == "nan":
        return json.dumps(rec).replace('"published_at": 1.0', '"published_at": NaN').encode()
    elif case == "duplicate_key":
        dup = '"format": "deadpool-tier3/1", "files": {}'
        return json.dumps(rec).replace('"format": "deadpool-tier3/1"', dup).encode()
    return json.dumps(rec).encode()


def test_malformed_commit_record_is_refused_not_silently_incomplete(tmp_path):
    from deadpool_ext.persist.layout import list_versions, load_candidates

    url = str(tmp_path / "t3")
    small_base(url)
    write_record(url, TAG, None, raw=b"[1, 2]")
    storage = open_storage(url, create=False)
    (v,) = list_versions(storage)
    assert v.commit is None and "top level is a JSON list" in v.problem
    refused: list = []
    assert load_candidates(storage, refused=refused) == [] and refused == [v]


# == 4. signatures ===================================================================================================
def test_signed_base_verifies_with_key(engine, tmp_path):
    url = str(tmp_path / "t3")
    real_base(engine, url, key=KEY)
    rec = json.load(open(os.path.join(url, TAG, COMMIT)))
    assert rec["signature"]["alg"] == "hmac-sha256"
    code, out = verify_json(url, env={KEY_ENV: KEY})
    assert code == 0 and out["authenticity"] is True and out["problems"] == [], out
    assert [(b["tag"], b["verdict"], b["authenticated"]) for b in out["bases"]] == [(TAG, "ok", True)]
    from deadpool_ext.integrations.deepspeed.resume import resume_from_tier3

    assert resume_from_tier3(engine, url, key=KEY)[0] == 2


def tamper_signed(engine, url: str, marker: str) -> None:
    """A signed base whose model file is replaced by a code-running pickle, the record updated, the old signature
    kept (what an attacker without the key can do)."""
    real_base(engine, url, key=KEY)
    rec = json.load(open(os.path.join(url, TAG, COMMIT)))
    name = model_file(url)
    data = evil_pt(marker)
    with open(os.path.join(url, TAG, name), "wb") as fh:
        fh.write(data)
    rec["files"][name].update(_entry(data))
    rec["total_bytes"] = sum(e["nbytes"] for e in rec["files"].values())
    json.dump(rec, open(os.path.join(url, TAG, COMMIT), "w"))  # the old signature kept


def test_tampered_signed_record_is_refused(engine, tmp_path):
    url, marker = str(tmp_path / "t3"), str(tmp_path / "PWNED")
    tamper_signed(engine, url, marker)
    code, out = verify_json(url, env={KEY_ENV: KEY})  # the CLI's line: the refusal table (section 6)
    assert code == 1 and [(b["tag"], b["verdict"]) for b in out["bases"]] == [(TAG, "refused")], out
    from deadpool_ext.integrations.deepspeed.resume import NoVerifiedBaseError, resume_from_tier3

    with pytest.raises(NoVerifiedBaseError):
        resume_from_tier3(engine, url, key=KEY)
    assert not os.path.exists(marker)


def test_unsigned_record_is_refused_with_a_key(engine, tmp_path):
    from deadpool_ext.integrations.deepspeed.export import ExportError, export_safetensors
    from deadpool_ext.integrations.deepspeed.resume import NoVerifiedBaseError, resume_from_tier3

    url = str(tmp_path / "t3")
    real_base(engine, url)  # no key: unsigned
    code, out = verify_json(url, env={KEY_ENV: KEY})  # the CLI's line: the refusal table (section 6)
    assert code == 1 and [(b["tag"], b["verdict"]) for b in out["bases"]] == [(TAG, "refused")], out
    with pytest.raises(NoVerifiedBaseError):
        resume_from_tier3(engine, url, key=KEY)
    with pytest.raises(ExportError, match="not signed"):
        export_safetensors(url, str(tmp_path / "m.safetensors"), cache_root=str(tmp_path / "c"), key=KEY)
    code, out = verify_json(url)  # without a key: intact, and it says what it did not check
    assert code == 0 and out["authenticity"] is False and [b["verdict"] for b in out["bases"]] == ["ok"], out
    assert "integrity only" in authenticity_note(False) and "checking authenticity" in authenticity_note(True)


def test_record_signed_with_another_key_is_refused(tmp_path):
    rec = sign.sign(valid_record({"mp_rank_00_model_states.pt": b"x"}), sign.KIND_COMMIT, b"a" * 32)
    with pytest.raises(SignatureError, match="signature does not match"):
        parse_commit(json.dumps(rec).encode(), TAG, "here", key=b"b" * 32)
    assert parse_commit(json.dumps(rec).encode(), TAG, "here", key=b"a" * 32)["files"]


def test_signed_manifest_cannot_pass_for_a_commit_record():
    man = sign.sign({"format": "deadpool-tier3/1", "files": {"mp_rank_00_model_states.pt": _entry(b"x")},
                     "total_bytes": 1}, sign.KIND_RANK_MANIFEST, KEY.encode())
    with pytest.raises(SignatureError):
        parse_commit(json.dumps(man).encode(), TAG, "here", key=KEY.encode())


def test_forged_rank_manifest_is_not_published_with_a_key(tmp_path):
    from deadpool_ext.persist.throttle import Throttle
    from deadpool_ext.persist.writer import BaseJob, BaseWriter, CapturedFile

    storage = open_storage(str(tmp_path / "t3"))
    w = BaseWriter(storage, Throttle(), poll_s=0.01, key=KEY.encode())
    storage.write_bytes(f"{TAG}/deadpool_manifest.rank1.json", json.dumps(
        {"files": {"zero_pp_rank_1_mp_rank_00_optim_states.pt": _entry(b"x")}, "rank": 1, "tag": TAG,
         "version": 2}).encode())  # planted, unsigned
    import time

    w.submit(BaseJob(version=2, tag=TAG, rank=0, world_size=2, coordinator=True,
                     files=[CapturedFile("zero_pp_rank_0_mp_rank_00_optim_states.pt", {"x": torch.ones(2)}, 8)],
                     layout={"world_size": 2}, deadline=time.time() + 30))
    assert w.wait_idle(30)
    w.close(5)
    assert "not signed" in w.history[-1]["error"] and not storage.exists(f"{TAG}/{COMMIT}")


def test_short_key_is_a_one_line_error(tmp_path):
    with pytest.raises(KeyConfigError, match="at least 16"):
        sign.checkpoint_key("short")
    # the CLI's line (exit 2, naming the variable): the refusal table (section 6)


def test_plain_checkpoint_without_manifest_is_refused_with_a_key(tmp_path):
    from deadpool_ext.integrations.deepspeed.checkpoint_engine import DeadpoolCheckpointEngine

    d = tmp_path / "plain"
    d.mkdir()
    torch.save({"module": {}}, d / "mp_rank_00_model_states.pt")
    with pytest.raises(SignatureError, match="no signed deadpool manifest"):
        DeadpoolCheckpointEngine(0, key=KEY).load(str(d / "mp_rank_00_model_states.pt"))
    assert DeadpoolCheckpointEngine(0).load(str(d / "mp_rank_00_model_states.pt")) == {"module": {}}


# == 5. the download cache ===========================================================================================
def test_download_cache_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    d = cache_dir_for("s3://bucket/run")
    assert d.startswith(str(tmp_path / "xdg"))
    for p in (d, os.path.dirname(d)):
        st_ = os.lstat(p)
        assert stat.S_IMODE(st_.st_mode) == 0o700 and st_.st_uid == os.geteuid() and stat.S_ISDIR(st_.st_mode)


def test_download_cache_planted_as_symlink_is_refused(tmp_path):
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "cache")
    with pytest.raises(CacheDirError, match="symbolic link"):
        ensure_private_dir(str(tmp_path / "cache"))


def test_download_cache_writable_by_others_is_refused(tmp_path):
    (tmp_path / "cache").mkdir()
    os.chmod(tmp_path / "cache", 0o777)
    with pytest.raises(CacheDirError, match="writable by group or others"):
        ensure_private_dir(str(tmp_path / "cache"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by someone else")
def test_download_cache_owned_by_someone_else_is_refused(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o777)
    os.chown(tmp_path / "cache", 65534, 65534)
    with pytest.raises(CacheDirError, match="owned by uid 65534"):
        ensure_private_dir(str(tmp_path / "cache"))


def test_cached_copy_is_reverified_on_every_use(tmp_path):
    url = str(tmp_path / "t3")
    small_base(url)
    storage = open_storage(url, create=False)
    info = VersionInfo(2, TAG, read_commit(storage, TAG))
    dest = cache_dir_for(url, str(tmp_path / "cache"))
    download(storage, info, dest)
    cached = os.path.join(dest, TAG, "mp_rank_00_model_states.pt")
    good = open(cached, "rb").read()
    with open(cached, "r+b") as fh:  # the cached copy changed (same size)
        fh.seek(40)
        fh.write(b"\x00\x01\x02")
    with open(os.path.join(dest, TAG, "mp_rank_01_model_states.pt"), "wb") as fh:  # and a file was planted
        fh.write(b"planted")
    (tmp_path / "cache" / "DONE").write_text("")  # no marker means anything
    download(storage, info, dest)
    assert open(cached, "rb").read() == good
    assert sorted(os.listdir(os.path.join(dest, TAG))) == [COMMIT, "mp_rank_00_model_states.pt"]


def test_download_of_changed_remote_file_is_refused(tmp_path):
    url = str(tmp_path / "t3")
    small_base(url)
    storage = open_storage(url, create=False)
    info = VersionInfo(2, TAG, read_commit(storage, TAG))
    with open(os.path.join(url, TAG, "mp_rank_00_model_states.pt"), "ab") as fh:
        fh.write(b"more")
    with pytest.raises(IncompleteCheckpointError, match="does not match its commit record"):
        download(storage, info, cache_dir_for(url, str(tmp_path / "cache")))


# == 6. the CLI's refusals: one line naming the file or key, never a traceback ======================================
def _bad_entry(rec: dict, name: str, entry: dict) -> dict:
    rec["files"][name] = entry
    rec["total_bytes"] = sum(e["nbytes"] for e in rec["files"].values())
    return rec


def _parent_path(tmp_path, url, engine):
    (tmp_path / "outside.txt").write_bytes(b"secret")
    write_record(url, TAG, _bad_entry(small_base(url), "../../outside.txt", {**_entry(b"secret"), "rank": 0}))


def _never_written(tmp_path, url, engine):
    write_record(url, TAG, _bad_entry(small_base(url), "notes.txt", {"nbytes": 1, "xxh3_64": "0" * 16, "rank": 0}))


def _no_files(tmp_path, url, engine):
    write_record(url, TAG, {**small_base(url), "files": {}, "total_bytes": 0})


def _latest_outside(tmp_path, url, engine):
    small_base(url)
    (tmp_path / "t3" / LATEST).write_text("../../etc")


def _forged_pickle(tmp_path, url, engine):
    real_base(engine(), url)
    forge_file(url, TAG, model_file(url), evil_pt(str(tmp_path / "PWNED")))


def _malformed_record(case):
    def setup(tmp_path, url, engine):
        write_record(url, TAG, None, raw=_malformed(case, small_base(url)))
    return setup


_CLI_CI = ("verify-truncated", "inspect-nan", "export-json_list")
"""The malformed records each command's one line is checked on in CI, one or two per command: every record is
refused by the same parser (test_malformed_commit_record_is_refused_not_silently_incomplete and the fuzz below, in
process), so the CLI's part, one line naming the file and no traceback, is the same for each."""


def _cli_subset(case_id: str) -> tuple:
    return () if case_id in _CLI_CI else (pytest.mark.full_matrix(
        covered_by="test_malformed_commit_record_is_refused_not_silently_incomplete (every malformed record, in "
                   f"process) and this test's {', '.join(_CLI_CI)} (the CLI's one line)"),)


_VERIFY, _INSPECT, _EXPORT = ("verify",), ("inspect", "--shm-root", "{tmp}/noshm"), \
    ("export", "--out", "{tmp}/m.safetensors", "--cache", "{tmp}/c")
_WITH_KEY, _SHORT_KEY = {KEY_ENV: KEY}, {KEY_ENV: "short"}
REFUSALS = [
    pytest.param(_forged_pickle, _EXPORT, None, 1, ("posix.system", "mp_rank_00_model_states.pt"),
                 id="export-forged_pickle"),
    pytest.param(_parent_path, _VERIFY, None, 1, (COMMIT, "'../../outside.txt'", "not a plain file name"),
                 id="verify-parent_path"),
    pytest.param(_never_written, _VERIFY, None, 1, ("'notes.txt'", "not one the writer writes"),
                 id="verify-name_never_written"),
    pytest.param(_no_files, _VERIFY, None, 1, (COMMIT, "'files' is empty"), id="verify-no_files"),
    pytest.param(lambda tmp_path, url, engine: plant_symlink(tmp_path, url), _VERIFY, None, 1, ("symbolic link",),
                 id="verify-symlink"),
    pytest.param(_latest_outside, _INSPECT, None, 1, (LATEST, "'../../etc'"), id="inspect-latest_outside"),
    pytest.param(lambda tmp_path, url, engine: tamper_signed(engine(), url, str(tmp_path / "PWNED")), _VERIFY,
                 _WITH_KEY, 1, ("signature does not match",), id="verify-tampered_signed"),
    pytest.param(lambda tmp_path, url, engine: real_base(engine(), url), _VERIFY, _WITH_KEY, 1, ("not signed",),
                 id="verify-unsigned_with_key"),
    pytest.param(lambda tmp_path, url, engine: small_base(url), _VERIFY, _SHORT_KEY, 2, (KEY_ENV, "at least 16"),
                 id="verify-short_key"),
    *[pytest.param(_malformed_record(case), command, None, 1, (f"{TAG}/{COMMIT}",), id=f"{command[0]}-{case}",
                   marks=_cli_subset(f"{command[0]}-{case}"))
      for command in (_VERIFY, _INSPECT) for case in sorted(MALFORMED)],
    *[pytest.param(_malformed_record(case), _EXPORT, None, 1, (f"{TAG}/{COMMIT}",), id=f"export-{case}",
                   marks=_cli_subset(f"export-{case}"))
      for case in ("json_list", "size_as_string", "bad_utf8", "huge_number")],
]
"""Each hostile or malformed storage the ``deadpool`` CLI refuses: (setup, command, environment, exit status, what
its one line names). The refusal's words are the interface: the one line tells the user which file or key to fix."""


def refused_in_one_line(res: subprocess.CompletedProcess, rc: int, names: tuple[str, ...]) -> None:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stdout, res.stdout + res.stderr  # log-interface: one line
    for name in names:
        assert_refusal(res, rc=rc, names=name)


@pytest.mark.parametrize("setup,command,env,rc,names", REFUSALS)
def test_cli_refuses_hostile_or_malformed_storage_in_one_line(request, tmp_path, setup, command, env, rc, names):
    url = str(tmp_path / "t3")
    setup(tmp_path, url, lambda: request.getfixturevalue("engine"))  # the engine only for the cases that write
    args = [command[0], url, *(a.format(tmp=tmp_path) for a in command[1:])]
    refused_in_one_line(cli(*args, env=env), rc, names)
    assert not (tmp_path / "PWNED").exists(), "a forged pickle ran"


# == fuzz: the record parsers ========================================================================================
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=16), c,
                                                                                       max_size=4), max_leaves=20)
_names = st.sampled_from(["mp_rank_00_model_states.pt", "zero_pp_rank_3_mp_rank_00_optim_states.pt",
                          "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", "../../outside.txt", "/etc/passwd",
                          "a/b.pt", "..", ".", "", "x\x00.pt", "mp_rank_00_model_states.pt/..",
                          "zero_pp_rank_１_mp_rank_00_optim_states.pt"]) | st.text(max_size=40)
_entries = st.fixed_dictionaries({}, optional={"nbytes": _json | st.integers(min_value=0, max_value=2 ** 64),
                                               "xxh3_64": _json | st.just("0123456789abcdef"),
                                               "rank": _json | st.integers(0, 8)})
_near_commit = st.fixed_dictionaries(
    {}, optional={"format": st.just("deadpool-tier3/1") | _json, "version": st.just(2) | _json,
                  "tag": st.just(TAG) | _json, "files": st.dictionaries(_names, _entries | _json, max_size=4) | _json,
                  "total_bytes": st.integers(0, 100) | _json, "world_size": _json, "dp_world_size": _json,
                  "zero_stage": _json, "published_at": _json, "signature": _json})
_near_rank_manifest = st.fixed_dictionaries(
    {}, optional={"files": st.dictionaries(_names, _entries | _json, max_size=4) | _json, "rank": _json,
                  "version": st.just(2) | _json, "tag": st.just(TAG) | _json, "write_s": _json, "signature": _json})


def _check_parsed(rec: dict) -> None:
    """What a parser returns is safe to use: plain names of the layout, integer sizes."""
    assert isinstance(rec, dict) and rec["files"]
    for name, e in rec["files"].items():
        assert "/" not in name and "\\" not in name and name not in (".", "..") and "\x00" not in name
        assert isinstance(e["nbytes"], int) and not isinstance(e["nbytes"], bool) and 0 <= e["nbytes"] < 2 ** 63
        assert isinstance(e["xxh3_64"], str) and len(e["xxh3_64"]) == 16


@given(doc=_near_commit | _json, with_key=st.booleans())
def test_fuzz_commit_record_documents(doc, with_key):
    data = json.dumps(doc).encode()
    try:
        rec = parse_commit(data, TAG, "fuzz/deadpool_commit.json", key=KEY.encode() if with_key else None)
    except (BadRecordError, SignatureError) as exc:  # UnsafeNameError is a BadRecordError
        assert "\n" not in str(exc) and str(exc).startswith("fuzz/deadpool_commit.json")
        return
    _check_parsed(rec)
    for name in rec["files"]:
        check_file_name(name, "again")


@given(data=st.binary(max_size=512) | st.builds(lambda d, b: json.dumps(d).encode()[: b], _near_commit,
                                                     st.integers(0, 400)))
def test_fuzz_commit_record_bytes(data):
    try:
        _check_parsed(parse_commit(data, TAG, "fuzz"))
    except BadRecordError as exc:
        assert "\n" not in str(exc)


@given(doc=_near_rank_manifest | _json, with_key=st.booleans())
def test_fuzz_rank_manifest_documents(doc, with_key):
    try:
        _check_parsed(parse_rank_manifest(json.dumps(doc).encode(), "fuzz", key=KEY.encode() if with_key else None))
    except (BadRecordError, SignatureError) as exc:
        assert "\n" not in str(exc)


@given(data=st.binary(max_size=512))
def test_fuzz_rank_manifest_bytes(data):
    try:
        _check_parsed(parse_rank_manifest(data, "fuzz"))
    except BadRecordError as exc:
        assert "\n" not in str(exc)


@given(doc=_near_rank_manifest | _json, raw=st.binary(max_size=256), use_raw=st.booleans())
def test_fuzz_manifest_parser(doc, raw, use_raw):
    """persist.atomic manifests (plain DeepSpeed saves through our engine, Megatron bases)."""
    from deadpool_ext.integrations.megatron.checkpoint import FILE_PATTERNS

    data = raw if use_raw else json.dumps(doc).encode()
    for names in ((), FILE_PATTERNS):
        try:
            _check_parsed(parse_manifest(data, "fuzz", **({"names": names} if names else {})))
        except BadRecordError as exc:
            assert "\n" not in str(exc)


@given(data=st.binary(max_size=64) | st.text(max_size=40).map(str.encode))
def test_fuzz_latest_pointer(data):
    s = open_storage(f"memory://latest-{uuid.uuid4().hex[:8]}")
    s.write_bytes(LATEST, data)
    try:
        tag = read_latest(s)
    except BadRecordError as exc:
        assert "\n" not in str(exc)
        return
    assert tag is not None and tag.startswith("global_step") and tag[len("global_step"):].isascii()


@given(name=_names)
def test_fuzz_file_names(name):
    try:
        out = check_file_name(name, "fuzz")
    except UnsafeNameError:
        return
    assert out == name and os.path.basename(name) == name and name not in (".", "..") and name.isascii()


@given(data=st.binary(max_size=512) | st.builds(pickle.dumps, _json))
def test_fuzz_dcp_metadata_unpickler(data):
    from deadpool_ext.integrations.megatron.allowlist import dcp_metadata_table

    try:
        restricted_load(data, dcp_metadata_table(), "fuzz/.metadata")
    except CheckpointTrustError as exc:
        assert "\n" not in str(exc)
