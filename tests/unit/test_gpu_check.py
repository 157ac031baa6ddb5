"""benchmarks/gpu_check.py on a machine without a GPU: argument parsing, configuration, analysis, result schema,
and the fast failure without CUDA. Pure: nothing is trained."""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from deadpool_ext.testing.launch import REPO

_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_out_dir_comes_from_flag_then_env():
    assert gpu_check.parse_args([], env={}).out == "gpu_check_out"
    assert gpu_check.parse_args([], env={"OUT": "/o"}).out == "/o"
    assert gpu_check.parse_args([], env={"OUT": "/o", "DEADPOOL_GPU_OUT": "/g"}).out == "/g"
    assert gpu_check.parse_args(["--out", "/x"], env={"DEADPOOL_GPU_OUT": "/g"}).out == "/x"


def test_bad_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--hidden", "100", "--heads", "16"], env={})
    assert "must be a multiple of --heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--rounds", "0"], env={})
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--zero-stage", "3"], env={})


def test_default_model_is_over_a_billion_parameters():
    a = gpu_check.parse_args([], env={})
    n = gpu_check.param_count(a.layers, a.hidden, a.vocab, a.seq_len)
    assert 1.0e9 < n < 2.0e9
    # transformers' GPT-2 count for a small config, worked out by hand: 2 layers, 8 wide, vocab 10, 4 positions
    assert gpu_check.param_count(2, 8, 10, 4) == 10 * 8 + 4 * 8 + 2 * (12 * 64 + 13 * 8) + 16


def test_deepspeed_config_has_a_valid_deadpool_section():
    from deadpool_ext.config import DeadpoolConfig

    cfg = gpu_check.deepspeed_config(gpu_check.parse_args(["--zero-stage", "2"], env={}), "job1")
    assert cfg["zero_optimization"] == {"stage": 2} and cfg["bf16"] == {"enabled": True}
    dp = cfg["deadpool"]
    assert dp["snapshot"]["interval"] == 1 and dp["replication"]["factor"] == 0
    DeadpoolConfig.from_dict(dp)  # typed and checked: raises on an unknown key or a bad value


def _blocks():
    return [{"round": 0, "snapshots": True, "warmup": True, "step_s": [9.0]},
            {"round": 0, "snapshots": False, "warmup": True, "step_s": [9.0]},
            {"round": 1, "snapshots": False, "warmup": False, "step_s": [1.0, 1.0, 1.2]},
            {"round": 1, "snapshots": True, "warmup": False, "step_s": [1.1, 1.1, 1.0]},
            {"round": 2, "snapshots": True, "warmup": False, "step_s": [1.05, 1.05]},
            {"round": 2, "snapshots": False, "warmup": False, "step_s": [1.0, 1.0]}]


def test_analysis_ignores_warmup_and_pairs_rounds():
    a = gpu_check.analyze(_blocks())
    assert a["step_s"]["on"]["n"] == 5 and a["step_s"]["off"]["n"] == 5
    assert a["ratio"] == pytest.approx(1.05 / 1.0)
    assert a["paired_round_ratios"] == pytest.approx([1.1, 1.05])
    lo, hi = a["ratio_ci90"]
    assert lo <= a["ratio"] <= hi


def _doc(**over):
    doc = {"benchmark": "gpu_check", "schema": gpu_check.SCHEMA_VERSION, "status": "ok", "command": "c",
           "settings": {}, "device": {}, "model": {}, "blocking_s": gpu_check.summarize([0.001]),
           "copy_s": gpu_check.summarize([0.5]), "d2h_gbs_overlapped": 20.0, "d2h_gbs_idle": 25.0, "wall_s": 100.0,
           **gpu_check.analyze(_blocks())}
    doc.update(over)
    return doc


def test_result_schema_accepts_a_result_and_names_what_is_wrong():
    gpu_check.validate_result(_doc())
    with pytest.raises(ValueError, match="missing 'copy_s'"):
        d = _doc()
        del d["copy_s"]
        gpu_check.validate_result(d)
    with pytest.raises(ValueError, match="'wall_s' has type str"):
        gpu_check.validate_result(_doc(wall_s="long"))
    with pytest.raises(ValueError, match="status 'failed'"):
        gpu_check.validate_result(_doc(status="failed"))
    with pytest.raises(ValueError, match="step_s.on must be a summary"):
        gpu_check.validate_result(_doc(step_s={"off": {"median": 1.0}}))


def test_fails_fast_without_cuda(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--out", "/nonexistent/never-written"]) == gpu_check.EXIT_NO_CUDA
    assert "no CUDA here" in capsys.readouterr().err


def test_shell_wrapper_fails_fast_without_a_gpu(tmp_path):
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    r = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh")], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "DEADPOOL_GPU_OUT": str(tmp_path)})
    assert r.returncode == 2 and "Nothing measured" in r.stderr
    assert not list(tmp_path.iterdir())
