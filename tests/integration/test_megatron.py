"""Megatron-Core path on CPU/gloo: hot-swap under deadpool-run (TP2xDP2, PP2xDP2; a node of 2 ranks is
SIGKILLed mid-training, a spare node takes its ranks and TP/PP/DP coordinates) with losses identical bit for
bit to an uninterrupted run; in-process restore; a tier-3 base saved at TP2 loads at TP1; elastic: a
data-parallel shrink restored from memory shard for shard, and a shrink that breaks a pipeline group refused."""
from __future__ import annotations

import glob
import json
import os
import signal

import pytest
import torch

from deadpool_ext.chaos.at_step import harness_env
from deadpool_ext.chaos.dump import DIR as DUMP_DIR
from deadpool_ext.chaos.dump import STEPS as DUMP_STEPS
from deadpool_ext.chaos.dump import by_shard
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, read_metrics, run_job, wait_for_step
from tests.conftest import matrix
from tests.integration.helpers import release_hold_when_grown, tagged_json, worker_proc

pytestmark = pytest.mark.slow
SCRIPT = "scripts/pretrain_gpt_megatron.py"
RESTORE_WORKER = "tests/integration/workers/megatron_restore.py"
ITERS = 12
JOB_TIMEOUT_S = 600


def _config(tmp_path, shm_root) -> str:
    path = os.path.join(str(tmp_path), "deadpool_megatron.json")
    with open(path, "w") as fh:
        json.dump({"deadpool": {"local": {"shm_root": shm_root}}}, fh)
    return path


def _torchrun(tmp_path, shm_root, nproc, layout, name, extra=()):
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    job = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=nproc, port=free_port(),
              args=(*layout, "--train-iters", str(ITERS), *extra), config=_config(tmp_path, shm_root),
              config_flag="--deadpool-config", metrics=metrics)
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env())
    assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
    return read_metrics(metrics), res


def _swap(tmp_path, shm_root, layout, kill_step=5, victim="node1.1"):
    metrics = os.path.join(str(tmp_path), "swap.jsonl")
    timeline = os.path.join(str(tmp_path), "swap.timeline.jsonl")
    job = Job(script=SCRIPT, nnodes=2, nproc_per_node=2, spare_nodes=1, shm_root=shm_root, timeline=timeline,
              args=(*layout, "--train-iters", str(ITERS)), config=_config(tmp_path, shm_root),
              config_flag="--deadpool-config", metrics=metrics)

    def inject(proc):
        wait_for_step(metrics, kill_step, timeout_s=JOB_TIMEOUT_S, proc=proc)
        worker_proc(proc.pid, victim).send_signal(signal.SIGKILL)

    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, while_running=inject, env=job.env())
    with open(os.path.join(str(tmp_path), "swap.log"), "w") as fh:
        fh.write(res.output)
    assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
    return read_metrics(metrics), read_events(timeline), res


_TP2, _PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]


@pytest.mark.full_matrix(covered_by="test_another_nodes_loss_is_taken_by_the_spare_relabelled_with_identical_losses "
                                    "(the same TP2 job: the spare built ahead, the survivors in place, the losses; "
                                    "the node it built for is the simpler case) and the DeepSpeed hot-swap tests")
@pytest.mark.parametrize("layout", [_TP2, _PP2], ids=lambda layout: "tp2xdp2" if layout == _TP2 else "pp2xdp2")
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
    # Issue 44, part 3: the survivors kept model, optimizer and parallel state (the in-place swap), and the spare
    # had built its ranks' model ahead of the failure, for the node it shadows, which is the one that failed.
    assert all(e.get("in_place") for e in survivors), survivors
    ready = [e for e in events if e.get("event") == "spare_ready"]
    assert sorted(e["rank"] for e in ready) == [2, 3] and all(e["any_rank"] for e in ready), ready
    assert all(e.get("built_ahead") for e in spare)
    assert sorted(e["how"] for e in events if e.get("event") == "spare_assigned") == ["as_built", "as_built"]


