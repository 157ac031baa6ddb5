"""Issue 14 item 5: node-local shared memory trusts only what this user made, reached without symlinks.

Real directories and files: another user is simulated by chown to uid 12345 (the tests run as root; without
root those cases skip), symlinks point at files the test watches, and a live ``sleep`` stands in for a process
whose pid a stale pid file happens to name."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadpool_ext.launcher.contract import WorkerEnv, job_id_from
from deadpool_ext.memory import agent, trust
from deadpool_ext.memory.shm import ShmSegment, UntrustedPathError, ensure_private_dir, job_shm_dir, segment_name
from deadpool_ext.testing.wait import wait_until

OTHER_UID = 12345
as_root = pytest.mark.skipif(os.getuid() != 0, reason="simulating another user needs chown (root)")
SEG = segment_name("job", "snap", 0, 0)


@pytest.fixture
def root(tmp_path):
    """A shared-memory root like /dev/shm: world-writable, sticky."""
    r = tmp_path / "shm"
    r.mkdir()
    os.chmod(r, 0o1777)
    return r


@pytest.fixture
def job_dir(root):
    return job_shm_dir(str(root), "job", "node0")


@pytest.fixture
def private_dir(job_dir):
    ensure_private_dir(job_dir)
    return job_dir


@pytest.fixture
def victim(tmp_path):
    """A file outside the shared-memory root that nothing may write through a link."""
    v = tmp_path / "victim"
    v.write_bytes(b"precious")
    return v


@pytest.fixture
def other_process():
    """A live process that is not the launcher (its pid is what a stale pid file may name after reuse)."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait(timeout=10)


@pytest.fixture
def launcher():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait(timeout=10)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _write_raw(directory: str, name: str, text: str) -> None:
    with open(os.path.join(directory, name), "w") as fh:
        fh.write(text)


# -- directories ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_job_directory_is_created_0700(job_dir, umask, launcher):
    old = os.umask(umask)
    try:
        ensure_private_dir(job_dir)
        assert _mode(job_dir) == 0o700
        node2 = job_dir + "-b"
        agent.claim_directory(node2, launcher.pid)  # the agent's own creation path
        assert _mode(node2) == 0o700
        assert _mode(os.path.join(node2, agent.LAUNCHER_FILE)) == 0o600
    finally:
        os.umask(old)


@as_root
def test_directory_precreated_by_another_user_is_refused(job_dir, launcher):
    os.mkdir(job_dir, 0o700)
    os.chown(job_dir, OTHER_UID, OTHER_UID)
    for claim in (lambda: ensure_private_dir(job_dir), lambda: agent.claim_directory(job_dir, launcher.pid),
                  lambda: agent.ensure_agent(job_dir, launcher.pid)):
        with pytest.raises(UntrustedPathError, match=f"refusing {job_dir}: owned by uid {OTHER_UID}"):
            claim()
    assert os.listdir(job_dir) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722])
def test_directory_writable_by_others_is_refused(job_dir, mode, launcher):
    os.mkdir(job_dir)
    os.chmod(job_dir, mode)
    for claim in (lambda: ensure_private_dir(job_dir), lambda: agent.claim_directory(job_dir, launcher.pid)):
        with pytest.raises(UntrustedPathError, match="lets group or others write"):
            claim()
    assert os.listdir(job_dir) == [] and _mode(job_dir) == mode


def test_stale_directory_of_ours_readable_by_others_is_tightened(job_dir):
    os.mkdir(job_dir)
    os.chmod(job_dir, 0o755)  # what earlier versions created
    ensure_private_dir(job_dir)
    assert _mode(job_dir) == 0o700


@pytest.mark.parametrize("dangling", [False, True])
def test_symlinked_job_directory_is_refused_and_nothing_written_outside(job_dir, tmp_path, dangling, launcher):
    elsewhere = tmp_path / "elsewhere"
    if not dangling:
        elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, job_dir)
    for claim in (lambda: ensure_private_dir(job_dir), lambda: agent.claim_directory(job_dir, launcher.pid)):
        with pytest.raises(UntrustedPathError, match="symbolic link"):
            claim()
    assert os.path.islink(job_dir)
    assert (os.listdir(elsewhere) == []) if not dangling else not elsewhere.exists()


