"""deadpool-run --join (launcher/join.py): the coordinator's answer to a join request, against a real embedded
store; the joiner's flags. No workers are started: the coordinator's turn (launcher/coordinator.py: observe ->
decide -> act) is called directly."""
from __future__ import annotations

import os
import secrets
import signal

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment, replace_failed, shrink_failed
from deadpool_ext.launcher.args import build_parser, check_args
from deadpool_ext.launcher.cli import Supervisor
from deadpool_ext.launcher.hangs import not_formed
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer
from tests.log_interface import assert_refusal

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
        sup.assignment = sup.publish(initial_assignment(sup.workers, sup.active_nodes, sup.spare_nodes))
        sup.coordinate(sup.assignment)
        try:
            yield sup, connect(server.url, token, "joinjob", 10.0)
        finally:  # the Supervisor wakes its loop on SIGCHLD: leave the test process as it was
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def test_a_node_joining_a_full_world_becomes_a_spare_that_takes_a_failed_node(coordinator):
    sup, joiner = coordinator
    coord = sup.coordinator
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    assert coord.turn() is None
    a = coord.state.assignment
    assert a.spares == ("extra0",) and joiner.get_json("assignment")["spares"] == ["extra0"]
    assert joiner.get_json("join_ack/extra0") == {"ok": True, "as": "spare"}
    workers = list(coord.state.roster.workers)
    assert [w.worker_id for w in workers if w.node == "extra0"] == ["extra0.0", "extra0.1"]
    coord.join_next = 0.0
    coord.turn()
    assert coord.state.assignment == a and coord.state.roster.workers == tuple(workers)  # answered once
    # the joined spare takes node1's ranks like any pre-started spare
    new = replace_failed(a, workers, {"node1"})
    assert new.replaced == {"node1": "extra0"} and new.ranks["extra0.0"] == 2 and new.ranks["extra0.1"] == 3


def test_a_crash_is_fenced_and_the_spare_that_joined_meanwhile_takes_its_ranks(coordinator):
    """--no-spare-policy wait: the failure finds no spare, the coordinator's turns go on (waiting is a state);
    a machine that joins gets the failed node's ranks in the generation published next."""
    sup, joiner = coordinator
    sup.args.no_spare_policy, sup.args.spare_wait_s = "wait", 60.0
    coord = sup.coordinate(sup.assignment)
    joiner.set_json("exit/node1.0", {"rc": -9, "time": 0})
    assert coord.turn() is None
    assert coord.state.awaiting is not None
    assert joiner.get_json("assignment")["generation"] == 0
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    coord.join_next = 0.0
    assert coord.turn() is None
    published = joiner.get_json("assignment")
    assert published["generation"] == 1 and published["replaced"] == {"node1": "extra0"}
    assert joiner.get("gen/1") == b"1" and coord.state.awaiting is None


def test_a_node_joining_a_shrunk_world_is_offered_for_growing(coordinator):
    sup, joiner = coordinator
    shrunk = sup.publish(shrink_failed(sup.assignment, {"node1"}))
    coord = sup.coordinate(shrunk)
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    coord.turn()
    assert coord.state.assignment == shrunk   # no spare: the grow takes it (decide's grow reads repaired/)
    assert joiner.get_json("join_ack/extra0") == {"ok": True, "as": "grow"}
    assert joiner.get_json("repaired/extra0")["joined"] is True


