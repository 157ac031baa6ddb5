"""Hostile values in every store key the coordinator reads never end its loop nor skip a check (launcher/values.py).

What anyone holding the job's token can write (a worker, a joining machine) is written here into a real embedded
store: nested 100,000 deep, a megabyte, wrongly typed, non-finite, names with path characters, and a join answer
written before the coordinator decided anything. The coordinator's real loop runs over them; only its lease is a
stand-in (the etcd election is not what is under test), and no worker process is started."""
from __future__ import annotations

import io
import json
import logging
import os
import secrets
import signal
import threading
import time
import typing

import pytest

from deadpool_ext.cluster.membership import initial_assignment, shrink_failed
from deadpool_ext.launcher import values
from deadpool_ext.launcher.args import build_parser, check_args
from deadpool_ext.launcher.cli import Supervisor
from deadpool_ext.launcher.leader import LEADING
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer

pytestmark = pytest.mark.timeout(60)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_gpt.py")

NESTED = b"[" * 100_000 + b"]" * 100_000
HOSTILE = {"nested": NESTED, "huge": b'"' + b"x" * (1 << 20) + b'"', "list": b"[1, 2]", "nan": b"NaN",
           "binary": b"\xff\x00\xfe", "wrong": b'{"rc": "0", "time": "x", "nproc": [2], "t": 1e999, "ok": 1}'}
KEYS = ["assignment", "dead_spares", "exit/node0.0", "exit/../../etc", "hb/node0.0", "hb/node1.0", "hb/spare0.0",
        "joined/extra0", "joined/../evil", "repaired/node1", "dropped/node1", "config/no_spare_policy",
        "launcher/no_spare_policy", "leader", "host/x", "host/-1"]


class _Lease:
    """The coordinator role, held for good (a stand-in for the etcd lease: this test is about store values)."""

    leading, lost_why = True, None

    def tick(self) -> str:
        return LEADING

    def close(self) -> None:
        pass


@pytest.fixture
def job():
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        parser = build_parser()
        args = parser.parse_args(["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                                  "--no-spare-policy", "shrink", "--repair-after-s", "0.01", "--job-id", "valjob",
                                  SCRIPT])
        check_args(parser, args)
        sup = Supervisor(args)
        sup.store = connect(server.url, token, "valjob", 10.0)
        sup.store_url = server.url
        sup.server = None
        sup.assignment = initial_assignment(sup.workers, sup.active_nodes, sup.spare_nodes)
        try:
            yield sup, connect(server.url, token, "valjob", 10.0)
        finally:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_values_in_every_key_never_end_the_coordinator_loop(job, kind, caplog):
    """A coordinator taking the role over finds every key it reads hostile (the assignment too, at first): its loop
    goes on, each bad key is logged in one line, and it stops only when the job is finished."""
    sup, attacker = job
    sup.leader, sup.election = False, _Lease()   # it takes the role over: reads assignment and dead_spares
    for key in KEYS:
        attacker.set(key, HOSTILE[kind])
    attacker.set_json("join_ack/../evil", {"ok": True, "as": "spare"})
    good = sup.assignment.to_json()

    keys = ("assignment", "exit/node0.0", "exit/../../etc", "hb/node0.0", "dropped/node1", "dead_spares")

    def refused(*which: str) -> bool:  # the loop has read (and refused) these keys: paced by its record, not its log
        return set(which) <= set(sup.values.warned)

    def until(done: typing.Callable[[], bool], seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)

    def later() -> None:   # paced by what the loop has read, not by the clock (the CI host may be slow)
        until(lambda: refused("assignment"))
        attacker.set_json("assignment", good)   # the loop takes over once a usable assignment is there
        until(lambda: refused(*keys))
        attacker.set("finished", b"1")

    threading.Thread(target=later, daemon=True).start()
    with caplog.at_level(logging.WARNING, logger="deadpool_ext.launcher"):
        assert sup._loop() == 0
    lines = [r.getMessage() for r in caplog.records]
    # log-interface: a hostile value can neither split nor flood a log line
    assert all("\n" not in line and len(line) < 600 for line in lines), lines  # log-interface: see above
    assert set(keys) <= set(sup.values.warned), (sup.values.warned, lines)  # each bad key refused, named
    # nothing was admitted: neither the name with path characters nor the unusable request
    state = sup.coordinator.state
    assert {w.node for w in state.roster.workers} == {"node0", "node1", "spare0"}
    assert "../evil" not in state.roster.node_host and attacker.get_json("join_ack/../evil")["ok"] is False
    assert state.assignment.to_json() == good


@pytest.mark.parametrize("name", ["../evil", "a/b", "x" * 200, "node1", "0bad"])
def test_a_prewritten_join_ack_never_admits_a_name_the_checks_refuse(job, name):
    sup, attacker = job
    attacker.set_json(f"joined/{name}", {"nproc": 1, "time": 0})
    attacker.set_json(f"join_ack/{name}", {"ok": True, "as": "spare"})
    coord = sup.coordinate(sup.assignment)
    before = coord.state.roster.workers
    coord.turn()
    assert coord.state.roster.workers == before and coord.state.assignment.spares == ("spare0",)
    assert attacker.get_json(f"join_ack/{name}")["ok"] is False   # the answer now says why


def test_a_prewritten_join_ack_with_a_wrong_request_admits_nothing(job):
    sup, attacker = job
    attacker.set_json("joined/extra0", {"nproc": 3, "time": 0})     # this job's nodes have 1 process
    attacker.set_json("join_ack/extra0", {"ok": True, "as": "spare"})
    coord = sup.coordinate(sup.assignment)
    coord.turn()
    assert "extra0" not in {w.node for w in coord.state.roster.workers}


def test_a_repaired_key_naming_no_node_of_the_job_is_never_grown_to(job):
    sup, attacker = job
    shrunk = shrink_failed(sup.assignment, {"node1"})
    coord = sup.coordinate(shrunk)
    for name in ("evil", "../x"):
        attacker.set_json(f"repaired/{name}", {"time": time.time()})
    coord.turn()
    assert coord.state.assignment == shrunk and attacker.list("repaired/") == {}
    assert coord.reads.warned == ["repaired/../x", "repaired/evil"]  # refused as bad keys, then deleted


def test_a_huge_fatal_report_stops_the_job_with_a_bounded_message(job, capsys):
    sup, attacker = job
    attacker.set("fatal", b"y" * (1 << 20))
    sup.timeline = io.StringIO()
    assert sup.coordinate(sup.assignment).turn() == 1
    assert len(capsys.readouterr().err) < 5000
    stopped = [e for e in map(json.loads, sup.timeline.getvalue().splitlines()) if e["event"] == "stopped"]
    assert [e["reason"] for e in stopped] == ["y" * values.MAX_TEXT]  # stopped for the report, cut short
