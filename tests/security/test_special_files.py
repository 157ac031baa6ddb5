"""A FIFO, a device node or a socket where a checkpoint file belongs is refused in one line and never blocks
(persist/regular.py): ``deadpool export`` and ``verify``, ``--load`` (resume_from_tier3), the restore's load
through our checkpoint engine, the private download cache, and the records (``latest``, manifests).

Why each kind: ``open()`` of a FIFO blocks until a writer comes (export hung on one); ``/dev/zero`` has size 0,
so a record listing an empty file would pass the size check and then be read without end; a socket is no file.
Bases are written as the tier-3 writer lays them out (``small_base``); the special file is made for real."""
from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from types import SimpleNamespace

import pytest
import torch
import xxhash

from deadpool_ext.persist.atomic import IncompleteCheckpointError, open_verified, read_manifest_records
from deadpool_ext.persist.download import download
from deadpool_ext.persist.layout import COMMIT, LATEST, read_latest, read_version, verify_version
from deadpool_ext.persist.records import BadRecordError, CheckpointTrustError
from deadpool_ext.persist.regular import NotRegularFileError, open_regular_file
from deadpool_ext.persist.storage import open_storage
from tests.security.test_storage import TAG, cli, refused_in_one_line, small_base

pytestmark = pytest.mark.timeout(60)
NAME = "mp_rank_00_model_states.pt"
KINDS = ["fifo", "device", "socket"]
WORDS = {"fifo": "named pipe (FIFO)", "device": "character device", "socket": "socket"}


def make_special(path: str, kind: str) -> object:
    """A real special file at `path`; returns what must stay alive (the socket)."""
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return None
    if kind == "device":
        try:   # /dev/zero's numbers: read without end, and its size is 0
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD")
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # An AF_UNIX address holds at most 107 bytes, less than a pytest tmp path can take: bound under a short name
    # in the same directory and renamed into place (a rename keeps the socket inode).
    short = os.path.join(os.path.dirname(path), "s")
    if len(short.encode()) > 100:
        short = os.path.join(tempfile.mkdtemp(prefix="dps", dir="/tmp"), "s")
    sock.bind(short)
    os.rename(short, path)
    sock.listen(1)
    return sock


def plant(url: str, kind: str, *, empty_in_record: bool) -> object:
    """The base's model file replaced by a special file. `empty_in_record`: the commit record is rewritten to list
    an empty file (size 0 matches a FIFO's or a device's, so the checks that stat the file pass)."""
    keep = make_special(os.path.join(url, TAG, NAME), kind)
    if empty_in_record:
        cpath = os.path.join(url, TAG, COMMIT)
        rec = json.load(open(cpath))
        rec["files"][NAME] = {"nbytes": 0, "xxh3_64": xxhash.xxh3_64(b"").hexdigest(), "rank": 0}
        rec["total_bytes"] = 0
        json.dump(rec, open(cpath, "w"))
    return keep


@pytest.mark.parametrize("kind", KINDS)
def test_the_one_opener_refuses_every_special_file_in_one_line(tmp_path, kind):
    keep = make_special(str(tmp_path / "f"), kind)
    with pytest.raises(NotRegularFileError) as exc:
        open_regular_file(str(tmp_path / "f"), "s3://bucket/run/f")
    assert str(exc.value) == (f"s3://bucket/run/f: a {WORDS[kind]}, not a regular file; checkpoint files are read "
                              "only from regular files (refused without reading it)")
    assert isinstance(exc.value, CheckpointTrustError)
    del keep


@pytest.mark.parametrize("kind", KINDS)
def test_verify_refuses_a_special_file_listed_as_empty(tmp_path, kind):
    url = str(tmp_path / "t3")
    small_base(url)
    keep = plant(url, kind, empty_in_record=True)
    storage = open_storage(url, create=False)
    (problem,) = verify_version(storage, read_version(storage, TAG))
    assert f"{TAG}/{NAME}" in problem and WORDS[kind] in problem
    del keep


