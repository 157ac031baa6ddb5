"""Tier 3 on S3 through s3fs, against a real S3-compatible server: moto's, on 127.0.0.1 (no other network).

- the storage contract (temporary object, publish by move, list, read, delete) on ``s3://``;
- the publish protocol on ``s3://``: data files, then each rank's manifest, then the commit record LAST, then
  ``latest``; garbage collection and checksum verification against objects on the server;
- end to end: a 2-rank CPU DeepSpeed job saves tier-3 bases to ``s3://bucket/run``, a relaunch with ``--load``
  resumes from them with losses identical bit for bit to an uninterrupted run; ``deadpool inspect`` and
  ``deadpool verify`` read the bucket.

The server is moto's ``ThreadedMotoServer`` (``pip install "moto[server]" s3fs``, in setup.py's ``test`` extra
and requirements.txt). If it cannot be imported or started, the fixture errors: these tests fail, never skip.
s3fs is pointed at it with ``AWS_ENDPOINT_URL`` (read by botocore when a client is made, so it applies in this
process after fsspec was imported, and in every child process through the inherited environment) plus fake
credentials; shared AWS config files and the EC2 metadata service are switched off so nothing leaves loopback.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from urllib.parse import urlparse

import pytest
import torch

from deadpool_ext.persist.download import cache_dir_for, download
from deadpool_ext.persist.layout import COMMIT, LATEST, list_versions, load_candidates, read_commit, verify_version
from deadpool_ext.persist.storage import FsspecStorage, open_storage
from deadpool_ext.testing.launch import base_env, free_port
from tests.conftest import make_config
from tests.integration.helpers import baseline, pretrain
from tests.log_interface import assert_refusal
from tests.unit.test_persist_tier3 import _job, _writer
from tests.unit.test_persist_tier3 import test_storage_contract as storage_contract

pytestmark = pytest.mark.slow


def _clear_s3fs_instances() -> None:
    # fsspec caches one S3FileSystem per set of options; its client would still point at a stopped server.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1:<free port>, with this process's and its children's environment pointing
    s3fs/botocore at it. Yields the endpoint URL; the server is stopped afterwards."""
    from moto.server import ThreadedMotoServer  # ImportError here = test error (fail), on purpose

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    nowhere = str(tmp_path_factory.mktemp("aws") / "none")
    mp = pytest.MonkeyPatch()
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3",
                "FSSPEC_S3_ENDPOINT_URL", "FSSPEC_S3"):
        mp.delenv(var, raising=False)
    mp.setenv("AWS_ENDPOINT_URL", endpoint)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_CONFIG_FILE", nowhere)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", nowhere)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mp.setenv("NO_PROXY", "127.0.0.1,localhost")
    mp.setenv("no_proxy", "127.0.0.1,localhost")
    _clear_s3fs_instances()
    try:
        import boto3

        # The server really answers on loopback (fails the test, not skips, if it did not start).
        boto3.client("s3", endpoint_url=endpoint).list_buckets()
        yield endpoint
    finally:
        _clear_s3fs_instances()
        mp.undo()
        server.stop()


