"""Megatron-Core path on CPU/gloo: hot-swap under deadpool-run (TP2xDP2, PP2xDP2; a node of 2 ranks is
SIGKILLed mid-training, a spare node takes its ranks and TP/PP/DP coordinates) with losses identical bit for
bit to an uninterrupted run; in-process restore; a tier-3 base saved at TP2 loads at TP1."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.launch import free_port, read_metrics, run_job, torchrun_cmd, wait_for_step
from tests.conftest import matrix
from tests.integration.test_hot_swap import worker_proc

pytestmark = pytest.mark.slow
SCRIPT = "scripts/pretrain_gpt_megatron.py"
ITERS = 12
JOB_TIMEOUT_S = 600


def _config(tmp_path, shm_root) -> str:
    path = os.path.join(str(tmp_path), "deadpool_megatron.json")
    with open(path, "w") as fh:
        json.dump({"deadpool": {"local": {"shm_root": shm_root}}}, fh)
    return path


def _torchrun(tmp_path, shm_root, nproc, layout, name, extra=()):
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    cmd = torchrun_cmd(nproc, SCRIPT, [*layout, "--train-iters", str(ITERS), "--metrics-out", metrics,
                                       "--deadpool-config", _config(tmp_path, shm_root), *extra], port=free_port())
    res = run_job(cmd, timeout_s=JOB_TIMEOUT_S)
    assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
    return read_metrics(metrics), res


def _swap(tmp_path, shm_root, layout, kill_step=5, victim="node1.1"):
    metrics = os.path.join(str(tmp_path), "swap.jsonl")
    timeline = os.path.join(str(tmp_path), "swap.timeline.jsonl")
    cmd = [sys.executable, "-m", "deadpool_ext.launcher.cli", "--nnodes", "2", "--nproc-per-node", "2",
           "--spare-nodes", "1", "--shm-root", shm_root, "--timeline", timeline, SCRIPT, *layout,
           "--train-iters", str(ITERS), "--metrics-out", metrics, "--deadpool-config", _config(tmp_path, shm_root)]

    def inject(proc):
        wait_for_step(metrics, kill_step, timeout_s=JOB_TIMEOUT_S, proc=proc)
        worker_proc(proc.pid, victim).send_signal(signal.SIGKILL)

    res = run_job(cmd, timeout_s=JOB_TIMEOUT_S, while_running=inject)
    with open(os.path.join(str(tmp_path), "swap.log"), "w") as fh:
        fh.write(res.output)
    assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
    return read_metrics(metrics), read_events(timeline), res


_TP2, _PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("layout", matrix([_TP2, _PP2], ci=[_TP2]),  # PP: the in-process rebuild tests
                         ids=lambda layout: "tp2xdp2" if layout == _TP2 else "pp2xdp2")
def test_node_loss_hot_swap_identical_losses(tmp_path, shm_root, layout):
    base, _ = _torchrun(tmp_path, shm_root, 4, layout, "base")
    assert sorted(base) == list(range(1, ITERS + 1))
    metrics, events, res = _swap(tmp_path, shm_root, layout)
    assert metrics == base
    assignments = [e for e in events if e.get("event") == "assignment"]
    assert [e["replaced"] for e in assignments] == [{"node1": "spare0"}]
    # The spare's two processes restored the lost node's two shards from peer memory (tier 2, verified before
    # use), at the same coordinates.
    spare = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert sorted(e["rank"] for e in spare) == [2, 3]
    assert all(e["restored_from"] == "peer" for e in spare)
    want = ({2: {"tp": 0, "pp": 0, "dp": 1}, 3: {"tp": 1, "pp": 0, "dp": 1}}
            if "--tensor-model-parallel-size" in layout
            else {2: {"tp": 0, "pp": 1, "dp": 0}, 3: {"tp": 0, "pp": 1, "dp": 1}})
    assert {e["rank"]: e["coords"] for e in spare} == want
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert sorted(e["rank"] for e in survivors) == [0, 1]


def test_in_process_rebuild_and_restore_is_exact(tmp_path, shm_root):
    out = {}
    for restore_at in (0, 3):
        cmd = torchrun_cmd(4, "tests/integration/workers/megatron_restore.py",
                           ["--pp", "2", "--iters", "8", "--restore-at", str(restore_at), "--shm-root", shm_root],
                           port=free_port())
        res = run_job(cmd, timeout_s=JOB_TIMEOUT_S)
        assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
        line = [ln for ln in res.output.splitlines() if ln.startswith("LOSSES ")][0]
        out[restore_at] = json.loads(line[len("LOSSES "):])
    assert out[0] == out[3] and len(out[0]) == 8


def test_differential_replay_in_process_is_exact(tmp_path, shm_root):
    """Differential mode on the Megatron path: base at iteration 4, a differential at 5; rebuilding and
    restoring at 5 replays it, and the losses equal an uninterrupted run."""
    out = {}
    for restore_at in (0, 3):
        cmd = torchrun_cmd(4, "tests/integration/workers/megatron_restore.py",
                           ["--pp", "2", "--iters", "7", "--restore-at", str(restore_at), "--shm-root", shm_root,
                            "--differential", "4"], port=free_port())
        res = run_job(cmd, timeout_s=JOB_TIMEOUT_S)
        assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
        line = [ln for ln in res.output.splitlines() if ln.startswith("LOSSES ")][0]
        out[restore_at] = json.loads(line[len("LOSSES "):])
        if restore_at:
            assert res.output.count("REPLAYED 1") == 4, res.output[-3000:]  # every rank replayed step 5
    assert out[0] == out[3] and len(out[0]) == 7


def test_tier3_base_saved_at_tp2_loads_at_tp1(tmp_path, shm_root):
    save = os.path.join(str(tmp_path), "ckpt")
    tp2, _ = _torchrun(tmp_path, shm_root, 2, ["--tensor-model-parallel-size", "2"], "tp2",
                       extra=["--save", save, "--save-interval", "4"])
    with open(os.path.join(save, "latest")) as fh:
        assert fh.read().strip() == "iter_0000012"
    bases = sorted(d for d in os.listdir(save) if d.startswith("iter_"))
    assert bases == ["iter_0000008", "iter_0000012"]  # keep_last = 2, older pruned, no temp dirs left
    assert not [d for d in os.listdir(save) if d.startswith(".tmp")]
    from deadpool_ext.integrations.megatron.checkpoint import verify_base

    assert verify_base(os.path.join(save, "iter_0000008"))["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    # Load the step-8 base at TP1 (1 process; same global batch) and train steps 9..12: the losses follow the
    # TP2 run's up to the rounding of a different matmul split.
    os.unlink(os.path.join(save, "iter_0000012", "deadpool_manifest.base.json"))  # incomplete: must not be used
    with open(os.path.join(save, "latest"), "w") as fh:
        fh.write("iter_0000008")
    tp1, _ = _torchrun(tmp_path, shm_root, 1, ["--tensor-model-parallel-size", "1"], "tp1",
                       extra=["--load", save])
    assert sorted(tp1) == [9, 10, 11, 12]  # loaded the base of iteration 8 (a new job: nothing in memory)
    for step in tp1:
        assert tp1[step] == pytest.approx(tp2[step], rel=2e-4), (step, tp1[step], tp2[step])


def test_shrink_is_refused_with_one_line(tmp_path, shm_root):
    # TP2 x DP2 on 2 nodes, no spare, --no-spare-policy shrink: the launcher offers 2 ranks, Megatron says it
    # cannot reshard onto them and the job stops with that line (not a hang, not a traceback loop).
    metrics = os.path.join(str(tmp_path), "shrink.jsonl")
    cmd = [sys.executable, "-m", "deadpool_ext.launcher.cli", "--nnodes", "2", "--nproc-per-node", "2",
           "--spare-nodes", "0", "--no-spare-policy", "shrink", "--shm-root", shm_root, SCRIPT,
           "--tensor-model-parallel-size", "2", "--train-iters", str(ITERS), "--metrics-out", metrics,
           "--deadpool-config", _config(tmp_path, shm_root)]

    def inject(proc):
        wait_for_step(metrics, 3, timeout_s=JOB_TIMEOUT_S, proc=proc)
        worker_proc(proc.pid, "node1.1").send_signal(signal.SIGKILL)

    res = run_job(cmd, timeout_s=JOB_TIMEOUT_S, while_running=inject)
    assert not res.timed_out, res.output[-4000:]
    assert res.returncode != 0
    assert "continuing without node(s) ['node1'] on 2 ranks" in res.output
    assert "generation 1 has 2 ranks (was 4): Megatron-Core cannot reshard its state" in res.output
