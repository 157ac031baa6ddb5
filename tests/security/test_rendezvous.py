"""The rendezvous of each generation needs the job's token (store/rendezvous.py): two real gloo ranks build their
groups through `TokenStore` on a real embedded store, while a process of another uid, without the token, tries
the store's port the way it used to read the generation's c10d TCPStore (and with a guessed token): refused, and
it reads nothing. The launcher publishes no c10d port any more and drops a dead generation's keys."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap

import pytest

from deadpool_ext.cluster.membership import initial_assignment
from deadpool_ext.launcher.args import build_parser, check_args
from deadpool_ext.launcher.cli import Supervisor
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer
from deadpool_ext.testing.launch import REPO, base_env
from tests.security._uids import python_for

pytestmark = pytest.mark.timeout(120)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_gpt.py")
OTHER_UID = 65534

RANK = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from deadpool_ext.store import connect
    from deadpool_ext.store.rendezvous import TokenStore, generation_prefix
    url, token, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = TokenStore(connect(url, token, "rdzvjob", 10.0), generation_prefix(0), timedelta(seconds=60),
                       dead_key="gen/1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    side = dist.new_group([0, 1])
    y = torch.ones(1)
    dist.all_reduce(y, group=side)
    dist.barrier()
    print(json.dumps({"sum": x.item(), "side": y.item()}), flush=True)
    dist.destroy_process_group()
""")

INTRUDER = textwrap.dedent(r"""
    import json, socket, struct, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    out = {}
    # raw bytes naming a rendezvous key, sent without the handshake (what reading a c10d TCPStore took)
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(struct.pack("<B", 0) + struct.pack("<I", 0x3C85F7CE) + b"\x03rdzv/gen0/rank_0")
    got = b""
    s.settimeout(10)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError as exc:
        out["error"] = type(exc).__name__
    out["received"] = got.decode("latin-1")
    # a guessed token through the real handshake
    s = socket.create_connection((host, port), timeout=10)
    s.settimeout(10)
    size = struct.unpack(">I", s.recv(4))[0]
    hello = json.loads(s.recv(size))
    body = json.dumps({"op": "auth", "nonce": hello["nonce"], "mac": "0" * 64}).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
    size = struct.unpack(">I", s.recv(4))[0]
    out["guess"] = json.loads(s.recv(size))
    print(json.dumps(out), flush=True)
""")




@pytest.mark.skipif(os.geteuid() != 0, reason="switching to a second uid needs root")
def test_rendezvous_needs_the_token_and_another_uid_reads_nothing():
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        host, port = server.address
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, server.url, token, str(r)], stdout=subprocess.PIPE,
                                  text=True, cwd=REPO, env=base_env({"PYTHONPATH": REPO})) for r in range(2)]
        intruder = subprocess.run([python_for(OTHER_UID), "-I", "-c", INTRUDER, host, str(port)], user=OTHER_UID,
                                  group=OTHER_UID, extra_groups=[], capture_output=True, text=True, timeout=60)
        outs = [json.loads(p.communicate(timeout=90)[0].strip().splitlines()[-1]) for p in ranks]
        assert outs == [{"sum": 3.0, "side": 2.0}] * 2
        seen = json.loads(intruder.stdout)
        assert "rdzv" not in seen["received"] and "rank_" not in seen["received"]   # only the challenge came back
        assert seen["guess"] == {"ok": False, "error": "authentication failed: wrong token for this job"}
        with connect(server.url, token, "rdzvjob", 10.0) as job:
            assert job.list("rdzv/gen0/"), "the rendezvous did not go through the job's store"
    theirs = [why for peer, why in server.refusals if peer.endswith(f"(uid {OTHER_UID})")]
    assert any(why.startswith("bad handshake") for why in theirs) and "wrong token" in theirs, server.refusals


def test_the_launcher_serves_no_c10d_port_and_drops_dead_generations_keys():
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        parser = build_parser()
        args = parser.parse_args(["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1", "--job-id", "pj",
                                  SCRIPT])
        check_args(parser, args)
        sup = Supervisor(args)
        try:
            sup.store = connect(server.url, token, "pj", 10.0)
            a = sup.publish(initial_assignment(sup.workers, sup.active_nodes, sup.spare_nodes))
            assert a.master_port == 0 and a.master_addr == "127.0.0.1"
            sup.store.set("rdzv/gen0/rank_0", b"addr")
            for g in (1, 2):
                sup.publish(dataclasses.replace(a, generation=g))
                assert (sup.store.get("rdzv/gen0/rank_0") is None) == (g == 2)
        finally:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def test_a_rendezvous_wait_stops_when_its_generation_is_replaced():
    """The fence cannot cut a wait that runs over the coordination store's connection: the next generation's
    notice stops it instead, within a wait slice, and a plain timeout names the keys still missing."""
    import threading
    import time
    from datetime import timedelta

    from deadpool_ext.store.rendezvous import TokenStore

    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server, connect(server.url, token, "wj", 10.0) as job:
        store = TokenStore(job, "rdzv/gen0/", timedelta(seconds=30), dead_key="gen/1")
        threading.Timer(0.3, lambda: job.set("gen/1", b"1")).start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"was replaced while waiting for \['rank_1'\] \(gen/1 is set\)"):
            store.get("rank_1")
        assert time.monotonic() - started < 3.0
        short = TokenStore(job, "rdzv/gen2/", timedelta(seconds=0.5))
        with pytest.raises(RuntimeError, match=r"timed out after 0.5s waiting for \['a'\] under 'rdzv/gen2/'"):
            short.wait(["a"])
        short.set("a", b"1")
        assert short.get("a") == b"1" and short.check(["a"]) and short.add("n", 2) == 2 and short.num_keys() == 2
        assert short.compare_set("c", b"", b"x") == b"x" and short.compare_set("c", b"y", b"z") == b"x"