@pytest.mark.parametrize("kind", KINDS)
def test_download_to_the_cache_refuses_a_special_source_and_replaces_a_planted_one(tmp_path, kind):
    url = str(tmp_path / "t3")
    small_base(url)
    storage = open_storage(url, create=False)
    info = read_version(storage, TAG)
    cache = tmp_path / "cache"
    keep = make_special(str(tmp_path / "x"), "fifo")   # (a FIFO in the cache is downloaded over, never opened)
    download(storage, info, str(cache))
    keep = make_special(str(cache / TAG / NAME), kind)
    download(storage, info, str(cache))
    assert stat.S_ISREG(os.lstat(cache / TAG / NAME).st_mode)
    keep = plant(url, kind, empty_in_record=False)
    with pytest.raises(NotRegularFileError, match=WORDS[kind].replace("(", r"\(").replace(")", r"\)")):
        download(storage, read_version(storage, TAG), str(tmp_path / "cache2"))
    del keep


@pytest.mark.parametrize("kind", KINDS)
def test_the_restore_load_refuses_a_file_swapped_after_verification(tmp_path, kind):
    """The load itself (our checkpoint engine's open_verified) after the base was verified."""
    d = tmp_path / TAG
    d.mkdir()
    keep = make_special(str(d / NAME), kind)
    with pytest.raises(IncompleteCheckpointError, match=f"{NAME}: a {WORDS[kind].split(' (')[0]}"):
        open_verified(str(d / NAME), {NAME: {"nbytes": 0, "xxh3_64": xxhash.xxh3_64(b"").hexdigest()}})
    del keep


@pytest.mark.parametrize("kind", KINDS)
def test_records_that_are_special_files_are_refused(tmp_path, kind):
    url = str(tmp_path / "t3")
    small_base(url)
    keep = make_special(os.path.join(url, LATEST), kind)
    with pytest.raises(BadRecordError, match=f"{LATEST}: a "):
        read_latest(open_storage(url, create=False))
    man = tmp_path / "m"
    man.mkdir()
    keep2 = make_special(str(man / "deadpool_manifest.rank0.json"), kind)
    with pytest.raises(NotRegularFileError):
        read_manifest_records(str(man))
    del keep, keep2


@pytest.fixture(scope="module")
def one_rank_world():
    """A 1-rank gloo world: what --load's agreement runs in (the engine is not reached for a refused base)."""
    import torch.distributed as dist

    from deadpool_ext.testing.launch import free_port

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield SimpleNamespace(device=torch.device("cpu"), checkpoint_engine=None, global_rank=0)
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("empty_in_record", [False, True])
def test_load_refuses_a_base_holding_a_special_file(tmp_path, one_rank_world, kind, empty_in_record):
    from deadpool_ext.integrations.deepspeed.resume import NoVerifiedBaseError, resume_from_tier3

    url = str(tmp_path / "t3")
    small_base(url)
    keep = plant(url, kind, empty_in_record=empty_in_record)
    with pytest.raises(NoVerifiedBaseError) as exc:
        resume_from_tier3(one_rank_world, url)
    said = " ".join(exc.value.refused.get(TAG, []))  # why this base was refused, as the load decided it
    assert f"{TAG}/{NAME}" in said and (WORDS[kind] in said or "size 0 != " in said), exc.value.refused
    del keep


@pytest.mark.parametrize("kind", KINDS)
def test_export_refuses_a_special_file_without_hanging(tmp_path, kind):
    from deadpool_ext.integrations.deepspeed.export import ExportError, export_safetensors

    url = str(tmp_path / "t3")
    small_base(url)
    keep = plant(url, kind, empty_in_record=False)
    with pytest.raises(ExportError, match=WORDS[kind].replace("(", r"\(").replace(")", r"\)")):
        export_safetensors(url, str(tmp_path / "m.safetensors"), cache_root=str(tmp_path / "c"), log=print)
    assert not (tmp_path / "m.safetensors").exists()
    del keep


@pytest.mark.parametrize("command", ["export", "verify"])
def test_cli_refuses_a_fifo_in_one_line(tmp_path, command):
    """The reported case end to end: the record as written, the file replaced by a named pipe."""
    url = str(tmp_path / "t3")
    small_base(url)
    plant(url, "fifo", empty_in_record=command == "verify")
    args = ["export", url, "--out", str(tmp_path / "m.safetensors"), "--cache", str(tmp_path / "c")] \
        if command == "export" else ["verify", url]
    refused_in_one_line(cli(*args, timeout=60), 1, (f"{TAG}/{NAME}",))  # test_storage's one refusal check
