"""A local user without the token cannot lock a job out of its embedded store (store/admission.py).

The attack as reported: another uid opens 530 silent connections to the store and re-opens at once each one the
server closes. Here it runs for real under a second uid (root only: the test switches uids) against a real
`EmbeddedStoreServer` with its default limits, while the job's side connects anew: a client of the job's uid, a
machine joining with ``--join`` (the joiner's and the coordinator's real code), a follower launcher reading the
assignment, and a peer of a third uid that holds the token (the path another host's launcher takes). Every one of
them is served within a second or two; the flood holds only its own peer's budget. The slot rules themselves are
unit-tested without sockets below.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time

import pytest

from deadpool_ext.cluster.membership import initial_assignment
from deadpool_ext.launcher import values
from deadpool_ext.launcher.args import build_parser, check_args
from deadpool_ext.launcher.cli import Supervisor
from deadpool_ext.store import connect
from deadpool_ext.store.admission import QUEUE, REFUSE, RUN, Admission, PeerKey
from deadpool_ext.store.embedded import EmbeddedStoreServer
from tests.security._uids import python_for

pytestmark = pytest.mark.timeout(90)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_gpt.py")
FLOOD_UID, TOKEN_UID = 65534, 65533

FLOOD = r"""
import json, select, socket, sys, time

host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
opened = closed = 0
def one():
    global opened
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        return None
    opened += 1
    s.setblocking(False)
    return s
