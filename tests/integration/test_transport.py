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


SHARED = ("both_ways", "signed", "forged", "unsigned", "pieces", "pieces_corrupt")
"""Cases that leave the pair whole: one job runs them in turn, each on a new group (one start-up, not six)."""


def _run(tmp_path, impl: str, cases: tuple[str, ...]) -> dict[str, dict[int, dict]]:
    """case -> rank -> what the worker recorded (a rank that left before writing is absent)."""
    d = tmp_path / f"{impl}-{cases[0]}"
    d.mkdir()
    job = Job(launcher="torchrun", script=WORKER, nproc_per_node=2, port=free_port(),
              args=(impl, ",".join(cases), str(d)))
    res = run_job(job.argv(), timeout_s=120, env=job.env())
    assert not res.timed_out, res.output[-3000:]
    return {c: {r: json.loads((d / f"{c}.rank{r}.json").read_text())
                for r in (0, 1) if (d / f"{c}.rank{r}.json").exists()} for c in cases}


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def shared(request, tmp_path_factory) -> dict[str, dict[int, dict]]:
    return _run(tmp_path_factory.mktemp("transport"), request.param, SHARED)


def test_blobs_cross_both_ways_intact(shared):
    out = shared["both_ways"]
    for r in (0, 1):
        assert out[r]["old_valid"]  # the buffer held a valid (older) blob before the round
        assert out[r]["intact"] and out[r]["why"] is None, out[r]
        assert out[r]["meta"]["rank"] == 1 - r and out[r]["meta"]["version"] == 7


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_interrupted_transfer_leaves_a_torn_buffer(tmp_path, impl):
    out = _run(tmp_path, impl, ("torn",))["torn"][1]
    assert out["old_valid"]
    assert out["raised"] == "RuntimeError", out
    assert out["magic_zero"] and out["meta"] is None and "torn" in out["why"], out


def test_signed_blobs_cross_intact_and_are_accepted(shared):
    out = shared["signed"]
    for r in (0, 1):
        assert out[r]["refused"] == [] and out[r]["intact"] and out[r]["why"] is None, out[r]


@pytest.mark.parametrize("case", ["forged", "unsigned"])
def test_a_blob_the_key_did_not_sign_is_refused_and_left_torn(shared, case):
    out = shared[case]
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
    out = _run(tmp_path, impl, ("closed",))["closed"]
    assert out[1]["raised"] == "TransportClosed" and out[1]["body_arrived"], out[1]
    assert out[1]["magic_zero"] and out[1]["meta"] is None, out[1]  # torn: never complete-looking
    # The sender's trailer is never awaited: its round completes, or fails once rank 1 has exited (never hangs).
    assert out[0]["raised"] in (None, "RuntimeError"), out[0]


def test_a_blob_in_pieces_is_checked_while_it_arrives(shared):
    """A fetch at a restore: the body travels in pieces, the receiver learns each one as it lands and checks the
    checksums of what has arrived meanwhile; what it checked is the blob, intact."""
    out = shared["pieces"]
    for r in (0, 1):
        seen, n = out[r]["seen"], out[r]["nbytes"]
        assert len(seen) == -(-(n - 8) // 512) > 1 and seen == sorted(seen) and seen[-1] == n, out[r]
        assert out[r]["intact"] and out[r]["problem"] is None, out[r]
        assert 0 < out[r]["hashed_early"] < n, out[r]  # most of it checked before the last piece


def test_a_blob_damaged_before_it_was_sent_is_refused_by_the_check_on_arrival(shared):
    out = shared["pieces_corrupt"]
    assert "checksum mismatch for tensor" in (out[1]["problem"] or ""), out[1]
    assert out[0]["problem"] is None, out[0]  # rank 1's blob was not damaged
