"""The test bed's job builder (deadpool_ext/testing/jobs.py) and its baseline cache (testing/baselines.py): pure,
no process is started. The argv of each launcher shape, the environment, one line for an invalid combination,
and what a baseline's key depends on."""
from __future__ import annotations

import json
import os
import sys

import pytest

from deadpool_ext.testing.baselines import BaselineCache, key_of
from deadpool_ext.testing.jobs import DEADPOOL_RUN, Job, deadpool_run

PY = sys.executable
BIN = os.path.dirname(sys.executable)


def test_deadpool_run_spells_each_set_field_once_in_a_fixed_order():
    job = Job(script="scripts/pretrain_gpt.py", nnodes=3, nproc_per_node=1, spare_nodes=1, shm_root="/dev/shm/x",
              timeline="t.jsonl", config="c.json", metrics="m.jsonl", args=("--train-iters", "12"),
              launcher_flags=("--progress-timeout-s", "200"))
    assert job.argv() == [PY, "-m", "deadpool_ext.launcher.cli", "--nnodes", "3", "--nproc-per-node", "1",
                          "--spare-nodes", "1", "--shm-root", "/dev/shm/x", "--timeline", "t.jsonl",
                          "--progress-timeout-s", "200", "scripts/pretrain_gpt.py", "--train-iters", "12",
                          "--deepspeed_config", "c.json", "--metrics-out", "m.jsonl"]
    assert job.ranks == 3


def test_deadpool_run_leaves_unset_fields_to_the_launchers_defaults():
    assert Job(script="s.py", nnodes=2).argv() == [*DEADPOOL_RUN, "--nnodes", "2", "s.py"]
    multi = Job(script="s.py", nnodes=3, hosts=2, host_rank=1, host="10.0.0.2", job_id="j", store_url="etcd://h:1",
                no_spare_policy="shrink", detect_timeout_s=8, port=1234)
    assert multi.argv() == [*DEADPOOL_RUN, "--nnodes", "3", "--no-spare-policy", "shrink", "--job-id", "j",
                            "--store-url", "etcd://h:1", "--hosts", "2", "--host-rank", "1", "--host", "10.0.0.2",
                            "--detect-timeout-s", "8", "--store-port", "1234", "s.py"]


def test_a_joining_launcher_has_no_nnodes():
    job = Job(script="s.py", join="extra0", nnodes=None, nproc_per_node=2, store_url="dp://127.0.0.1:5", job_id="g")
    assert job.launcher_argv() == [*DEADPOOL_RUN, "--join", "extra0", "--nproc-per-node", "2", "--job-id", "g",
                                   "--store-url", "dp://127.0.0.1:5"]


def test_torchrun_shape_and_a_wrapping_module():
    job = Job(launcher="torchrun", script="train.py", wrap="deadpool_ext.run", nproc_per_node=2, port=29501,
              max_restarts=1, args=("--x", "1"), metrics="m.jsonl")
    assert job.argv() == [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--max-restarts=1",
                          "--master-addr=127.0.0.1", "--master-port=29501", "--monitor-interval=0.2",
                          "-m", "deadpool_ext.run", "train.py", "--x", "1", "--metrics-out", "m.jsonl"]
    plain = Job(launcher="torchrun", script="w.py", nproc_per_node=2, port=7, args=("impl", "case", "/d"))
    assert plain.script_argv() == ["w.py", "impl", "case", "/d"]


def test_deepspeed_and_accelerate_shapes():
    ds = Job(launcher="deepspeed", script="scripts/pretrain_gpt.py", nproc_per_node=2, port=9, config="c.json")
    assert ds.argv() == [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", "9",
                         "scripts/pretrain_gpt.py", "--deepspeed_config", "c.json"]
    acc = Job(launcher="accelerate", script="loop.py", wrap="deadpool_ext.run", port=9,
              launcher_flags=("--config_file", "a.yaml"))
    assert acc.argv() == [os.path.join(BIN, "accelerate"), "launch", "--main_process_port", "9", "--config_file",
                          "a.yaml", "-m", "deadpool_ext.run", "loop.py"]