def test_another_nodes_loss_is_taken_by_the_spare_relabelled_with_identical_losses(tmp_path, shm_root):
    """Issue 44, part 3: the spare built ahead for node1 (ranks 2, 3: data-parallel replica 1); node0 (replica 0, the
    same tensor-parallel shards) is lost. The spare takes ranks 0 and 1 in place: its groups renamed to replica 0's
    and Megatron's rank lists mapped (rebuild/regroup.py), its coordinates replica 0's; the survivors keep theirs in
    place; the losses are those of an uninterrupted run."""
    base, _ = _torchrun(tmp_path, shm_root, 4, _TP2, "base")
    metrics, events, _ = _swap(tmp_path, shm_root, _TP2, victim="node0.1")
    assert metrics == base
    assert [e["replaced"] for e in events if e.get("event") == "assignment"] == [{"node0": "spare0"}]
    assigned = [e for e in events if e.get("event") == "spare_assigned"]
    assert sorted((e["rank"], e["built_rank"], e["how"]) for e in assigned) == [(0, 2, "relabel"), (1, 3, "relabel")]
    spare = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert sorted(e["rank"] for e in spare) == [0, 1] and all(e["restored_from"] == "peer" for e in spare)
    assert {e["rank"]: e["coords"] for e in spare} == {0: {"tp": 0, "pp": 0, "dp": 0}, 1: {"tp": 1, "pp": 0, "dp": 0}}
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert sorted(e["rank"] for e in survivors) == [2, 3] and all(e.get("in_place") for e in survivors)
    # the same life as a DeepSpeed spare's (rebuild/spare.py), for each of its two processes
    lives = {w: [e["state"] for e in events if e.get("event") == "spare_state" and e["worker"] == w]
             for w in ("spare0.0", "spare0.1")}
    assert lives == {w: ["building_ahead", "waiting", "joining", "joined"] for w in lives}, lives


@pytest.mark.full_matrix(covered_by="test_differential_replay_in_process_is_exact (the same worker at PP2: rebuild, "
                                    "restore and replay exact) and the node-loss and elastic tests (rebuild under "
                                    "deadpool-run)")
def test_in_process_rebuild_and_restore_is_exact(tmp_path, shm_root):
    out = {}
    for restore_at in (0, 3):
        job = Job(launcher="torchrun", script=RESTORE_WORKER, nproc_per_node=4, port=free_port(),
                  args=("--pp", "2", "--iters", "8", "--restore-at", str(restore_at), "--shm-root", shm_root))
        res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env())
        assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
        [out[restore_at]] = tagged_json(res.output, "LOSSES")
    assert out[0] == out[3] and len(out[0]) == 8


@pytest.mark.full_matrix(covered_by="tests/integration/test_differential.py::test_lost_node_memory_replays_peer_"
                         "differentials (the same replay at a restore, end to end) and tests/unit/test_replay.py")
def test_differential_replay_in_process_is_exact(tmp_path, shm_root):
    """Differential mode on the Megatron path: base at iteration 4, a differential at 5; rebuilding and
    restoring at 5 replays it, and the losses equal an uninterrupted run."""
    out = {}
    for restore_at in (0, 3):
        job = Job(launcher="torchrun", script=RESTORE_WORKER, nproc_per_node=4, port=free_port(),
                  args=("--pp", "2", "--iters", "7", "--restore-at", str(restore_at), "--shm-root", shm_root,
                        "--differential", "4"))
        res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env())
        assert res.returncode == 0 and not res.timed_out, res.output[-4000:]
        [out[restore_at]] = tagged_json(res.output, "LOSSES")
        if restore_at:  # every rank replayed step 5
            replayed = tagged_json(res.output, "REPLAYED")
            assert sorted((r["rank"], r["replayed"]) for r in replayed) == [(r, 1) for r in range(4)], replayed
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


