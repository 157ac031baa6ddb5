"""The launcher-to-worker contract (launcher/contract.py) and the node placement built from it: pure, no
processes."""
from __future__ import annotations

import pytest

from deadpool_ext.cluster.topology import node_placement
from deadpool_ext.launcher import contract
from deadpool_ext.launcher.contract import HotSwapEnv, LaunchEnvError, WorkerEnv


def _hs(**kw: object) -> HotSwapEnv:
    base = dict(store_url="dp://127.0.0.1:4000", token="t0k", job_id="job1", worker_id="node1.0", node="node1",
                role="spare", launcher_pid=4242, heartbeat_s=0.25, watch_s=0.1, shm_root="/dev/shm/x")
    base.update(kw)
    return HotSwapEnv(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("slots", ["prepare", "at-restore"])
def test_what_the_launcher_writes_is_what_the_worker_reads(slots):
    hs = _hs(spare_slots=slots)
    env = {**hs.to_environ(), contract.LOCAL_RANK: "1", contract.LOCAL_WORLD_SIZE: "2"}
    w = WorkerEnv.from_environ(env)
    assert w.hot_swap == hs
    assert (w.local_rank, w.local_world_size, w.launcher_pid, w.job_id) == (1, 2, 4242, "job1")
    assert w.node_name() == "node1"


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RUN_ID": "run/7"}
    w = WorkerEnv.from_environ(env)
    assert (w.rank, w.world_size, w.master_port, w.restart_count, w.agent_store) == (3, 4, 29500, 2, True)
    assert w.hot_swap is None and w.missing_for_init() == []
    assert w.default_job_id() == "run_7"  # the run id, made a safe name


def test_job_id_without_a_run_id_is_stable_per_master_address():
    a = WorkerEnv.from_environ({"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    b = WorkerEnv.from_environ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "5"})
    c = WorkerEnv.from_environ({"MASTER_ADDR": "h", "MASTER_PORT": "2"})
    assert a.default_job_id() == b.default_job_id() != c.default_job_id()


def test_missing_variables_are_named():
    assert WorkerEnv.from_environ({"RANK": "0"}).missing_for_init() == ["WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


@pytest.mark.parametrize("env, named", [
    ({"RANK": "zero"}, "RANK='zero'"),
    ({contract.STORE: "dp://h:1"}, "DEADPOOL_STORE_TOKEN"),
    ({**_hs().to_environ(), contract.ROLE: "boss"}, "DEADPOOL_ROLE='boss'"),
    ({**_hs().to_environ(), contract.HEARTBEAT_S: "nan"}, "DEADPOOL_HEARTBEAT_S='nan'"),
    ({**_hs().to_environ(), contract.WATCH_S: "-1"}, "DEADPOOL_WATCH_S='-1'"),
    ({**_hs().to_environ(), contract.SPARE_SLOTS: "eager"}, "DEADPOOL_SPARE_SLOTS='eager'"),
])
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(LaunchEnvError, match=named.replace("(", r"\(")):
        WorkerEnv.from_environ(env)


def test_node_placement():
    kw = dict(job_id="j", host="h", shm_root="/dev/shm", launcher_pid=1)
    p = node_placement(launcher_node="node2", local_rank=0, local_world_size=4, simulate_nodes=2, **kw)
    assert (p.node, p.first_on_node) == ("node2", True)  # the launcher's node wins over simulation
    sims = [node_placement(launcher_node=None, local_rank=r, local_world_size=4, simulate_nodes=2, **kw)
            for r in range(4)]
    assert [(p.node, p.first_on_node) for p in sims] == [("h-sim0", True), ("h-sim0", False), ("h-sim1", True),
                                                         ("h-sim1", False)]
    assert node_placement(launcher_node=None, local_rank=1, local_world_size=2, simulate_nodes=0, **kw).node == "h"
    with pytest.raises(ValueError, match="simulate_nodes=3 must divide the 4"):
        node_placement(launcher_node=None, local_rank=0, local_world_size=4, simulate_nodes=3, **kw)


def test_the_deepspeed_launchers_local_size_is_the_local_world_size():
    # the deepspeed launcher sets LOCAL_SIZE, not LOCAL_WORLD_SIZE (torchrun's name, which wins when both are set)
    assert contract.WorkerEnv.from_environ({"LOCAL_SIZE": "4"}).local_world_size == 4
    assert contract.WorkerEnv.from_environ({"LOCAL_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    assert contract.WorkerEnv.from_environ({}).local_world_size == 1


def test_node_rank_orders_nodes_by_their_lowest_rank():
    """GROUP_RANK (torchrun's node rank) as deadpool-run exports it with each generation: the spare that took a
    node's ranks takes that node's place (Lightning derives global ranks from it and the local rank)."""
    from deadpool_ext.cluster.assignment import Assignment
    from deadpool_ext.rebuild.worker import node_rank

    a = Assignment(generation=1, world_size=4,
                   ranks={"node0.0": 0, "node0.1": 1, "spare0.0": 2, "spare0.1": 3},
                   nodes={"node0.0": "node0", "node0.1": "node0", "spare0.0": "spare0", "spare0.1": "spare0"})
    assert [node_rank(a, w) for w in ("node0.0", "node0.1", "spare0.0", "spare0.1")] == [0, 0, 1, 1]
    b = Assignment(generation=2, world_size=2, ranks={"spare1.0": 0, "node1.0": 1},
                   nodes={"spare1.0": "spare1", "node1.0": "node1"})
    assert node_rank(b, "spare1.0") == 0 and node_rank(b, "node1.0") == 1