def test_env_is_the_test_beds_with_the_jobs_variables():
    env = Job(script="s.py", env_vars={"DEADPOOL_TEST_JOB_VAR": "t"}).env()
    assert env["DEADPOOL_TEST_JOB_VAR"] == "t" and env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert "DEADPOOL_TEST_JOB_VAR" not in Job(script="s.py").env()


@pytest.mark.parametrize("kwargs,line", [
    (dict(launcher="torchrun", port=1, spare_nodes=1, timeline="t"),
     "Job: spare_nodes, timeline set with launcher='torchrun': only deadpool-run has them (launcher='deadpool-run')"),
    (dict(launcher="torchrun"), "Job: launcher='torchrun' needs port= (its rendezvous port: free_port())"),
    (dict(max_restarts=1), "Job: max_restarts=1 with launcher='deadpool-run': only torchrun restarts a job"),
    (dict(join="extra0", nnodes=2),
     "Job: join='extra0' with nnodes=2: a joining launcher takes the job's nodes from its store (nnodes=None)"),
    (dict(launcher="slurm"), "Job: launcher='slurm': must be one of deadpool-run, torchrun, deepspeed, accelerate"),
])
def test_an_invalid_combination_is_one_line(kwargs, line):
    with pytest.raises(ValueError) as err:
        Job(script="s.py", **kwargs)
    assert str(err.value) == line


def test_replace_checks_again_and_verbatim_flags_stay_verbatim():
    job = Job(script="s.py", nnodes=2)
    assert job.replace(spare_nodes=1).spare_nodes == 1 and job.spare_nodes is None
    with pytest.raises(ValueError, match="only torchrun restarts"):
        job.replace(max_restarts=2)
    assert deadpool_run("--nnodes", "abc") == [*DEADPOOL_RUN, "--nnodes", "abc"]


def _config(tmp_path, name: str, **over) -> str:
    cfg = {"train_batch_size": 8, "deadpool": {"local": {"shm_root": f"/dev/shm/{name}"}}, **over}
    path = os.path.join(str(tmp_path), f"{name}.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def test_the_key_is_what_decides_the_trajectory(tmp_path):
    base = Job(script="scripts/pretrain_gpt.py", nnodes=3, config=_config(tmp_path, "a"), metrics="a.jsonl",
               args=("--train-iters", "12"), shm_root="/dev/shm/a", timeline="a.timeline")
    same = base.replace(config=_config(tmp_path, "b"), metrics="b.jsonl", shm_root="/dev/shm/b", timeline=None,
                        spare_nodes=0)
    assert key_of(base) == key_of(same)  # paths, spares, the timeline: not the trajectory
    torchrun = Job(launcher="torchrun", port=1, nproc_per_node=3, script=base.script, config=base.config,
                   args=base.args)
    assert key_of(torchrun) == key_of(base)  # the launcher is not part of it either
    for other in (base.replace(nnodes=2), base.replace(args=("--train-iters", "13")),
                  base.replace(args=("--train-iters", "12", "--seed", "2")),
                  base.replace(config=_config(tmp_path, "c", train_batch_size=4)),
                  base.replace(env_vars={"X": "1"}), base.replace(script="scripts/pretrain_gpt_megatron.py")):
        assert key_of(other) != key_of(base), other


def test_a_baseline_runs_once_and_comes_back_bit_for_bit_from_disk(tmp_path):
    job = Job(script="scripts/pretrain_gpt.py", nnodes=2, config=_config(tmp_path, "a"), args=("--train-iters", "2"))
    ran: list[Job] = []
    losses = {1: 10.123456789012345, 2: 0.1 + 0.2}

    def run(j: Job) -> dict[int, float]:
        ran.append(j)
        return dict(losses)

    cache = BaselineCache(str(tmp_path / "cache"))
    assert cache.get(job, run) == losses and cache.get(job, run) == losses and len(ran) == 1
    again = BaselineCache(str(tmp_path / "cache"))  # the next session: from the file, not run
    assert again.get(job, run) == losses and len(ran) == 1
    memory_only = BaselineCache(None)
    assert memory_only.get(job, run) == losses and len(ran) == 2 and not os.path.exists(tmp_path / "none")
