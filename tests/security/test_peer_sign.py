"""Snapshot blobs that cross the peer channel (tier 2) are signed with the checkpoint key (``replicate/auth.py``).

Before: a blob received from a peer was accepted when its xxh3 checksums matched, which whoever can write into
the gloo connection can arrange for forged content. After: with a key (``deadpool.key_env``, default
``DEADPOOL_CHECKPOINT_KEY``) every blob carries an HMAC-SHA256 tag binding the sender's rank, body and MAGIC; a
receiver writes the MAGIC only for a matching tag, so a blob the key did not sign stays torn and is never used
(the transport contract, real processes: ``tests/integration/test_transport.py``). Here: the tag itself, the key
agreement at start, the config key, and real jobs that restore a lost node from signed replicas bit for bit.
"""
from __future__ import annotations

import socket
import textwrap

import pytest
import torch

from deadpool_ext.config import DEFAULT_KEY_ENV, ConfigError, DeadpoolConfig
from deadpool_ext.persist import sign
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.replicate.auth import TAG_LEN, BlobSigner
from deadpool_ext.replicate.peer import _same_key_everywhere
from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot.slots import serialize
from deadpool_ext.testing.faults import drop_node_memory
from deadpool_ext.testing.launch import REPO
from tests.conftest import make_config, matrix
from tests.integration.helpers import baseline, kill_at, memory_tier_config, pretrain, restore_of, summary

KEY = "peer-channel-test-key-0123456789"
NODE1 = f"{socket.gethostname()}-sim1"


def _blob(seed: int = 0) -> torch.Tensor:
    obj = {"w": torch.arange(64, dtype=torch.float32) + seed, "step": seed}
    return torch.frombuffer(bytearray(serialize(obj, {"rank": 0, "version": 3})), dtype=torch.uint8)