def _elastic(tmp_path, shm_root, layout, name, *, kill_node=None, kill_at=3, dump_steps=(), policy="shrink",
             launcher=(), inject_env=None, then=None):
    """A Megatron job under deadpool-run on 2 nodes x 2 processes and no spare; ``kill_node``'s processes are
    SIGKILLed once step ``kill_at`` is logged (then ``then(proc, timeline)``); every rank dumps its state after
    each memory restore and after ``dump_steps`` (harness hooks)."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    dumps = os.path.join(str(tmp_path), f"{name}.dumps")
    os.makedirs(dumps, exist_ok=True)
    job = Job(script=SCRIPT, nnodes=2, nproc_per_node=2, spare_nodes=0, no_spare_policy=policy, shm_root=shm_root,
              timeline=timeline, launcher_flags=tuple(launcher), args=(*layout, "--train-iters", str(ITERS)),
              config=_config(tmp_path, shm_root), config_flag="--deadpool-config", metrics=metrics,
              env_vars=harness_env({DUMP_DIR: dumps, DUMP_STEPS: ",".join(map(str, dump_steps)),
                                    **(inject_env or {})}))

    def inject(proc):
        if kill_node is None:
            return
        victims = [worker_proc(proc.pid, f"{kill_node}.{i}") for i in range(2)]
        wait_for_step(metrics, kill_at, timeout_s=JOB_TIMEOUT_S, proc=proc)
        for v in victims:
            v.send_signal(signal.SIGKILL)
        if then is not None:
            then(proc, timeline)

    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, while_running=inject, env=job.env())
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_metrics(metrics), dumps, read_events(timeline) if os.path.exists(timeline) else []


def _same_shards(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref) == ["tp0of2.pp0of1", "tp1of2.pp0of1"]
    for shard, tensors in got.items():
        assert tensors.keys() == ref[shard].keys() and any(k.startswith("optim.") for k in tensors)
        for name, t in tensors.items():
            assert torch.equal(t, ref[shard][name]), (shard, name)


def _dumps(dumps: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(dumps, pattern)))


def test_data_parallel_shrink_and_grow_restore_every_shard_from_memory(tmp_path, shm_root):
    """TP2 x DP2, node1 (data-parallel replica 1) SIGKILLed with no spare: the survivors continue as TP2 x DP1,
    two micro-batches per rank keeping the global batch, each new rank's state the one its shard had in the
    uninterrupted run at the restored step, tensor for tensor. Then node1 is repaired and the job grows back
    to TP2 x DP2: the returning replica's ranks restore their shard's state as the 1-replica world held it.
    The losses follow the uninterrupted run within 1e-6 relative (another reduction order), exactly up to the
    failure. The repair comes 3 s after the shrink; the coordinator grows only once the shrunk world has finished
    a step on every rank (hangs.not_formed), however slow the host; rank 0 is held at step 9 until the grow is
    published (the tiny model would end first)."""
    marker = os.path.join(str(tmp_path), "hold")

    def release_on_grow(proc, timeline):
        release_hold_when_grown(proc, timeline, marker, 300)

    res, metrics, dumps, events = _elastic(
        tmp_path, shm_root, _TP2, "elastic", kill_node="node1", dump_steps=tuple(range(1, ITERS + 1)),
        launcher=("--repair-after-s", "3", "--progress-timeout-s", "200"),
        inject_env={"DEADPOOL_INJECT": f"hold@step=9,rank=0,marker={marker}"}, then=release_on_grow)
    assert res.returncode == 0, res.output[-5000:]
    assigned = [(e.get("shrunk"), e.get("grown"), e["world_size"]) for e in events if e.get("event") == "assignment"]
    assert assigned == [(["node1"], None, 2), (None, ["node1"], 4)], assigned  # shrunk to 2 ranks, grown back to 4
    resized = [{k: e[k] for k in ("dp", "tp", "pp", "micro_batches", "micro_batch", "global_batch")}
               for e in events if e.get("event") == "dp_resized"]
    assert resized == [{"dp": [2, 1], "tp": 2, "pp": 1, "micro_batches": 2, "micro_batch": 4, "global_batch": [8, 8]},
                       {"dp": [1, 2], "tp": 2, "pp": 1, "micro_batches": 1, "micro_batch": 4, "global_batch": [8, 8]}]
    assert [e["storage_reads"] for e in events if e.get("event") == "resharded"] == [0, 0], events  # from memory
    shrunk = {int(os.path.basename(f).split(".")[1][1:]) for f in _dumps(dumps, "restored.v*.w1.r*")}
    grown = {int(os.path.basename(f).split(".")[1][1:]) for f in _dumps(dumps, "restored.v*.w2.r*")}
    assert len(shrunk) == 1 and len(grown) == 1, os.listdir(dumps)
    version, grown_at = shrunk.pop(), grown.pop()
    res0, base, base_dumps, _ = _elastic(tmp_path, shm_root, _TP2, "base", dump_steps=(version,), policy="fail")
    assert res0.returncode == 0, res0.output[-4000:]
    # the shrink: both replicas of the uninterrupted run (checked equal) against the 1-replica restore
    _same_shards(by_shard(_dumps(dumps, f"restored.v{version}.w1.r*")),
                 by_shard(_dumps(base_dumps, f"step.v{version}.w2.r*")))
    # the grow: the 4 ranks' restore against what the 1-replica world held at that step
    held = _dumps(dumps, f"step.v{grown_at}.w1.r*") or _dumps(dumps, f"restored.v{grown_at}.w1.r*")
    assert len(held) == 2 and len(_dumps(dumps, f"restored.v{grown_at}.w2.r*")) == 4
    _same_shards(by_shard(_dumps(dumps, f"restored.v{grown_at}.w2.r*")), by_shard(held))
    assert sorted(metrics) == sorted(base) == list(range(1, ITERS + 1))
    for step in base:
        assert metrics[step] == pytest.approx(base[step], rel=1e-6), (step, metrics[step], base[step])
    for step in range(1, version + 1):
        assert metrics[step] == base[step]


@pytest.mark.full_matrix(covered_by="tests/unit/test_megatron_layout.py::test_shrink_that_breaks_a_tensor_or_pipeline_"
                                   "group_is_refused_naming_the_rank (the rule and its line) and test_data_parallel_"
                                   "shrink_and_grow_restore_every_shard_from_memory (the shrink path at runtime)")
def test_shrink_that_breaks_a_pipeline_group_is_refused_with_one_line(tmp_path, shm_root):
    # PP2 x DP2 on 2 nodes: node1 holds pipeline stage 1 of both replicas; the survivors cannot form a
    # data-parallel shrink, so the job stops with the reason (not a hang, not a traceback loop).
    res, _, _, events = _elastic(tmp_path, shm_root, _PP2, "refused", kill_node="node1")
    assert res.returncode != 0
    assert [e["shrunk"] for e in events if e.get("event") == "assignment"] == [["node1"]], events
    refused = {(e["generation"], e["world_size"], e["error"]) for e in events if e.get("event") == "recovery_fatal"}
    assert refused == {(1, 2, "RecoveryError")}, events  # every survivor refused generation 1 (its line: unit-tested)
    assert any(e.get("event") == "stopped" for e in events), events


BAD_BATCH = [
    (["--global-batch-size", "5", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--global-batch-size", "8", "--num-microbatches", "2"], "--num-microbatches"),
]


# Each line's rule and words: tests/unit/test_megatron_layout.py::test_batch_flags_of_the_megatron_script_are_one_line_
# each; one bad flag through the real script shows the script refuses it (its ``refused`` event names the flag) before
# it trains.
@pytest.mark.parametrize("flags,flag", matrix(BAD_BATCH, ci=BAD_BATCH[:1]))
def test_bad_batch_flags_are_refused_naming_the_flag(tmp_path, shm_root, flags, flag):
    timeline = os.path.join(str(tmp_path), "bad.timeline.jsonl")
    job = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=1, port=free_port(),
              args=(*flags, "--train-iters", "2"), config=_config(tmp_path, shm_root), config_flag="--deadpool-config",
              env_vars={"DEADPOOL_TIMELINE": timeline})
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env())
    assert res.returncode != 0 and not res.timed_out
    refused = [(e["error"], e.get("key")) for e in read_events(timeline) if e.get("event") == "refused"]
    assert refused == [("ConfigError", flag)], res.output[-3000:]
