"""benchmarks/gpu_check.py on a machine without a GPU: the dry run stops at once with one line and exit 2 (the
script and its shell wrapper), arguments and configuration, the shared-memory sizing. Nothing is trained; the
analysis is tests/unit/test_gpu_check_analyse.py."""
from __future__ import annotations

import importlib.util
import os
import resource
import subprocess
import sys

import pytest

from deadpool_ext.testing.launch import REPO
from tests.log_interface import assert_refusal

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_dry_run_without_cuda_stops_at_once_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the deadline is for a starved host (wall time here is the scheduler's); the CPU it used is the dry run's own
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == gpu_check.EXIT_NO_CUDA == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpu_check:")]
    assert len(lines) == 1 and not r.stdout, r.stderr  # one line of its own (the exit status says which)
    assert not out.exists()  # nothing written
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 30, f"the dry run used {cpu:.1f} s of CPU: more than importing torch"


def test_main_without_cuda_returns_exit_2_before_any_work(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "never"), "--parts", "a"]) == gpu_check.EXIT_NO_CUDA
    assert not (tmp_path / "never").exists()


def test_shell_wrapper_fails_fast_without_a_gpu(tmp_path):
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    r = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh")], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "DEADPOOL_GPU_OUT": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert not list(tmp_path.iterdir())


def test_out_dir_comes_from_flag_then_env_then_the_results_folder():
    assert gpu_check.parse_args([], env={}).out == os.path.join(REPO, "benchmarks", "results", "gpu")
    assert gpu_check.parse_args([], env={"OUT": "/o"}).out == "/o"
    assert gpu_check.parse_args([], env={"OUT": "/o", "DEADPOOL_GPU_OUT": "/g"}).out == "/g"
    assert gpu_check.parse_args(["--out", "/x"], env={"DEADPOOL_GPU_OUT": "/g"}).out == "/x"


def test_parts_are_selectable_and_bad_input_is_one_line(capsys):
    assert gpu_check.parse_args([], env={}).part_list == ["a", "b", "c", "d", "e"]
    assert gpu_check.parse_args(["--parts", "e,a"], env={}).part_list == ["a", "e"]  # always in run order
    for bad, says in ((["--parts", "a,x"], "x is not a part; allowed: a comma-separated subset of a,b,c,d,e"),
                      (["--hidden", "100", "--heads", "16"], "must be multiples of --heads"),
                      (["--rounds", "0"], "--rounds must be >= 1"),
                      (["--replica", "maybe"], "invalid choice")):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(bad, env={})
        assert_refusal((exc.value.code, capsys.readouterr().err), rc=2, names=says)


def test_default_model_is_at_least_1_3_billion_parameters():
    a = gpu_check.parse_args([], env={})
    n = gpu_check.param_count(a.layers, a.hidden, a.vocab, a.seq_len)
    assert 1.3e9 <= n < 2.0e9
    # transformers' GPT-2 count for a small config, worked out by hand: 2 layers, 8 wide, vocab 10, 4 positions
    assert gpu_check.param_count(2, 8, 10, 4) == 10 * 8 + 4 * 8 + 2 * (12 * 64 + 13 * 8) + 16


def test_deepspeed_config_has_a_valid_deadpool_section_in_every_mode():
    from deadpool_ext.config import DeadpoolConfig

    args = gpu_check.parse_args([], env={})
    for kw in ({"replica": True}, {"replica": False}, {"replica": False, "restore": True},
               {"replica": False, "persist": "/tmp/t3"}):
        cfg = gpu_check.deepspeed_config(args, "job1", **kw)
        assert cfg["zero_optimization"] == {"stage": 1} and cfg["bf16"] == {"enabled": True}
        dp = DeadpoolConfig.from_dict(cfg["deadpool"])  # typed and checked: raises on an unknown key or bad value
        assert dp.snapshot.interval == 1
        assert dp.replication.factor == (1 if kw["replica"] else 0)
        assert dp.local.simulate_nodes == (2 if kw["replica"] else 0)  # the two processes are two "nodes"
        assert dp.recovery.restore_on_start == kw.get("restore", False)
        assert (dp.local.keep_after_exit_s > 0) == kw.get("restore", False)  # only part c's restart needs it
        assert (dp.persist.url is not None) == ("persist" in kw)


def test_shared_memory_sizing_follows_the_captured_state():
    args = gpu_check.parse_args([], env={})
    state = gpu_check.gpt_state_bytes(gpu_check.param_count(args.layers, args.hidden, args.vocab, args.seq_len))
    assert 18e9 < state < 22e9  # ~1.3-1.5B parameters x 14 bytes: bf16 + fp32 master + 2 Adam moments, all captured
    assert gpu_check.shm_need_bytes(state, True) == int(state * 4 * 1.05)
    assert gpu_check.shm_need_bytes(state, False) == int(state * 2 * 1.05)


def test_part_deadlines_fit_the_8_minute_command():
    total = sum(gpu_check.PART_BUDGET_S.values())
    with open(os.path.join(REPO, "benchmarks", "gpu_check.sh")) as fh:
        hard = int(fh.read().split("--kill-after=15 ")[1].split()[0])
    assert total + 30 < hard <= 480 - 15