@pytest.fixture
def s3_bucket(moto_s3):
    """A fresh bucket per test (a random name: the tier-3 download cache is keyed by URL). Yields
    ``(bucket, boto3 client pinned to the moto endpoint)`` to inspect objects independently of s3fs."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_s3)
    bucket = f"dp-t3-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    _clear_s3fs_instances()
    yield bucket, client
    shutil.rmtree(cache_dir_for(f"s3://{bucket}/run"), ignore_errors=True)


def _keys(client, bucket: str, prefix: str = "") -> list[str]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def test_fixture_talks_to_loopback_moto_only(moto_s3, s3_bucket):
    bucket, client = s3_bucket
    assert urlparse(moto_s3).hostname == "127.0.0.1"
    storage = open_storage(f"s3://{bucket}/probe")
    assert isinstance(storage, FsspecStorage) and type(storage.fs).__name__ == "S3FileSystem"
    assert storage.fs.s3.meta.endpoint_url.rstrip("/") == moto_s3  # s3fs's own client, from the environment
    storage.write_bytes("hello", b"world")
    assert client.get_object(Bucket=bucket, Key="probe/hello")["Body"].read() == b"world"


# -- storage contract (same calls as tests/unit/test_persist_tier3.py::test_storage_contract) -----------------
def test_storage_contract_on_s3(s3_bucket):
    bucket, client = s3_bucket
    storage = open_storage(f"s3://{bucket}/t3")
    assert isinstance(storage, FsspecStorage)
    storage_contract(storage)  # the unit suite's contract, unchanged
    # What the server holds: published objects only, no temporary object left behind by publish or abort.
    w = storage.open_temp("global_step1/a.bin")
    w.write(b"abcdef")
    w.publish()
    assert client.get_object(Bucket=bucket, Key="t3/global_step1/a.bin")["Body"].read() == b"abcdef"
    w2 = storage.open_temp("global_step1/b.bin")
    w2.write(b"x")
    w2.abort()
    assert _keys(client, bucket, "t3/global_step1/") == ["t3/global_step1/a.bin"]
    assert storage.listdir("") == ["global_step1", "latest"]
    assert storage.exists("global_step1") and not storage.exists("nope")
    # chunked reads (what verification and the resume download use)
    big = os.urandom(3 << 20)
    storage.write_bytes("global_step1/big.bin", big)
    assert b"".join(storage.iter_chunks("global_step1/big.bin", chunk=1 << 20)) == big
    storage.remove("global_step1/big.bin")
    storage.remove("global_step1/does-not-exist")  # no error
    storage.remove_tree("global_step1")
    assert not storage.exists("global_step1/a.bin") and storage.listdir("global_step1") == []
    assert _keys(client, bucket, "t3/") == ["t3/latest"]
    storage.remove_tree("nope")  # no error
    # A second, uncached view of the bucket (another process's s3fs) sees the same thing.
    _clear_s3fs_instances()
    assert open_storage(f"s3://{bucket}/t3").listdir("") == ["latest"]


def test_multipart_upload_publishes_whole_object(s3_bucket):
    """A file larger than s3fs's 5 MiB block goes up as a multipart upload under the temporary name, then moves."""
    bucket, client = s3_bucket
    storage = open_storage(f"s3://{bucket}/t3")
    data = os.urandom(13 << 20)
    w = storage.open_temp("global_step2/big.pt")
    for off in range(0, len(data), 4 << 20):
        w.write(memoryview(data)[off: off + (4 << 20)])
    assert not storage.exists("global_step2/big.pt")
    w.publish()
    assert storage.size("global_step2/big.pt") == len(data) and storage.read_bytes("global_step2/big.pt") == data
    assert _keys(client, bucket, "t3/") == ["t3/global_step2/big.pt"]


# -- publish protocol on s3: commit record last, latest after it, GC, verification --------------------------
def test_publish_protocol_commit_last_gc_and_verify_on_s3(s3_bucket):
    bucket, client = s3_bucket
    url = f"s3://{bucket}/run"
    storage = open_storage(url)
    w0, w1 = _writer(storage), _writer(storage)
    try:
        for v in (2, 4, 6):
            w0.submit(_job(v, 0, 2))
            # rank 1 has not written yet: once rank 0's data and manifest are on the server, the base is still
            # not visible (the coordinator is waiting for rank 1's manifest)
            tag = f"global_step{v}"
            deadline = time.time() + 60
            while f"run/{tag}/deadpool_manifest.rank0.json" not in (keys := _keys(client, bucket, f"run/{tag}/")):
                assert time.time() < deadline, keys
                time.sleep(0.05)
            assert f"run/{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt" in keys and f"run/{tag}/{COMMIT}" not in keys
            assert read_commit(storage, tag) is None and v not in [i.version for i in load_candidates(storage)]
            w1.submit(_job(v, 1, 2))
            assert w0.wait_idle(60) and w1.wait_idle(60)
            assert w0.history[-1]["ok"] is True, w0.history[-1]
            assert storage.read_bytes(LATEST) == tag.encode()
        # keep_last=2: base 2 deleted (from the server) after 6 was published and verified
        assert [i.version for i in list_versions(storage)] == [4, 6]
        assert not _keys(client, bucket, "run/global_step2/")
        assert sorted(k for k in _keys(client, bucket, "run/") if "/" not in k[len("run/"):]) == \
            ["run/latest", "run/zero_to_fp32.py"]
        assert not [k for k in _keys(client, bucket) if "/.tmp." in k]
        info = load_candidates(storage)[0]
        assert info.version == 6 and verify_version(storage, info) == [] and len(info.commit["files"]) == 2
        # The commit record was written after both ranks' files and manifests (object timestamps, 1 s granular
        # in S3: at least not earlier) and names every file with the size the server holds.
        heads = {k: client.head_object(Bucket=bucket, Key=k) for k in _keys(client, bucket, "run/global_step6/")}
        commit_t = heads[f"run/global_step6/{COMMIT}"]["LastModified"]
        assert all(h["LastModified"] <= commit_t for h in heads.values())
        for name, entry in info.commit["files"].items():
            assert heads[f"run/global_step6/{name}"]["ContentLength"] == entry["nbytes"]
        # payload round trip through the server
        import io

        loaded = torch.load(io.BytesIO(storage.read_bytes("global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt")))
        assert loaded["x"][0] == 7 and loaded["step"] == 6
        # a corrupted object (same size) is named by verification
        key = "run/global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt"
        body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[200] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        _clear_s3fs_instances()
        errs = verify_version(open_storage(url), load_candidates(open_storage(url))[0])
        assert len(errs) == 1 and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in errs[0] and "checksum" in errs[0]
    finally:
        w0.close(5), w1.close(5)


