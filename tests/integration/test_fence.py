"""A rank that leaves a generation cuts its connections, and a peer blocked on it is released at once.

The bug this guards against: a survivor blocked in a gloo collective with another survivor that had already
moved on to the next generation stayed blocked until the collective timeout (60 s), missing the next
generation's rendezvous."""
import json
import subprocess
import sys

import pytest

from deadpool_ext.testing.launch import free_port

WORKER = "tests/integration/workers/fence_pair.py"


def _pair(worker: str, port: int, mode: str) -> dict:
    """Run ranks 0 and 1 of ``worker``; their JSON lines by rank, and each one's output tail under "log"."""
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(port), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    out: dict = {"log": []}
    try:
        for p in procs:
            text, _ = p.communicate(timeout=90)
            for line in text.splitlines():
                if line.startswith("{"):
                    d = json.loads(line)
                    out[d["rank"]] = d
            out["log"].append(text[-1500:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _run(mode: str) -> dict:
    return _pair(WORKER, free_port(), mode)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fence reads /proc")
def test_cut_releases_a_peer_blocked_in_recv():
    out = _run("cut")
    assert out[1]["cut"] >= 1 and out[1]["sockets_left"] == 0, out
    assert out[0]["outcome"].startswith("error"), out
    # Blocked in recv until the cut (block_s after rank 0 entered it), released by the cut: not by the exit 6 s
    # later nor the 45 s timeout.
    assert out[1]["block_s"] <= out[0]["blocked_s"] < 4.0, out


@pytest.mark.full_matrix(covered_by="test_cut_releases_a_peer_blocked_in_recv (the case itself; this is its control, "
                                    "what torch does without the fence)")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fence reads /proc")
def test_without_cut_the_peer_stays_blocked_until_the_other_exits():
    out = _run("none")
    assert out[1]["cut"] == 0
    assert out[0]["blocked_s"] > 5.0, out  # the control: what the cut avoids


def _rejoin(mode: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    # The generations' c10d store, served from here as the launcher serves it.
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    try:
        return _pair("tests/integration/workers/rejoin_pair.py", port, mode)
    finally:
        del master


def test_rank_whose_last_attempt_failed_still_forms_the_next_generation():
    """A rank whose previous generation failed while forming (a peer died during recovery) joins the next one
    with the others: torch's group-name counter, bumped by the failed attempt, is reset per generation."""
    out = _rejoin("fixed")
    assert out[1]["first"].startswith("failed"), out
    assert out[0]["outcome"] == "sum=3" and out[1]["outcome"] == "sum=3", out


@pytest.mark.full_matrix(covered_by="test_rank_whose_last_attempt_failed_still_forms_the_next_generation (the case "
                                    "itself; this is its control, what torch does without the reset)")
def test_without_the_reset_the_generation_cannot_form():
    out = _rejoin("unfixed")  # the control: what the reset avoids
    assert out[1]["first"].startswith("failed"), out
    assert out[0]["outcome"].startswith("error") and out[1]["outcome"].startswith("error"), out
