"""Which host am I: hostfile and SLURM parsing, pure (launcher/hostlist.py)."""
from __future__ import annotations

import pytest

from deadpool_ext.launcher.hostlist import (
    HostListError,
    expand_nodelist,
    from_hostfile,
    from_slurm,
    parse_hostfile,
    place_nodes,
)

HOSTFILE = """
# three hosts
worker-0 slots=2
worker-1 slots=2   # the second
10.1.2.3 slots=2
"""


def test_hostfile_rank_by_name_or_address():
    assert parse_hostfile(HOSTFILE) == [("worker-0", 2), ("worker-1", 2), ("10.1.2.3", 2)]
    plan = from_hostfile(HOSTFILE, "hf", ["worker-1.cluster.local", "worker-1"], ["10.9.9.9"])
    assert (plan.rank, plan.slots, plan.me, plan.hosts) == (1, 2, "worker-1", ["worker-0", "worker-1", "10.1.2.3"])
    assert from_hostfile(HOSTFILE, "hf", ["other"], ["127.0.0.1", "10.1.2.3"]).rank == 2
    # a short name in the file matches the machine's full name's first label
    assert from_hostfile("a slots=1\nb slots=1\n", "hf", ["b"], []).rank == 1


@pytest.mark.parametrize("text, needle", [
    ("a slots=2\nb\n", "hf:2: expected 'HOST slots=N'"),
    ("a slots=x\n", "slots='x'"),
    ("a slots=0\n", "must be an integer in 1..1024"),
    ("a slots=1\na slots=1\n", "listed twice"),
    ("# nothing\n", "no hosts"),
    ("a/b slots=1\n", "not a host name"),
])
def test_bad_hostfile_lines_are_named(text, needle):
    with pytest.raises(HostListError, match=None) as err:
        parse_hostfile(text, "hf")
    assert needle in str(err.value)


def test_hostfile_errors_about_this_machine():
    with pytest.raises(HostListError, match="no entry names this machine"):
        from_hostfile(HOSTFILE, "hf", ["elsewhere"], ["192.168.0.1"])
    with pytest.raises(HostListError, match="all name this machine"):
        from_hostfile(HOSTFILE, "hf", ["worker-0"], ["10.1.2.3"])
    with pytest.raises(HostListError, match="same slots"):
        from_hostfile("a slots=1\nb slots=2\n", "hf", ["a"], [])


def test_slurm_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]-ib") == ["n8", "n9", "n10"][:0] + ["n8-ib", "n9-ib", "n10-ib"]
    assert expand_nodelist("10.0.0.[1-3]") == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    for bad in ("a[1-", "a[3-1]", "a[[1]]", "a[x]", ",", "a]"):
        with pytest.raises(HostListError):
            expand_nodelist(bad)


def test_slurm_plan():
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "gpu[1-3]"}
    plan = from_slurm(env)
    assert (plan.hosts, plan.rank, plan.me, plan.job_id) == (["gpu1", "gpu2", "gpu3"], 2, "gpu3", "slurm4242")
    with pytest.raises(HostListError, match="lacks SLURM_NODEID"):
        from_slurm({k: v for k, v in env.items() if k != "SLURM_NODEID"})
    with pytest.raises(HostListError, match="names 3 hosts"):
        from_slurm({**env, "SLURM_NNODES": "4"})
    with pytest.raises(HostListError, match="not below"):
        from_slurm({**env, "SLURM_NODEID": "3"})


def test_a_requeued_slurm_job_is_a_new_job_to_the_store():
    """Slurm keeps a requeued job's id: each run of it gets a job id of its own (its store keys start empty)."""
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]"}
    assert from_slurm(env).job_id == "slurm77"
    assert from_slurm({**env, "SLURM_RESTART_COUNT": "0"}).job_id == "slurm77"
    assert from_slurm({**env, "SLURM_RESTART_COUNT": "2"}).job_id == "slurm77r2"
    with pytest.raises(HostListError, match="SLURM_RESTART_COUNT"):
        from_slurm({**env, "SLURM_RESTART_COUNT": "-1"})


def test_spares_continue_the_round_robin():
    """An allocation of N + S hosts runs one node per host (spares on the last S); N hosts: spare j beside node j."""
    active, spares = ["node0", "node1", "node2"], ["spare0"]
    assert place_nodes(active, spares, 4) == {"node0": 0, "node1": 1, "node2": 2, "spare0": 3}
    assert place_nodes(active, ["spare0", "spare1"], 3) == {"node0": 0, "node1": 1, "node2": 2, "spare0": 0,
                                                             "spare1": 1}
    assert place_nodes(active, spares, 2) == {"node0": 0, "node1": 1, "node2": 0, "spare0": 1}
    assert set(place_nodes(active, spares, 1).values()) == {0}


def test_from_slurm_without_nnodes_takes_the_hosts_less_the_spares():
    """``srun deadpool-run --from-slurm --spare-nodes S``: one node per host of the step, S of them spares."""
    from deadpool_ext.launcher.args import apply_host_plan, build_parser

    env = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_STEP_NODELIST": "n[0-3]"}
    parser = build_parser()
    args = parser.parse_args(["--from-slurm", "--spare-nodes", "1", "--store-port", "29400", "train.py"])
    apply_host_plan(parser, args, env)
    assert (args.nnodes, args.spare_nodes, args.hosts, args.host_rank, args.host, args.job_id) == \
        (3, 1, 4, 3, "n3", "slurm5")
    args = parser.parse_args(["--from-slurm", "--nnodes", "2", "--spare-nodes", "1", "--store-port", "1", "train.py"])
    apply_host_plan(parser, args, env)
    assert args.nnodes == 2   # given: kept (the fourth host idles)
    args = parser.parse_args(["--from-slurm", "--spare-nodes", "4", "--store-port", "1", "train.py"])
    with pytest.raises(SystemExit) as exc:
        apply_host_plan(parser, args, env)
    assert exc.value.code == 2


def test_from_slurm_without_a_store_url_finds_host_0s_embedded_store():
    """One command line on every host: host 0 serves the embedded store on --store-port, the others connect to it
    under host 0's name; without a port there is nothing to connect to (exit 2)."""
    from deadpool_ext.launcher.args import apply_host_plan, build_parser

    env = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "3", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[0-2]"}
    parser = build_parser()
    urls = []
    for rank in ("0", "2"):
        args = parser.parse_args(["--from-slurm", "--store-port", "29400", "train.py"])
        apply_host_plan(parser, args, {**env, "SLURM_NODEID": rank})
        urls.append(args.store_url)
    assert urls == [None, "dp://n0:29400"]
    args = parser.parse_args(["--from-slurm", "--store-url", "etcd://10.0.0.1:2379", "train.py"])
    apply_host_plan(parser, args, {**env, "SLURM_NODEID": "2"})
    assert args.store_url == "etcd://10.0.0.1:2379"
    with pytest.raises(SystemExit) as exc:
        apply_host_plan(parser, parser.parse_args(["--from-slurm", "train.py"]), env)
    assert exc.value.code == 2