def test_job_dir_file_in_place_of_the_directory_is_refused(job_dir):
    open(job_dir, "w").close()
    with pytest.raises(UntrustedPathError, match="is a regular file, expected a directory"):
        ensure_private_dir(job_dir)


def test_job_id_with_path_characters_is_rejected_before_the_join(root):
    for bad in ("../../etc", "a/b", "a.b", ""):
        with pytest.raises(ValueError, match="job_id"):
            job_shm_dir(str(root), bad, "node0")


# -- segments ------------------------------------------------------------------------------------------------


def _precreate(private_dir: str, content: bytes = b"x" * 4096) -> str:
    path = os.path.join(private_dir, SEG)
    with open(path, "wb") as fh:
        fh.write(content)
    os.chmod(path, 0o600)
    return path


def _both_refused(private_dir: str, match: str) -> None:
    with pytest.raises(UntrustedPathError, match=match):
        ShmSegment.create(SEG, 8192, root=private_dir)
    with pytest.raises(UntrustedPathError, match=match):
        ShmSegment.open(SEG, root=private_dir)


@as_root
def test_segment_precreated_by_another_user_is_refused(private_dir):
    path = _precreate(private_dir)
    os.chown(path, OTHER_UID, OTHER_UID)
    _both_refused(private_dir, f"owned by uid {OTHER_UID}")
    assert open(path, "rb").read() == b"x" * 4096  # not resized, not mapped


def test_segment_writable_by_others_is_refused(private_dir):
    path = _precreate(private_dir)
    os.chmod(path, 0o666)
    _both_refused(private_dir, "lets group or others write")
    assert os.path.getsize(path) == 4096


def test_symlinked_segment_is_refused_and_target_untouched(private_dir, victim):
    os.symlink(victim, os.path.join(private_dir, SEG))
    _both_refused(private_dir, "symbolic links are never followed")
    assert victim.read_bytes() == b"precious"


def test_hard_linked_segment_is_refused(private_dir, victim):
    os.chmod(victim, 0o600)
    os.link(victim, os.path.join(private_dir, SEG))
    _both_refused(private_dir, "2 hard links")
    assert victim.read_bytes() == b"precious"


def test_fifo_in_place_of_a_segment_is_refused(private_dir):
    os.mkfifo(os.path.join(private_dir, SEG), 0o600)
    _both_refused(private_dir, "is a FIFO, expected a regular file")


def test_created_segment_is_0600_whatever_the_umask(private_dir):
    old = os.umask(0)
    try:
        with ShmSegment.create(SEG, 4096, root=private_dir) as seg:
            assert _mode(seg.path) == 0o600
    finally:
        os.umask(old)


# -- pid files -----------------------------------------------------------------------------------------------


def test_pid_file_write_never_follows_a_planted_link(private_dir, victim, launcher):
    for name in (agent.LAUNCHER_FILE + ".tmp", agent.PIDFILE + ".tmp"):  # the old fixed temporary names
        os.symlink(victim, os.path.join(private_dir, name))
    agent.claim_directory(private_dir, launcher.pid)
    assert victim.read_bytes() == b"precious"
    path = os.path.join(private_dir, agent.LAUNCHER_FILE)
    assert not os.path.islink(path) and agent.read_record(private_dir, agent.LAUNCHER_FILE)[0] == launcher.pid


def test_pid_file_that_is_a_symlink_is_refused(private_dir, tmp_path, other_process, launcher):
    target = tmp_path / "elsewhere.pid"
    target.write_text(f"{other_process.pid} {trust.process_start_time(other_process.pid)}")
    os.symlink(target, os.path.join(private_dir, agent.LAUNCHER_FILE))
    with pytest.raises(UntrustedPathError, match="launcher.pid: it is not a regular file"):
        agent.claim_directory(private_dir, launcher.pid)
    with pytest.raises(UntrustedPathError, match="not a regular file"):
        agent.read_record(private_dir, agent.LAUNCHER_FILE)