def _parts(blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return blob[fmt.BODY_START:], blob[fmt.MAGIC_SLICE]


# -- the tag ------------------------------------------------------------------------------------------------------
def test_tag_binds_key_sender_body_and_magic() -> None:
    s = BlobSigner(KEY.encode())
    blob = _blob()
    tag = s.tag(0, *_parts(blob))
    assert len(tag) == TAG_LEN and s.check(0, *_parts(blob), tag)
    assert not s.check(1, *_parts(blob), tag)  # another sender's name
    assert not BlobSigner(b"x" * 32).check(0, *_parts(blob), tag)  # another key
    flipped = blob.clone()
    flipped[-1] ^= 1  # one bit of tensor data
    assert not s.check(0, *_parts(flipped), tag)
    other_magic = blob.clone()
    other_magic[0] ^= 1
    assert not s.check(0, *_parts(other_magic), tag)
    assert not s.check(0, *_parts(blob), bytes(TAG_LEN))  # an unsigned sender's zeros


def test_without_a_key_nothing_is_computed_and_everything_passes() -> None:
    s = BlobSigner(None)
    assert not s.enabled and s.fingerprint() is None
    assert s.tag(0, *_parts(_blob())) == bytes(TAG_LEN) and s.check(0, *_parts(_blob()), b"anything")


def test_fingerprint_tells_keys_apart_and_hides_the_key() -> None:
    a, b = BlobSigner(KEY.encode()).fingerprint(), BlobSigner(b"another-key-of-32-bytes-0123456").fingerprint()
    assert a and b and a != b and len(a) == 16 and KEY not in a and a == BlobSigner(KEY.encode()).fingerprint()


# -- every rank the same key, or none -----------------------------------------------------------------------------
def test_same_key_or_none_everywhere_passes() -> None:
    _same_key_everywhere(["abc", "abc", "abc"])
    _same_key_everywhere([None, None])


@pytest.mark.parametrize("prints,needle", [
    (["abc", None, "abc"], "key abc on ranks [0, 2]; no key on ranks [1]"),
    (["abc", "def"], "key abc on ranks [0]; key def on ranks [1]"),
])
def test_keys_that_differ_across_ranks_are_one_clear_error(prints: list, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _same_key_everywhere(prints)
    msg = str(err.value)
    assert "differs across ranks" in msg and needle in msg and "\n" not in msg


# -- where the key comes from -------------------------------------------------------------------------------------
@pytest.fixture
def restore_key_env():
    yield
    sign.use_key_env(DEFAULT_KEY_ENV)


def test_key_env_names_the_variable_the_key_is_read_from(monkeypatch, restore_key_env) -> None:
    monkeypatch.delenv(DEFAULT_KEY_ENV, raising=False)
    monkeypatch.setenv("MY_JOB_KEY", KEY)
    cfg = DeadpoolConfig.from_dict({"key_env": "MY_JOB_KEY"})
    assert sign.checkpoint_key() is None  # not used before a runtime attaches with this config
    sign.use_key_env(cfg.key_env)
    assert sign.checkpoint_key() == KEY.encode() and sign.key_env() == "MY_JOB_KEY"


@pytest.mark.parametrize("section,needle", [
    ({"key_env": "has space"}, "deadpool.key_env: must be an environment variable name"),
    ({"key_env": 7}, "deadpool.key_env: must be a string"),
    ({"key_env": "DEADPOOL_TEST_UNSET_KEY"}, "deadpool.key_env: names DEADPOOL_TEST_UNSET_KEY, which is not set"),
])
def test_bad_key_env_is_one_clear_error(monkeypatch, section: dict, needle: str) -> None:
    monkeypatch.delenv("DEADPOOL_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        DeadpoolConfig.from_dict(section)
    assert needle in str(err.value)


def test_the_default_variable_unset_means_no_key(monkeypatch) -> None:
    monkeypatch.delenv(DEFAULT_KEY_ENV, raising=False)
    assert DeadpoolConfig.from_dict({}).key_env == DEFAULT_KEY_ENV and sign.checkpoint_key() is None


# -- real jobs ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("differential", matrix([False, True], ci=[False]),  # differential peers: test_differential
                         ids=lambda d: "differential" if d else "full")
def test_lost_node_restores_from_signed_replicas_bit_for_bit(tmp_path, shm_root, differential) -> None:
    ref = baseline(tmp_path, make_config(tmp_path, stage=3, deadpool=None), iters=8)  # shared (testing/baselines.py)
    extra = {"differential": {"enabled": True, "base_interval": 3}} if differential else {}
    cfg = memory_tier_config(tmp_path, 3, shm_root, **extra)
    res, metrics, _ = pretrain(tmp_path, cfg, iters=8, max_restarts=1, env={DEFAULT_KEY_ENV: KEY}, name="signed",
                               inject=kill_at(5, then=lambda: drop_node_memory(shm_root, NODE1)))
    assert res.returncode == 0, res.output[-4000:]
    tier2 = summary(res)["deadpool"]["tier2"]
    assert tier2["signed"] and tier2["refused_blobs"] == 0, tier2  # signed, and every signed blob was accepted
    r = restore_of(res)  # rank 1's node memory was gone: its state came from rank 0's signed replica
    assert r["outcome"] == "restored" and r["fetched_from"] == {"1": 0} and not r["refused_before_use"], r
    assert metrics == ref


WRAPPER = textwrap.dedent('''
    import os, runpy, sys
    if os.environ.get("RANK") == "1":
        os.environ["DEADPOOL_CHECKPOINT_KEY"] = "a-different-key-on-rank-1-only!!"
    sys.argv = [sys.argv[0]] + sys.argv[1:]
    runpy.run_path(os.path.join(os.environ["REPO"], "scripts", "pretrain_gpt.py"), run_name="__main__")
''')


@pytest.mark.slow
def test_ranks_with_different_keys_refuse_to_start(tmp_path, shm_root) -> None:
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    timeline = str(tmp_path / "mismatch.timeline.jsonl")
    res, metrics, _ = pretrain(tmp_path, memory_tier_config(tmp_path, 2, shm_root), iters=2, script=str(wrapper),
                               env={DEFAULT_KEY_ENV: KEY, "REPO": REPO, "DEADPOOL_TIMELINE": timeline}, name="mismatch")
    assert res.returncode != 0 and metrics == {}, res.output[-3000:]
    refused = sorted((e["error"], e.get("key")) for e in read_events(timeline) if e.get("event") == "refused")
    assert refused == [("ConfigError", "deadpool.key_env")] * 2, res.output[-3000:]  # each rank, before training
