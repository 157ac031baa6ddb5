"""Which host am I: hostfile and SLURM parsing, pure (launcher/hostlist.py)."""
from __future__ import annotations

import pytest

from deadpool_ext.launcher.hostlist import (
    HostListError,
    expand_nodelist,
    from_hostfile,
    from_slurm,
    parse_hostfile,
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