def test_missing_rank_abandons_base_on_s3(s3_bucket):
    bucket, _ = s3_bucket
    storage = open_storage(f"s3://{bucket}/run")
    w0 = _writer(storage)
    try:
        w0.submit(_job(3, 0, 1))
        assert w0.wait_idle(60) and w0.history[-1]["ok"] is True, w0.history[-1]
        w0.submit(_job(6, 0, 2, deadline_s=1.0))  # rank 1 never writes
        assert w0.wait_idle(60)
        assert w0.history[-1]["ok"] is False and "ranks [1] did not finish" in w0.history[-1]["error"]
        assert [i.version for i in load_candidates(storage)] == [3] and storage.read_bytes(LATEST) == b"global_step3"
    finally:
        w0.close(5)


def test_resume_download_returns_the_verified_bytes_after_a_base_is_rewritten(s3_bucket, tmp_path):
    """``resume_from_tier3`` verifies the base on S3, then loads a local copy made by ``download`` into
    ``cache_dir_for(url)``, trusting it (``mark_verified``). A base rewritten at the same URL and tag (a user
    pinned ``latest`` back and retrained, or the URL reused by a new run) has files of the same sizes: the copy
    must still be the new bytes, not a stale cached file from an earlier resume."""
    bucket, _ = s3_bucket
    url = f"s3://{bucket}/run"
    storage = open_storage(url)
    cache = cache_dir_for(url, str(tmp_path / "cache"))
    w0 = _writer(storage, keep_last=5)
    try:
        w0.submit(_job(4, 0, 1))
        assert w0.wait_idle(60) and w0.history[-1]["ok"] is True
        download(storage, load_candidates(storage)[0], cache)  # first resume
        # the base at global_step4 is replaced by one with different contents, same shapes
        storage.remove(f"global_step4/{COMMIT}")
        storage.remove_tree("global_step4")
        job = _job(4, 0, 1)
        job.files[0].state["x"] = torch.full((1000,), -1.0)
        w0.submit(job)
        assert w0.wait_idle(60) and w0.history[-1]["ok"] is True
    finally:
        w0.close(5)
    info = load_candidates(storage)[0]
    assert verify_version(storage, info) == []  # what resume_from_tier3 checks on the remote objects
    download(storage, info, cache)  # second resume
    from deadpool_ext.persist.layout import checksum_stream

    for name, entry in info.commit["files"].items():
        with open(os.path.join(cache, info.tag, name), "rb") as fh:
            _, digest = checksum_stream(iter(lambda: fh.read(1 << 20), b""))
        assert digest == entry["xxh3_64"], f"{name}: the local copy that resume loads is not the verified base"


# -- end to end: real 2-rank DeepSpeed jobs saving to and resuming from s3://bucket/run ------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deadpool_ext.cli", *args], capture_output=True, text=True,
                          timeout=180, env=base_env())


