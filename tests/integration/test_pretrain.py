"""Foundation: real DeepSpeed engines on gloo, ZeRO-1/2/3 save/reload, determinism, script flags."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import REPO, base_env, free_port, read_metrics, run_job
from tests.conftest import make_config, matrix
from tests.integration.helpers import baseline, pretrain
from tests.log_interface import assert_refusal

pytestmark = pytest.mark.slow


def _no_snapshot_cfg(tmp_path, stage, shm_root):
    # when_busy=wait: these tests need every K-th base written, on a loaded machine too
    return make_config(tmp_path, stage=stage, deadpool={"local": {"shm_root": shm_root},
                                                        "persist": {"when_busy": "wait"}})


@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[2]))  # ZeRO-1/3: test_hot_swap, test_memory_tiers, test_elastic
def test_save_reload_continue_identical(tmp_path, shm_root, stage):
    cfg = _no_snapshot_cfg(tmp_path, stage, shm_root)
    ckpt = os.path.join(str(tmp_path), "ckpt")
    res, full, _ = pretrain(tmp_path, cfg, iters=6, extra=["--save", ckpt, "--save-interval", "3"], name="full")
    assert res.returncode == 0, res.output[-3000:]
    assert sorted(full) == list(range(1, 7))
    assert (os.path.exists(os.path.join(ckpt, "global_step3"))
            and open(os.path.join(ckpt, "latest")).read() == "global_step6")
    manifests = [f for f in os.listdir(os.path.join(ckpt, "global_step3")) if f.startswith("deadpool_manifest")]
    assert len(manifests) == 2, manifests  # one per rank, written at commit
    # Resume from step 3 into a fresh job: steps 4-6 must match bit for bit.
    os.unlink(os.path.join(ckpt, "latest"))
    with open(os.path.join(ckpt, "latest"), "w") as fh:
        fh.write("global_step3")
    res2, resumed, _ = pretrain(tmp_path, cfg, iters=6, extra=["--load", ckpt], name="resumed")
    assert res2.returncode == 0, res2.output[-3000:]
    assert sorted(resumed) == [4, 5, 6]
    assert {s: full[s] for s in (4, 5, 6)} == resumed


def test_corrupt_checkpoint_file_is_refused(tmp_path, shm_root):
    cfg = _no_snapshot_cfg(tmp_path, 3, shm_root)
    ckpt = os.path.join(str(tmp_path), "ckpt")
    res, _, _ = pretrain(tmp_path, cfg, iters=2, extra=["--save", ckpt, "--save-interval", "2"])
    assert res.returncode == 0, res.output[-3000:]
    target = os.path.join(ckpt, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    from deadpool_ext.testing.faults import corrupt_file
    corrupt_file(target)
    res2, _, _ = pretrain(tmp_path, cfg, iters=3, extra=["--load", ckpt], name="bad")
    assert res2.returncode != 0
    assert "checksum does not match the manifest" in res2.output  # log-interface: the refusal names why


def test_the_seed_decides_the_run_and_bert_runs(tmp_path, shm_root):
    """Another --seed, other losses; the metrics file's fields; the BERT script trains. That two runs of one seed
    are identical is what every bit-for-bit test checks against its uninterrupted baseline (test_hot_swap,
    test_memory_tiers, test_existing_jobs, ...), so it is not run a second time here."""
    cfg = make_config(tmp_path, stage=3, deadpool=None)
    a = baseline(tmp_path, cfg, iters=8)  # the default seed's run, cached (testing/baselines.py: shared)
    c = pretrain(tmp_path, cfg, iters=8, name="c", extra=["--seed", "7"])
    assert c[0].returncode == 0, c[0].output[-3000:]
    assert len(a) == 8 and len(c[1]) == 8
    assert a != c[1]
    with open(c[2]) as fh:
        import json
        rec = json.loads(fh.readline())
    assert {"step", "loss", "step_time_s"} <= set(rec)
    bert_cfg = make_config(tmp_path, stage=3, base="bert_tiny_zero3_cpu.json",
                           deadpool={"local": {"shm_root": shm_root}})
    res, bert, _ = pretrain(tmp_path, bert_cfg, iters=3, script="scripts/pretrain_bert.py", name="bert")
    assert res.returncode == 0, res.output[-3000:]
    assert sorted(bert) == [1, 2, 3] and all(v == v for v in bert.values())


@pytest.mark.full_matrix(covered_by="test_memory_tiers::test_relaunch_under_the_deepspeed_launcher_restores_"
                                    "from_memory (the pretraining script under the deepspeed launcher)")
def test_deepspeed_launcher_matches_torchrun(tmp_path, shm_root):
    cfg = _no_snapshot_cfg(tmp_path, 3, shm_root)
    _, ref, _ = pretrain(tmp_path, cfg, iters=3, name="ref")
    metrics = os.path.join(str(tmp_path), "ds.jsonl")
    job = Job(launcher="deepspeed", script="scripts/pretrain_gpt.py", nproc_per_node=2, port=free_port(), config=cfg,
              args=("--train-iters", "3"), metrics=metrics)
    res = run_job(job.argv(), timeout_s=300, env=job.env())
    assert res.returncode == 0, res.output[-3000:]
    assert read_metrics(metrics) == ref


def test_script_flags_and_errors(tmp_path):
    from deadpool_ext.distributed import _init_from_launcher
    from deadpool_ext.launcher.contract import WorkerEnv
    from deadpool_ext.training.pretrain import build_parser

    env = base_env()
    out = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    flags = set(build_parser("x")._option_string_actions)  # the parser the script's --help printed
    assert {"--deepspeed_config", "--train-iters", "--model-size", "--seed", "--metrics-out", "--save",
            "--save-interval", "--load"} <= flags
    bad = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", "--deepspeed_config", "x.json", "--model-size",
                          "huge"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert_refusal(bad, rc=2, names="argument --model-size: invalid choice: 'huge'")
    env_no_dist = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    nodist = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", "--deepspeed_config",
                             "configs/gpt_tiny_zero3_cpu.json"], cwd=REPO, env=env_no_dist, capture_output=True,
                            text=True, timeout=120)
    assert nodist.returncode == 1, nodist.stderr[-2000:]
    # why: the launcher's variables are missing, and the error says how to launch (before touching torch.distributed)
    assert WorkerEnv.from_environ({}).missing_for_init() == ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    with pytest.raises(RuntimeError, match=r"environment variables \[.*\] are not set\. Launch with torchrun"):
        _init_from_launcher(WorkerEnv.from_environ({}), "gloo", 1.0)


def test_unknown_deadpool_key_stops_startup(tmp_path):
    cfg = make_config(tmp_path, deadpool={"snapshot": {"intervall": 1}})
    res, _, _ = pretrain(tmp_path, cfg, iters=1)
    assert res.returncode != 0
    assert "deadpool.snapshot.intervall: unknown key" in res.output  # log-interface: names the key