socks = [s for s in (one() for _ in range(n)) if s]
print(json.dumps({"open": len(socks)}), flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    ready, _, _ = select.select(socks, [], [], 0.05)
    for s in ready:
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:                       # closed by the server: re-opened at once
            socks.remove(s)
            s.close()
            closed += 1
    while len(socks) < n and time.monotonic() < end:
        s = one()
        if s is None:
            break
        socks.append(s)
print("done", opened, closed, flush=True)
"""

TOKEN_CLIENT = r"""
import base64, hashlib, hmac, json, os, socket, struct, sys, time
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
def send(s, obj):
    data = json.dumps(obj).encode()
    s.sendall(struct.pack(">I", len(data)) + data)
def recv(s):
    buf = b""
    while len(buf) < 4:
        buf += s.recv(4 - len(buf))
    (size,) = struct.unpack(">I", buf)
    body = b""
    while len(body) < size:
        body += s.recv(size - len(body))
    return json.loads(body)
start = time.monotonic()
s = socket.create_connection((host, port), timeout=10)
s.settimeout(10)
server_nonce = base64.b64decode(recv(s)["nonce"])
client_nonce = os.urandom(32)
mac = hmac.new(token, b"deadpool-store v1 client proof\x00" + server_nonce + client_nonce, hashlib.sha256).hexdigest()
send(s, {"op": "auth", "nonce": base64.b64encode(client_nonce).decode(), "mac": mac})
assert recv(s)["ok"] is True
send(s, {"op": "get", "key": "/deadpool/floodjob/assignment"})
reply = recv(s)
print(json.dumps({"took": round(time.monotonic() - start, 3), "served": reply["ok"] and reply["value"] is not None}),
      flush=True)
"""




@pytest.mark.skipif(os.geteuid() != 0, reason="switching to a second uid needs root")
def test_a_flood_from_another_uid_leaves_the_jobs_clients_served(capsys):
    token = secrets.token_urlsafe(16)
    py = python_for(FLOOD_UID)
    with EmbeddedStoreServer(token=token) as server:
        host, port = server.address
        parser = build_parser()
        args = parser.parse_args(["--nnodes", "2", "--nproc-per-node", "1", "--job-id", "floodjob", SCRIPT])
        check_args(parser, args)
        coordinator = Supervisor(args)
        try:
            coordinator.store = connect(server.url, token, "floodjob", 10.0)   # before the flood: pooled
            coordinator.assignment = initial_assignment(coordinator.workers, coordinator.active_nodes, [])
            coordinator.store.set_json("assignment", coordinator.assignment.to_json())
            flood = subprocess.Popen([py, "-I", "-c", FLOOD, host, str(port), "530", "6"], user=FLOOD_UID,
                                     group=FLOOD_UID, extra_groups=[], stdout=subprocess.PIPE, text=True)
            try:
                assert flood.stdout is not None
                assert json.loads(flood.stdout.readline())["open"] > 0   # the flood's connections are up
                time.sleep(1.0)   # the flood re-opening what the server closes
                served: dict[str, float] = {}

                t = time.monotonic()
                with connect(server.url, token, "floodjob", 5.0) as fresh:      # a new client of the job's uid
                    fresh.set("k", b"v")
                    assert fresh.get("k") == b"v"
                served["job client"] = time.monotonic() - t

                t = time.monotonic()
                jargs = parser.parse_args(["--join", "extra0", "--store-url", server.url, "--job-id", "floodjob",
                                           "--nproc-per-node", "1", SCRIPT])
                check_args(parser, jargs)
                os.environ["DEADPOOL_STORE_TOKEN"] = token
                joiner = Supervisor(jargs)
                joiner.store = connect(server.url, token, "floodjob", 5.0)
                assert joiner.joiner is not None
                joiner.joiner.request(joiner.values)
                coordinator.coordinate(coordinator.assignment).turn()
                assert joiner.joiner.tick(joiner.values) is None and joiner.joiner.answered   # admitted
                served["--join"] = time.monotonic() - t
                joiner.store.close()

                t = time.monotonic()
                with connect(server.url, token, "floodjob", 5.0) as follower:   # a follower launcher's start
                    raw = follower.wait(["assignment"], 5.0)["assignment"]
                    assert "extra0" in values.assignment("assignment", raw).assignment.spares
                served["follower"] = time.monotonic() - t

                other = subprocess.run([python_for(TOKEN_UID), "-I", "-c", TOKEN_CLIENT, host, str(port), token],
                                       user=TOKEN_UID, group=TOKEN_UID, extra_groups=[], capture_output=True,
                                       text=True, timeout=30)
                said = json.loads(other.stdout)
                assert said["served"] is True, other.stdout + other.stderr
                served["token holder of another uid"] = said["took"]
            finally:
                out, _ = flood.communicate(timeout=30)
            assert flood.returncode == 0
            _, opened, closed = out.split()[-3:]
            assert int(opened) > 530 and int(closed) > 0   # it kept re-opening what the server closed
            print(f"flood: {opened} connections opened, {closed} closed by the server; served during it: "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in served.items()))
            assert all(v < 5.0 for v in served.values()), served   # 0.17-0.27 s measured; a lock-out is a refusal
            with connect(server.url, token, "floodjob", 5.0) as after:
                assert after.get("k") == b"v"
        finally:
            os.environ.pop("DEADPOOL_STORE_TOKEN", None)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


# -- the slot rules, without sockets ---------------------------------------------------------------------------
def test_a_peer_gets_its_own_budget_and_the_job_its_slots():
    adm = Admission(max_connections=4, max_pending=6, max_pending_per_peer=2, max_queued_per_peer=2, max_queued=3)
    flood, other, job = PeerKey("127.0.0.1", 65534), PeerKey("10.0.0.2"), PeerKey("127.0.0.1", 0, trusted=True)
    far = time.monotonic() + 60
    assert [adm.arrive(flood, i, far)[0] for i in range(6)] == [RUN, RUN, QUEUE, QUEUE, REFUSE, REFUSE]
    verdict, why = adm.arrive(flood, 9, far)
    assert verdict == REFUSE and "max_pending_per_peer 2" in why
    assert adm.arrive(other, "o", far)[0] == RUN          # another peer's handshake starts at once
    assert [adm.arrive(job, j, far)[0] for j in range(4)] == [RUN] * 4   # the job's uid: max_connections only
    assert adm.arrive(job, "x", far) == (REFUSE, "4 connections already open (max_connections)")
    start, drop = adm.handshake_done(flood)              # one of the flood's handshakes ended: its next one starts
    assert [(k, item) for k, item, _ in start] == [(flood, 2)] and drop == []
    assert adm.authenticated() is False                   # max_connections is full: even with the token, refused
    adm.leave()
    assert adm.authenticated() is True


def test_queued_connections_expire_at_their_deadline():
    adm = Admission(max_connections=4, max_pending=1, max_pending_per_peer=1)
    p = PeerKey("10.0.0.9")
    now = time.monotonic()
    assert adm.arrive(p, "a", now + 10)[0] == RUN
    assert adm.arrive(p, "b", now + 0.01)[0] == QUEUE
    assert adm.arrive(p, "c", now + 10)[0] == QUEUE
    assert adm.expired(now + 1) == ["b"]
    start, drop = adm.handshake_done(p)
    assert [item for _, item, _ in start] == ["c"] and drop == []
    assert adm.pending == {p: 1} and adm.queued == {}