def test_save_to_s3_relaunch_with_load_identical_losses_inspect_verify(tmp_path, s3_bucket):
    bucket, client = s3_bucket
    url = f"s3://{bucket}/run"
    cfg = make_config(tmp_path, stage=3, deadpool=None)  # standalone tier 3 (no deadpool section)
    # Uninterrupted reference (WarmupLR does not depend on --train-iters, so 4 + resume to 8 == 8).
    ref = baseline(tmp_path, cfg, iters=8)  # every step logged (testing/baselines.py: shared with test_peer_sign)
    # First job: one base, at its last step (one base is in flight at a time; a base due while the previous one
    # is still being written is skipped by design, so a single base per job keeps this deterministic), written
    # to S3 in the background; close() drains the writer before the job exits.
    res1, first, _ = pretrain(tmp_path, cfg, iters=4, extra=["--save", url, "--save-interval", "4"], name="first")
    assert res1.returncode == 0, res1.output[-3000:]
    assert {s: ref[s] for s in first} == first  # tier 3 does not change training
    keys = _keys(client, bucket)
    assert client.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"global_step4", keys
    assert f"run/global_step4/{COMMIT}" in keys
    for r in (0, 1):
        assert f"run/global_step4/deadpool_manifest.rank{r}.json" in keys
        assert f"run/global_step4/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in keys
        assert f"run/global_step4/zero_pp_rank_{r}_mp_rank_00_model_states.pt" in keys
    assert "run/zero_to_fp32.py" in keys and not [k for k in keys if "/.tmp." in k]
    # deadpool inspect / verify on the bucket
    i = _cli("inspect", url, "--json", "--shm-root", str(tmp_path / "noshm"))
    assert i.returncode == 0, i.stdout + i.stderr
    rep = json.loads(i.stdout)["tier3"]
    assert rep["url"] == url and rep["latest"] == "global_step4"
    assert [(r["version"], r["complete"], r["world_size"], r["dp_world_size"], r["zero_stage"])
            for r in rep["versions"]] == [(4, True, 2, 2, 3)]
    commit = json.loads(client.get_object(Bucket=bucket, Key=f"run/global_step4/{COMMIT}")["Body"].read())
    assert rep["versions"][0]["bytes"] == commit["total_bytes"] and rep["versions"][0]["files"] == len(commit["files"])
    v = _cli("verify", url, "--json")
    assert v.returncode == 0, v.stdout + v.stderr
    assert [(b["tag"], b["verdict"]) for b in json.loads(v.stdout)["bases"]] == [("global_step4", "ok")]
    # Relaunch: every process is new; --load resumes from global_step4 on S3 and keeps saving there.
    res2, resumed, _ = pretrain(tmp_path, cfg, iters=8, extra=["--load", url, "--save", url, "--save-interval", "4"],
                                name="relaunched")
    assert res2.returncode == 0, res2.output[-3000:]
    assert sorted(resumed) == [5, 6, 7, 8], (sorted(resumed), res2.output[-3000:])  # resumed from base 4
    assert {s: ref[s] for s in resumed} == resumed  # bit for bit
    assert client.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"global_step8"
    i2 = _cli("inspect", url, "--json", "--shm-root", str(tmp_path / "noshm"))
    assert [(r["version"], r["complete"]) for r in json.loads(i2.stdout)["tier3"]["versions"]] == [(4, True), (8, True)]
    # A corrupted object is refused by verify, naming it.
    key = "run/global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    v2 = _cli("verify", url, "--json")
    assert v2.returncode == 1, v2.stdout + v2.stderr
    out = json.loads(v2.stdout)
    assert [(b["tag"], b["verdict"]) for b in out["bases"]] == [("global_step4", "ok"), ("global_step8", "bad")]
    (bad,) = out["bases"][1]["errors"]  # one error, naming the corrupted object
    assert "global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt" in bad and out["problems"] == [bad], out


def test_readers_do_not_create_a_missing_bucket(moto_s3, s3_bucket, tmp_path):
    """``deadpool inspect|verify`` on a mistyped bucket: a one-line error naming it, exit 2, and no bucket
    appears (s3fs would create it if the reader asked for the directory)."""
    _, client = s3_bucket
    missing = f"typo-{uuid.uuid4().hex[:8]}"
    for cmd in (["inspect", f"s3://{missing}/run", "--shm-root", str(tmp_path / "noshm")], ["verify", f"s3://{missing}/run"]):
        assert_refusal(_cli(*cmd), rc=2, names=f"s3://{missing}/run: no such tier-3 location")
    assert missing not in [b["Name"] for b in client.list_buckets()["Buckets"]]
