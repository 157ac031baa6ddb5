"""Shared-memory segments: persistence across handles/processes and job isolation."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from deadpool_ext.memory import shm
from deadpool_ext.memory.shm import (
    ShmSegment,
    ShmSpaceError,
    cleanup_job,
    list_segments,
    segment_name,
)

REPO = Path(__file__).resolve().parents[2]


def test_segment_name_format() -> None:
    assert segment_name("job-1", "snap", 3, 0) == "deadpool.job-1.snap.r3.0"
    assert segment_name("J_2", "replica", 0, "a") == "deadpool.J_2.replica.r0.a"


@pytest.mark.parametrize("job_id", ["", "a.b", "a/b", "..", "job 1", "j\0", "é", 7])
def test_invalid_job_id_rejected(job_id: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="job_id"):
        segment_name(job_id, "snap", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job_id"):
        list_segments(job_id, root=tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "rank", "slot"),
                         [("a.b", 0, 0), ("snap", -1, 0), ("snap", 0, -1), ("snap", 0, "x.y")])
def test_invalid_name_fields_rejected(kind: str, rank: int, slot: int | str) -> None:
    with pytest.raises(ValueError):
        segment_name("job", kind, rank, slot)


def test_names_of_two_jobs_never_collide() -> None:
    ids = ["a", "a-b", "a_b", "ab", "b", "a-", "-a"]
    kinds = ["snap", "snap-x", "x", "replica"]
    names = [segment_name(j, k, r, s) for j in ids for k in kinds for r in (0, 1, 12) for s in (0, 1, "1x")]
    assert len(names) == len(set(names))
    # And each name is found under its own job only.
    for j in ids:
        own = {n for n in names if n.startswith(f"deadpool.{j}.")}
        assert len(own) == len(kinds) * 3 * 3


def test_create_open_roundtrip_two_handles(tmp_path: Path) -> None:
    name = segment_name("job", "snap", 0, 0)
    with ShmSegment.create(name, 8192, root=tmp_path) as a, ShmSegment.open(name, root=tmp_path) as b:
        assert a.nbytes == b.nbytes == 8192
        assert a.path == tmp_path / name and a.name == name
        a.buf[:5] = b"hello"
        assert bytes(b.buf[:5]) == b"hello"
        ta = a.tensor(torch.float32, offset=4096, nbytes=16)
        tb = b.tensor(torch.float32, offset=4096, nbytes=16)
        ta.copy_(torch.arange(4, dtype=torch.float32))
        assert torch.equal(tb, torch.arange(4, dtype=torch.float32))
        del ta, tb
    assert a.closed and b.closed
    with pytest.raises(ValueError, match="closed"):
        _ = a.buf  # the property access itself raises
    assert (tmp_path / name).exists(), "closing must not unlink"


def test_create_existing_keeps_data_and_resizes(tmp_path: Path) -> None:
    name = segment_name("job", "snap", 0, 0)
    with ShmSegment.create(name, 4096, root=tmp_path) as s:
        s.buf[:3] = b"abc"
    # Re-attaching (e.g. after a restart) must not wipe the snapshot.
    with ShmSegment.create(name, 4096, root=tmp_path) as s:
        assert bytes(s.buf[:3]) == b"abc"
    with ShmSegment.create(name, 3 * 4096, root=tmp_path) as s:
        assert s.nbytes == 3 * 4096 == os.path.getsize(s.path)
        assert bytes(s.buf[:3]) == b"abc"
        assert not any(s.buf[4096:])
    with ShmSegment.create(name, 2, root=tmp_path, touch=False) as s:
        assert bytes(s.buf) == b"ab"


def test_tensor_range_checks(tmp_path: Path) -> None:
    with ShmSegment.create("deadpool.j.k.r0.0", 64, root=tmp_path) as s:
        assert s.tensor().shape == (64,)
        assert s.tensor(torch.float64).shape == (8,)
        assert s.tensor(offset=64).numel() == 0
        with pytest.raises(ValueError):
            s.tensor(offset=60, nbytes=8)
        with pytest.raises(ValueError, match="multiples"):
            s.tensor(torch.float32, offset=2, nbytes=8)


def test_close_with_live_views_is_deferred(tmp_path: Path) -> None:
    s = ShmSegment.create("deadpool.j.k.r0.0", 4096, root=tmp_path)
    t = s.tensor(torch.int32)
    view = s.buf
    mm_ref = weakref.ref(s._mm)  # type: ignore[arg-type]
    s.close()  # must not raise BufferError nor unmap under the views
    assert s.closed
    t.fill_(7)  # still mapped: would crash if close() had unmapped
    assert view[0] == 7
    s.close()  # idempotent
    del t, view
    gc.collect()
    assert mm_ref() is None, "mapping should be released once the last view is gone"


def test_open_missing_segment(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as ei:
        ShmSegment.open("deadpool.j.k.r0.0", root=tmp_path)
    assert ei.value.errno == errno.ENOENT


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden"])
def test_invalid_segment_name(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="segment name"):
        ShmSegment.create(bad, 16, root=tmp_path)


def test_space_error_for_absurd_size(tmp_path: Path) -> None:
    name = "deadpool.j.k.r0.0"
    with pytest.raises(ShmSpaceError) as ei:
        ShmSegment.create(name, 1 << 62, root=tmp_path)
    err = ei.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.needed == 1 << 62 and 0 <= err.available < err.needed
    assert str(1 << 62) in str(err) and str(tmp_path / name) in str(err)
    assert not (tmp_path / name).exists()


def test_space_error_from_fallocate_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # statvfs said yes but the memory went to someone else meanwhile: the
    # failure must be a clean ShmSpaceError, not a SIGBUS later.
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    with pytest.raises(ShmSpaceError):
        ShmSegment.create("deadpool.j.k.r0.0", 4096, root=tmp_path)
    assert list_segments(root=tmp_path) == []


def test_list_and_cleanup_job(tmp_path: Path) -> None:
    mine = [segment_name("job", k, r, 0) for k in ("snap", "replica") for r in range(3)]
    theirs = [segment_name("job-2", "snap", 0, 0), segment_name("jo", "snap", 0, 0)]
    for n in mine + theirs:
        ShmSegment.create(n, 4096, root=tmp_path, touch=False).close()
    (tmp_path / "unrelated").write_bytes(b"x")
    assert list_segments("job", root=tmp_path) == sorted(mine)
    assert list_segments(root=tmp_path) == sorted(mine + theirs)
    assert cleanup_job("job", root=tmp_path) == len(mine)
    assert list_segments(root=tmp_path) == sorted(theirs)
    assert (tmp_path / "unrelated").exists()
    assert cleanup_job("job", root=tmp_path) == 0
    assert list_segments(root=tmp_path / "missing") == []


def test_unlink_keeps_mapping_valid(tmp_path: Path) -> None:
    with ShmSegment.create("deadpool.j.k.r0.0", 4096, root=tmp_path) as s:
        s.buf[0] = 9
        s.unlink()
        s.unlink()  # idempotent
        assert not s.path.exists()
        assert s.buf[0] == 9


def test_visible_to_child_and_survives_its_hard_exit(tmp_path: Path) -> None:
    parent = segment_name("job", "snap", 0, 0)
    child = segment_name("job", "snap", 1, 0)
    with ShmSegment.create(parent, 1 << 16, root=tmp_path) as s:
        s.tensor(torch.int64).copy_(torch.arange(8192))
    code = textwrap.dedent(
        f"""
        import os, sys, torch
        from deadpool_ext.memory.shm import ShmSegment
        seg = ShmSegment.open({parent!r}, root={str(tmp_path)!r})
        ok = torch.equal(seg.tensor(torch.int64), torch.arange(8192))
        seg.buf[:4] = b"kid!"
        own = ShmSegment.create({child!r}, 4096, root={str(tmp_path)!r})
        own.buf[:5] = b"alive"
        sys.stdout.flush()
        # Die like a crashed rank: no close, no atexit, no finalizers.
        os._exit(0 if ok else 3)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with ShmSegment.open(parent, root=tmp_path) as s:
        assert bytes(s.buf[:4]) == b"kid!"
        assert torch.equal(s.tensor(torch.int64)[1:], torch.arange(1, 8192))
    with ShmSegment.open(child, root=tmp_path) as s:
        assert bytes(s.buf[:5]) == b"alive"
    assert cleanup_job("job", root=tmp_path) == 2


@pytest.mark.skipif(not os.path.isdir(shm.SHM_ROOT), reason="no /dev/shm")
def test_default_root_is_dev_shm() -> None:
    job = f"pytest-{os.getpid()}"
    name = segment_name(job, "snap", 0, 0)
    try:
        with ShmSegment.create(name, 4096) as s:
            assert s.path == Path("/dev/shm") / name
        assert list_segments(job) == [name]
    finally:
        assert cleanup_job(job) == 1
    assert list_segments(job) == []