def _reused(kind: str, proc: subprocess.Popen) -> str:
    """What a stale pid file holds once its pid belongs to ``proc``: a bare pid (the old format), or a record
    whose start time is not ``proc``'s (the launcher's, long gone)."""
    start = trust.process_start_time(proc.pid)
    assert start is not None
    return str(proc.pid) if kind == "bare" else f"{proc.pid} {start - 1}"


@pytest.mark.parametrize("kind", ["bare", "other_start"])
def test_stale_directory_whose_launcher_pid_was_reused_is_removed(private_dir, kind, other_process, launcher):
    _write_raw(private_dir, agent.LAUNCHER_FILE, _reused(kind, other_process))
    _write_raw(private_dir, SEG, "snapshot of an earlier job")
    assert agent.claim_directory(private_dir, launcher.pid) is True  # stale: removed, not adopted
    assert os.listdir(private_dir) == [agent.LAUNCHER_FILE]


@pytest.mark.parametrize("kind", ["bare", "other_start"])
def test_agent_pid_reused_by_another_process_is_not_trusted(private_dir, kind, other_process, launcher):
    _write_raw(private_dir, agent.PIDFILE, _reused(kind, other_process))
    pid = agent.ensure_agent(private_dir, launcher.pid, keep_s=0)
    try:
        assert pid != other_process.pid
        assert agent.running(agent.read_record(private_dir, agent.PIDFILE))  # a real agent was started
    finally:
        os.kill(pid, 9)


@pytest.mark.parametrize("kind", ["bare", "other_start"])
def test_launcher_pid_reused_by_another_process_does_not_keep_memory(private_dir, kind, other_process):
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ag = None
    try:
        agent.claim_directory(private_dir, first.pid, keep_s=0.5)
        ag = subprocess.Popen([sys.executable, "-m", "deadpool_ext.memory.agent", "--dir", private_dir,
                               "--watch-pid", str(first.pid), "--keep-s", "0.5", "--poll-s", "0.05"])
        # The launcher file now names a live process that is not a launcher of this job.
        _write_raw(private_dir, agent.LAUNCHER_FILE, _reused(kind, other_process))
        first.kill()
        first.wait(timeout=10)
        wait_until(lambda: not os.path.exists(private_dir), 15, "the agent to remove the directory of the "
                   "exited launcher (the pid in launcher.pid is another process)")
        assert ag.wait(timeout=10) == 0
    finally:
        for p in (first, ag):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_process_start_time_tells_a_process_from_a_reuse_of_its_pid(other_process):
    start = trust.process_start_time(other_process.pid)
    assert start is not None and agent.running((other_process.pid, start))
    assert not agent.running((other_process.pid, start + 1)) and not agent.running((other_process.pid, start - 1))
    other_process.kill()
    other_process.wait(timeout=10)
    assert trust.process_start_time(other_process.pid) is None and not agent.running((other_process.pid, start))


# -- job ids -------------------------------------------------------------------------------------------------


def test_default_job_id_is_not_a_hash_of_the_master_address(tmp_path):
    env = WorkerEnv.from_environ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    guessable = "j" + hashlib.sha1(b"10.0.0.1:29500").hexdigest()[:12]  # what the old default was
    k1, k2 = trust.user_key(str(tmp_path / "k1")), trust.user_key(str(tmp_path / "k2"))
    assert k1 != k2 and len(k1) == 32
    a = env.default_job_id(key=k1)
    assert a != guessable and a == env.default_job_id(key=k1)
    assert a != env.default_job_id(key=k2)  # another user (another key): another name
    assert a != WorkerEnv.from_environ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}).default_job_id(key=k1)
    assert a == job_id_from(k1, "10.0.0.1:29500")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        job_id_from(b"short")


