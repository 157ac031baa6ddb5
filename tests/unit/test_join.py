"""deadpool-run --join (launcher/join.py): the coordinator's answer to a join request, against a real embedded
store; the joiner's flags. No workers are started: the coordinator's part is called directly."""
from __future__ import annotations

import os
import secrets
import signal

import pytest

from deadpool_ext.cluster.membership import Worker, initial_assignment, replace_failed, shrink_failed
from deadpool_ext.launcher.args import build_parser, check_args
from deadpool_ext.launcher.cli import Supervisor, main
from deadpool_ext.launcher.hangs import not_formed
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer

pytestmark = pytest.mark.timeout(60)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_gpt.py")


@pytest.fixture
def coordinator():
    """A coordinator of 2 nodes x 2 processes without spares (its store served in-process), the first assignment
    published; no process is spawned."""
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        parser = build_parser()
        args = parser.parse_args(["--nnodes", "2", "--nproc-per-node", "2", "--no-spare-policy", "shrink",
                                  "--job-id", "joinjob", SCRIPT])
        check_args(parser, args)
        sup = Supervisor(args)
        sup.store = connect(server.url, token, "joinjob", 10.0)
        sup.assignment = initial_assignment(sup.workers, sup.active_nodes, sup.spare_nodes)
        sup.store.set_json("assignment", sup.assignment.to_json())
        try:
            yield sup, connect(server.url, token, "joinjob", 10.0)
        finally:  # the Supervisor wakes its loop on SIGCHLD: leave the test process as it was
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def test_a_node_joining_a_full_world_becomes_a_spare_that_takes_a_failed_node(coordinator):
    sup, joiner = coordinator
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    a = sup._join_tick(sup.assignment)
    assert a.spares == ("extra0",) and joiner.get_json("assignment")["spares"] == ["extra0"]
    assert joiner.get_json("join_ack/extra0") == {"ok": True, "as": "spare"}
    assert [w.worker_id for w in sup.workers if w.node == "extra0"] == ["extra0.0", "extra0.1"]
    sup._join_next = 0.0
    assert sup._join_tick(a) == a  # answered once
    # the joined spare takes node1's ranks like any pre-started spare
    new = replace_failed(a, sup.workers, {"node1"})
    assert new.replaced == {"node1": "extra0"} and new.ranks["extra0.0"] == 2 and new.ranks["extra0.1"] == 3


def test_a_node_joining_a_shrunk_world_is_offered_for_growing(coordinator):
    sup, joiner = coordinator
    shrunk = shrink_failed(sup.assignment, {"node1"})
    sup.assignment = shrunk
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    assert sup._join_tick(shrunk) == shrunk   # no spare: the grow takes it (resize._grow_tick reads repaired/)
    assert joiner.get_json("join_ack/extra0") == {"ok": True, "as": "grow"}
    assert joiner.get_json("repaired/extra0")["joined"] is True


def test_a_grow_waits_until_the_shrunk_world_has_formed(coordinator, caplog):
    """A repaired node whose processes beat is grown to only once every rank of the shrunk world finished a step
    since the shrink was published: a grow published while the survivors still rebuild would abandon that rebuild
    half done (what a slow host showed: the shrunk world never trained)."""
    import logging
    import time

    sup, joiner = coordinator
    sup.progress = {w: {"step": 3, "step_at": time.time()} for w in sup.assignment.ranks}  # steps of generation 0
    shrunk = sup.publish(shrink_failed(sup.assignment, {"node1"}))
    for wid in ("node1.0", "node1.1"):
        joiner.set_json(f"hb/{wid}", {"t": time.time()})
    joiner.set_json("repaired/node1", {"time": time.time()})
    with caplog.at_level(logging.INFO, logger="deadpool_ext.launcher"):
        sup._grow_tick(shrunk)
        sup.progress["node0.0"] = {"step": 4, "step_at": time.time() + 1}   # one survivor trains in generation 1
        sup._grow_tick(shrunk)
    assert sup.assignment == shrunk and joiner.get_json("repaired/node1") is not None
    said = [r.getMessage() for r in caplog.records if "the grow waits" in r.getMessage()]
    assert said == ["node node1 is ready to join; the grow waits until generation 1 (2 ranks) has finished a step "
                    "on every rank (not yet: node0.0, node0.1)"]   # said once, not at every turn
    sup.progress["node0.1"] = {"step": 4, "step_at": time.time() + 1}
    sup._grow_tick(shrunk)
    assert sup.assignment.generation == 2 and sup.assignment.world_size == 4
    assert joiner.get_json("repaired/node1") is None
    assert not_formed(sup.assignment.ranks, sup.progress, sup.formed_after) == ["node1.0", "node1.1"]


@pytest.mark.parametrize("name,request_,why", [
    ("node1", {"nproc": 2}, "node name 'node1' is taken by a node of this job"),
    ("extra0", {"nproc": 3}, "the joining node has 3 process(es), this job's nodes have 2: pass --nproc-per-node 2"),
    ("extra0", {"nproc": "2"}, "the joining node has '2' process(es)"),
    ("extra0", ["not", "a", "dict"], "the joining node has None process(es)"),
    ("0bad", {"nproc": 2}, "node name '0bad': must be 1-63 characters"),
])
def test_bad_join_requests_are_refused_with_the_reason(coordinator, name, request_, why):
    sup, joiner = coordinator
    joiner.set_json(f"joined/{name}", request_)
    a = sup._join_tick(sup.assignment)
    assert a.spares == () and not [w for w in sup.workers if w.node == name and w.node not in ("node1",)]
    ack = joiner.get_json(f"join_ack/{name}")
    assert ack["ok"] is False and why in ack["why"]


def test_a_coordinator_taking_over_learns_the_nodes_admitted_before(coordinator):
    sup, joiner = coordinator
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    joiner.set_json("join_ack/extra0", {"ok": True, "as": "spare"})   # answered by the coordinator before
    sup._join_tick(sup.assignment)
    assert Worker("extra0.1", "extra0", 1) in sup.workers and "extra0" in sup.spare_nodes


def test_the_joiner_prints_the_coordinators_answer(coordinator, capsys, monkeypatch):
    sup, joiner = coordinator
    parser = build_parser()
    args = parser.parse_args(["--join", "extra0", "--store-url", "dp://127.0.0.1:1", "--job-id", "joinjob",
                              "--nproc-per-node", "3", SCRIPT])
    check_args(parser, args)
    monkeypatch.setenv("DEADPOOL_STORE_TOKEN", "x")
    me = Supervisor(args)
    me.store = joiner
    me._join_request()
    assert me._joiner_tick() is None          # not answered yet
    sup._join_tick(sup.assignment)            # 3 processes: refused
    assert me._joiner_tick() == 2
    assert ("--join extra0: refused by job joinjob's coordinator: the joining node has 3 process(es), this job's "
            "nodes have 2: pass --nproc-per-node 2") in capsys.readouterr().err
    with pytest.raises(SystemExit, match="a machine already asked to join job joinjob under that name"):
        me._join_request()   # a second machine under the same name is refused before it starts anything


@pytest.mark.parametrize("argv,needle", [
    (["--join", "extra0", "--nnodes", "2"], "--join: --nnodes belong to the job's own launchers; drop them"),
    (["--join", "extra0"], "--join needs the running job's --store-url and --job-id"),
    (["--join", "x/../y", "--store-url", "dp://h:1", "--job-id", "j"], "--join 'x/../y': a node name of 1-63"),
    ([], "--nnodes is required (or --join NAME, to add this machine to a running job)"),
])
def test_join_flags_are_checked_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, SCRIPT])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
