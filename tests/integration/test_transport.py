"""Contract tests every tier-2 Transport implementation must pass, with real processes and a real gloo group
(replicate/transport.py states the guarantee: body first, MAGIC last; an interrupted transfer leaves a torn
buffer, never a complete-looking one)."""
from __future__ import annotations

import json

import pytest

from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, run_job

WORKER = "tests/integration/workers/transport_pair.py"
IMPLEMENTATIONS = ["gloo"]


def _run(tmp_path, impl: str, case: str, ranks: tuple[int, ...]) -> dict[int, dict]:
    d = tmp_path / f"{impl}-{case}"
    d.mkdir()
    job = Job(launcher="torchrun", script=WORKER, nproc_per_node=2, port=free_port(), args=(impl, case, str(d)))
    res = run_job(job.argv(), timeout_s=120, env=job.env())
    assert not res.timed_out, res.output[-3000:]
    return {r: json.loads((d / f"rank{r}.json").read_text()) for r in ranks}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_blobs_cross_both_ways_intact(tmp_path, impl):
    out = _run(tmp_path, impl, "both_ways", (0, 1))
    for r in (0, 1):
        assert out[r]["old_valid"]  # the buffer held a valid (older) blob before the round
        assert out[r]["intact"] and out[r]["why"] is None, out[r]
        assert out[r]["meta"]["rank"] == 1 - r and out[r]["meta"]["version"] == 7


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_interrupted_transfer_leaves_a_torn_buffer(tmp_path, impl):
    out = _run(tmp_path, impl, "torn", (1,))[1]
    assert out["old_valid"]
    assert out["raised"] == "RuntimeError", out
    assert out["magic_zero"] and out["meta"] is None and "torn" in out["why"], out


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_signed_blobs_cross_intact_and_are_accepted(tmp_path, impl):
    out = _run(tmp_path, impl, "signed", (0, 1))
    for r in (0, 1):
        assert out[r]["refused"] == [] and out[r]["intact"] and out[r]["why"] is None, out[r]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["forged", "unsigned"])
def test_a_blob_the_key_did_not_sign_is_refused_and_left_torn(tmp_path, impl, case):
    out = _run(tmp_path, impl, case, (0, 1))
    victim = out[1]  # holds the key; rank 0 signed with another key (forged) or none (unsigned)
    assert victim["old_valid"] and victim["body_arrived"], victim  # the bytes came, checksums and all ...
    assert victim["refused"] == [0] and victim["magic_zero"] and victim["meta"] is None and "torn" in victim["why"]
    # ... rank 0 checks with its own key (forged: another key, so it refuses rank 1's blob too; unsigned: no key,
    # so it accepts what arrives, checksums only).
    assert out[0]["refused"] == ([1] if case == "forged" else []), out[0]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_closed_transport_sends_no_next_message_and_leaves_the_buffer_torn(tmp_path, impl):
    """What a snapshot worker abandoned at an in-place hot-swap relies on: once its transport is closed, a round in
    flight stops after the message it is in (nothing goes out on the group's new communicator)."""
    out = _run(tmp_path, impl, "closed", (0, 1))
    assert out[1]["raised"] == "TransportClosed" and out[1]["body_arrived"], out[1]
    assert out[1]["magic_zero"] and out[1]["meta"] is None, out[1]  # torn: never complete-looking
    # The sender's trailer is never awaited: its round completes, or fails once rank 1 has exited (never hangs).
    assert out[0]["raised"] in (None, "RuntimeError"), out[0]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_blob_in_pieces_is_checked_while_it_arrives(tmp_path, impl):
    """A fetch at a restore: the body travels in pieces, the receiver learns each one as it lands and checks the
    checksums of what has arrived meanwhile; what it checked is the blob, intact."""
    out = _run(tmp_path, impl, "pieces", (0, 1))
    for r in (0, 1):
        seen, n = out[r]["seen"], out[r]["nbytes"]
        assert len(seen) == -(-(n - 8) // 512) > 1 and seen == sorted(seen) and seen[-1] == n, out[r]
        assert out[r]["intact"] and out[r]["problem"] is None, out[r]
        assert 0 < out[r]["hashed_early"] < n, out[r]  # most of it checked before the last piece


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_blob_damaged_before_it_was_sent_is_refused_by_the_check_on_arrival(tmp_path, impl):
    out = _run(tmp_path, impl, "pieces_corrupt", (0, 1))
    assert "checksum mismatch for tensor" in (out[1]["problem"] or ""), out[1]
    assert out[0]["problem"] is None, out[0]  # rank 1's blob was not damaged