def test_default_job_id_is_stable_across_processes_of_one_user(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    environ = {"MASTER_ADDR": "h", "MASTER_PORT": "1"}
    mine = WorkerEnv.from_environ(environ).default_job_id()
    code = ("import json; from deadpool_ext.launcher.contract import WorkerEnv; "
            f"print(json.dumps(WorkerEnv.from_environ({environ!r}).default_job_id()))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    other = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      timeout=120, env=env).stdout)
    assert mine == other and mine.startswith("j") and len(mine) == 25
    key = tmp_path / "cache" / "deadpool" / trust.KEY_NAME
    assert _mode(key) == 0o600 and _mode(key.parent) == 0o700


@as_root
def test_key_of_another_user_is_refused(tmp_path):
    d = tmp_path / "keys"
    trust.user_key(str(d))
    os.chown(d / trust.KEY_NAME, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedPathError, match=f"job-key: owned by uid {OTHER_UID}"):
        trust.user_key(str(d))


def test_key_that_is_a_symlink_is_refused(tmp_path, victim):
    d = tmp_path / "keys"
    d.mkdir(mode=0o700)
    os.symlink(victim, d / trust.KEY_NAME)
    with pytest.raises(UntrustedPathError, match="not a regular file"):
        trust.user_key(str(d))
    assert victim.read_bytes() == b"precious"


# -- fuzz ----------------------------------------------------------------------------------------------------


@given(st.binary(max_size=80))
def test_fuzz_pid_file_contents(tmp_path_factory, data):
    """Any bytes in a pid file read as no record, a record, or a record of nobody; never an exception."""
    d = str(tmp_path_factory.mktemp("pid") / "deadpool.job.n")
    ensure_private_dir(d)
    with open(os.path.join(d, agent.LAUNCHER_FILE), "wb") as fh:
        fh.write(data)
    rec = agent.read_record(d, agent.LAUNCHER_FILE)
    assert rec is not None and len(rec) == 2 and all(type(x) is int for x in rec)
    assert agent.running(rec) in (True, False)
    if rec != (0, -1):
        assert [int(x) for x in data.split()] == list(rec) and rec[0] > 0


@given(st.text(max_size=40))
def test_fuzz_segment_names(tmp_path_factory, name):
    """A segment name from anywhere opens a segment, or is refused with ValueError, FileNotFoundError or
    UntrustedPathError; it never reaches outside its directory."""
    d = tmp_path_factory.mktemp("seg")
    try:
        ShmSegment.open(name, root=d).close()
    except (ValueError, FileNotFoundError, UntrustedPathError):
        pass
    assert list(d.iterdir()) == []


# -- the restore path ----------------------------------------------------------------------------------------


def test_symlinked_slot_is_never_restored_from_nor_written_through(shm_root, tmp_path):
    """A slot replaced by a link to a (valid) blob elsewhere: the scan refuses it (logged), and the
    restore stops with one line naming it instead of mapping (and later overwriting) the file it points at."""
    from deadpool_ext.testing.memory_job import Adapter, manager, run_steps, slot_of, slot_path, world_of_one

    with world_of_one():
        run_steps(shm_root, 2)
        path = slot_path(shm_root, slot_of(shm_root, 2))
        outside = tmp_path / "outside.blob"
        outside.write_bytes(open(path, "rb").read())
        before = outside.read_bytes()
        os.unlink(path)
        os.symlink(outside, path)
        m = manager(shm_root, Adapter())
        try:
            with pytest.raises(UntrustedPathError, match=f"refusing {path}: it is not a regular file"):
                m.restore_latest()
            refused = [(kind, i, why) for kind, i, why in m.store.unusable]
        finally:
            m.close()
    assert [(kind, i) for kind, i, _ in refused] == [("slot", slot_of(shm_root, 2))]  # refused by the scan
    assert refused[0][2].startswith("refusing") and outside.read_bytes() == before