def test_a_grow_waits_until_the_shrunk_world_has_formed(coordinator):
    """A repaired node whose processes beat is grown to only once every rank of the shrunk world finished a step
    since the shrink was published: a grow published while the survivors still rebuild would abandon that rebuild
    half done (what a slow host showed: the shrunk world never trained)."""
    import dataclasses
    import time

    sup, joiner = coordinator
    before = time.time()

    def beat(wid: str, step_at: float) -> None:
        joiner.set_json(f"hb/{wid}", {"t": time.time(), "step": 3, "step_at": step_at, "coll": False, "still_s": 0})

    for wid in ("node0.0", "node0.1"):
        beat(wid, before)   # steps of generation 0
    shrunk = sup.publish(shrink_failed(sup.assignment, {"node1"}))
    coord = sup.coordinator
    coord.state = dataclasses.replace(coord.state, assignment=shrunk, formed_after=time.time(),
                                      last_turn=time.time())
    for wid in ("node1.0", "node1.1"):
        beat(wid, 0.0)   # the repaired node's processes wait as spares
    joiner.set_json("repaired/node1", {"time": time.time()})
    coord.turn()
    first = coord.state.grow_wait_logged, not_formed(shrunk.ranks, coord.state.progress, coord.state.formed_after)
    beat("node0.0", time.time() + 1)   # one survivor trains in generation 1
    coord.turn()
    assert coord.state.assignment == shrunk and joiner.get_json("repaired/node1") is not None
    # node1 waits for generation 1, whose ranks had not stepped; said once (the state gates the line), not per turn
    assert first == ((1, "node1"), ["node0.0", "node0.1"]) and coord.state.grow_wait_logged == (1, "node1")
    assert not_formed(shrunk.ranks, coord.state.progress, coord.state.formed_after) == ["node0.1"]
    beat("node0.1", time.time() + 1)
    coord.turn()
    grown = coord.state.assignment
    assert grown.generation == 2 and grown.world_size == 4 and joiner.get_json("assignment")["grown"] == ["node1"]
    assert joiner.get_json("repaired/node1") is None
    assert not_formed(grown.ranks, coord.state.progress, coord.state.formed_after) == ["node1.0", "node1.1"]


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
    sup.coordinator.turn()
    roster = sup.coordinator.state.roster
    assert sup.coordinator.state.assignment.spares == ()
    assert not [w for w in roster.workers if w.node == name and w.node not in ("node1",)]
    ack = joiner.get_json(f"join_ack/{name}")
    assert ack["ok"] is False and why in ack["why"]


def test_a_coordinator_taking_over_learns_the_nodes_admitted_before(coordinator):
    sup, joiner = coordinator
    joiner.set_json("joined/extra0", {"nproc": 2, "time": 0})
    joiner.set_json("join_ack/extra0", {"ok": True, "as": "spare"})   # answered by the coordinator before
    sup.coordinator.turn()
    roster = sup.coordinator.state.roster
    assert Worker("extra0.1", "extra0", 1) in roster.workers and "extra0" in roster.spare_nodes


def test_the_joiner_prints_the_coordinators_answer(coordinator, capsys, monkeypatch):
    sup, joiner = coordinator
    parser = build_parser()
    args = parser.parse_args(["--join", "extra0", "--store-url", "dp://127.0.0.1:1", "--job-id", "joinjob",
                              "--nproc-per-node", "3", SCRIPT])
    check_args(parser, args)
    monkeypatch.setenv("DEADPOOL_STORE_TOKEN", "x")
    me = Supervisor(args)
    me.store = joiner
    assert me.joiner is not None
    me.joiner.request(me.values)
    assert me.joiner.tick(me.values) is None          # not answered yet
    sup.coordinator.turn()                            # 3 processes: refused
    assert_refusal((me.joiner.tick(me.values), capsys.readouterr().err), rc=2,
                   names="--join extra0: refused by job joinjob's coordinator: the joining node has 3 process(es), "
                         "this job's nodes have 2: pass --nproc-per-node 2")
    with pytest.raises(SystemExit, match="a machine already asked to join job joinjob under that name"):
        me.joiner.request(me.values)   # a second machine under the same name is refused before it starts anything


# --join's flag refusals: tests/security/test_input.py (every deadpool-run refusal, one check)


def test_a_hosts_launcher_started_again_in_a_running_job_comes_back_as_a_spare():
    """A pod restarted by Kubernetes (issue 47, part 3) runs the same command line: its launcher counts its starts in
    ``launched/<host rank>`` and, started before in a job that a launcher coordinates, joins it as ``host<R>-<N>``;
    not on a job of one host, nor when nobody coordinates (the job is gone)."""
    from deadpool_ext.launcher import values
    from deadpool_ext.launcher.join import count_start, restarted_name

    assert restarted_name(2, 0, 3, True) is None                  # its first start
    assert restarted_name(2, 1, 3, True) == "host2-1"
    assert restarted_name(0, 3, 3, True) == "host0-3"             # host 0 too: another launcher coordinates now
    assert restarted_name(2, 1, 1, True) is None and restarted_name(2, 1, 3, False) is None
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        store = connect(server.url, token, "k8sjob", 10.0)
        reads = values.StoreValues(store)
        assert count_start(reads, 2, 3) is None                    # the job's start
        assert count_start(reads, 2, 3) is None                    # again, but no leader: the job starts over
        store.set_json("leader", {"host_rank": 0, "host": "10.0.0.1"})
        assert count_start(reads, 2, 3) == "host2-2"               # the pod restarted while the job runs
        assert count_start(reads, 1, 3) is None                    # another host's first start
        assert store.get_json("launched/2")["starts"] == 3
        store.set("launched/1", b'{"starts": -4}')                 # a bad value reads as absent: a first start
        assert count_start(reads, 1, 3) is None and store.get_json("launched/1")["starts"] == 1
