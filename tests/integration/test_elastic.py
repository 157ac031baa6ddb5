"""Elastic shrink under deadpool-run: a node is SIGKILLed with no spare left, the survivors continue on fewer
data-parallel ranks, their ZeRO partitions resharded from memory (tier 1 of the survivors, tier 2 replicas of
the lost node), the global batch kept by gradient accumulation.

Of record: every element of the resharded state (fp32 masters, Adam moments) equals the state of an
uninterrupted run at the same step, gathered whole from both runs' partitions; the losses after the shrink
follow the uninterrupted run within 1e-6 relative (the reduction order differs with the data-parallel size;
dropout off, the data taken by global sample index)."""
from __future__ import annotations

import glob
import os
import signal

import pytest
import torch

from deadpool_ext.chaos.at_step import harness_env
from deadpool_ext.chaos.dump import DIR, STEPS, gather
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import free_port, read_metrics, run_job, wait_for_step
from tests.conftest import make_config, matrix
from tests.integration.helpers import release_hold_when_grown, worker_proc

pytestmark = pytest.mark.slow
ITERS = 8


def elastic_run(tmp_path, shm_root, *, stage, nnodes, nproc, name, kill_node=None, kill_at=4, dump_steps=(),
                policy="shrink", iters=ITERS, launcher=(), inject_env=None, then=None, deadpool=None, **cfg):
    config = make_config(tmp_path, stage=stage, deadpool={"local": {"shm_root": shm_root}, **(deadpool or {})},
                         **cfg)
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    dumps = os.path.join(str(tmp_path), f"{name}.dumps")
    os.makedirs(dumps, exist_ok=True)
    job = Job(script="scripts/pretrain_gpt.py", nnodes=nnodes, nproc_per_node=nproc, spare_nodes=0,
              no_spare_policy=policy, shm_root=shm_root, timeline=timeline, launcher_flags=tuple(launcher),
              config=config, args=("--train-iters", str(iters), "--dropout", "0"), metrics=metrics,
              env_vars=harness_env({DIR: dumps, STEPS: ",".join(map(str, dump_steps)), **(inject_env or {})}))

    def inject(proc):
        if kill_node is None:
            return
        victims = [worker_proc(proc.pid, f"{kill_node}.{i}") for i in range(nproc)]
        wait_for_step(metrics, kill_at, timeout_s=240, proc=proc)
        for v in victims:
            v.send_signal(signal.SIGKILL)
        if then is not None:
            then(proc, timeline, job, metrics)

    res = run_job(job.argv(), timeout_s=400, while_running=inject, env=job.env())
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    events = read_events(timeline) if os.path.exists(timeline) else []
    return res, read_metrics(metrics), events, dumps


def _restored(dumps: str, world: str = "*") -> tuple[int, list[str]]:
    files = sorted(glob.glob(os.path.join(dumps, f"restored.v*.w{world}.r*")))
    versions = {int(os.path.basename(f).split(".")[1][1:]) for f in files}
    assert len(versions) == 1, files
    return versions.pop(), files


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a, (a.keys(), b.keys())
    for kind in a:
        assert a[kind].keys() == b[kind].keys(), kind
        for pid in a[kind]:
            assert torch.equal(a[kind][pid], b[kind][pid]), (kind, pid)


def _close(metrics: dict[int, float], base: dict[int, float], iters: int = ITERS) -> None:
    assert sorted(metrics) == sorted(base) == list(range(1, iters + 1))
    for step in base:
        assert metrics[step] == pytest.approx(base[step], rel=1e-6), (step, metrics[step], base[step])


SHAPES = {
    # (nodes, procs per node) -> DeepSpeed batch keys: the global batch divides both data-parallel sizes
    (2, 2): {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
    (3, 1): {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("stage,shape", matrix([(s, sh) for s in (1, 2, 3) for sh in SHAPES],
                                               ci=[(1, (2, 2))]))  # ZeRO-3 4 -> 2: the grow test
def test_shrink_reshards_from_memory_element_exact(tmp_path, shm_root, stage, shape):
    nnodes, nproc = shape
    batch = SHAPES[shape]
    res, metrics, events, dumps = elastic_run(tmp_path, shm_root, stage=stage, nnodes=nnodes, nproc=nproc,
                                              name="shrink", kill_node="node1", **batch)
    assert res.returncode == 0, res.output[-5000:]
    new_world = (nnodes - 1) * nproc
    assign = [(e["shrunk"], e["world_size"]) for e in events if e.get("event") == "assignment"]
    assert assign == [(["node1"], new_world)], events  # --no-spare-policy shrink: continuing without node1
    version, files = _restored(dumps)
    assert len(files) == new_world
    # The uninterrupted run at the full size, its state dumped at the restored step.
    res0, base, _, base_dumps = elastic_run(tmp_path, shm_root, stage=stage, nnodes=nnodes, nproc=nproc,
                                            name="base", dump_steps=(version,), policy="fail", **batch)
    assert res0.returncode == 0, res0.output[-4000:]
    ref = sorted(glob.glob(os.path.join(base_dumps, f"step.v{version}.w*.r*")))
    assert len(ref) == nnodes * nproc
    _assert_same_state(gather(files), gather(ref))
    _close(metrics, base)
    # Up to the failure the losses are the very same; the shrunk run redid at most one step.
    for step in range(1, version + 1):
        assert metrics[step] == base[step]
    resharded = [(e["version"], e["from_world"], e["to_world"], e["storage_reads"]) for e in events
                 if e.get("event") == "resharded"]
    assert resharded == [(version, nnodes * nproc, new_world, 0)], events  # resharded from memory, no storage read


@pytest.mark.full_matrix(covered_by="tests/unit/test_reshard.py::test_global_batch_kept_or_refused (the rule and its "
                                   "line) and test_shrink_reshards_from_memory_element_exact (the shrink path that "
                                   "applies it at runtime)")
def test_shrink_refused_when_the_global_batch_cannot_be_kept(tmp_path, shm_root):
    # 3 ranks x micro 2 x accumulation 1 = 6 cannot be made by 2 ranks x micro 2: refused, with the reason.
    res, _, events, _ = elastic_run(tmp_path, shm_root, stage=1, nnodes=3, nproc=1, name="refused",
                                    kill_node="node1", train_batch_size=6, train_micro_batch_size_per_gpu=2,
                                    gradient_accumulation_steps=1)
    assert res.returncode != 0
    refused = {(e["generation"], e["world_size"], e["error"]) for e in events if e.get("event") == "recovery_fatal"}
    assert refused == {(1, 2, "BatchChangeRefused")}, events  # the rule, its line (allow_batch_change): test_reshard


@pytest.mark.parametrize("how", matrix(["repaired", "joined"], ci=["joined"]))  # repaired: the Megatron grow test
def test_grow_back_when_a_node_returns(tmp_path, shm_root, how):
    """4 ranks -> node1 lost, shrink to 2 -> a node comes back -> grow back to 4: the state restored on 4 ranks
    equals, element for element, what the 2-rank world held at that step; the losses follow the uninterrupted
    run. The node comes back ``repaired`` (node1's processes started again, --repair-after-s) or ``joined``: a
    second launcher, ``deadpool-run --join extra0`` with the job's store, job id and token, started once the
    shrunk world trains (the coordinator admits it and grows to it once its processes beat). Rank 0 is held at
    step 7 until the grow is published (so the tiny model's job does not end before the new processes are up);
    the collective and progress deadlines are raised above that wait."""
    import threading

    iters, batch = 10, SHAPES[(2, 2)]
    marker = os.path.join(str(tmp_path), "hold")
    token, job_id, port = "t0ken-" + os.urandom(8).hex(), "growjob", free_port()
    joiner: dict = {}

    def start_joiner(job, metrics):
        wait_for_step(metrics, 4, timeout_s=240)  # the shrunk world redid step 3 and trains on
        env = harness_env({DIR: dumps_dir, STEPS: ",".join(map(str, range(1, iters + 1))),
                           "DEADPOOL_STORE_TOKEN": token})
        joining = Job(script=job.script, args=job.args, config=job.config, metrics=job.metrics, join="extra0",
                      nnodes=None, store_url=f"dp://127.0.0.1:{port}", job_id=job_id, nproc_per_node=2,
                      shm_root=shm_root, env_vars=env)
        t = threading.Thread(target=lambda: joiner.update(res=run_job(joining.argv(), timeout_s=300,
                                                                      env=joining.env())), daemon=True)
        t.start()
        joiner["thread"] = t

    def release_on_grow(proc, timeline, job, metrics):
        if how == "joined":
            start_joiner(job, metrics)
        release_hold_when_grown(proc, timeline, marker, 240)

    dumps_dir = os.path.join(str(tmp_path), "grow.dumps")
    back = (("--repair-after-s", "0.5") if how == "repaired" else
            ("--job-id", job_id, "--store-port", str(port)))
    res, metrics, events, dumps = elastic_run(
        tmp_path, shm_root, stage=3, nnodes=2, nproc=2, name="grow", kill_node="node1", kill_at=2, iters=iters,
        dump_steps=tuple(range(1, iters + 1)), launcher=(*back, "--progress-timeout-s", "200"),
        inject_env={"DEADPOOL_INJECT": f"hold@step=7,rank=0,marker={marker}",
                    "DEADPOOL_STORE_TOKEN": token}, then=release_on_grow,
        deadpool={"hot_swap": {"collective_timeout_s": 200}}, **batch)
    assert res.returncode == 0, res.output[-5000:]
    node = "node1" if how == "repaired" else "extra0"
    grown = [(e["grown"], e["world_size"]) for e in events if e.get("event") == "assignment" and "grown" in e]
    assert grown == [([node], 4)], events  # node joins: growing to 4 ranks (was 2)
    if how == "repaired":
        assert [e["node"] for e in events if e.get("event") == "repaired"] == ["node1"], events
    else:
        joiner["thread"].join(60)
        jres = joiner["res"]
        assert jres.returncode == 0 and not jres.timed_out, jres.output[-4000:]
        assert [e["node"] for e in events if e.get("event") == "joined"] == ["extra0"], events  # admitted
    version, files = _restored(dumps, world="4")
    assert len(files) == 4
    # what the 2-rank world held at that step: its state after the step, or its own restore if it took none
    held = (sorted(glob.glob(os.path.join(dumps, f"step.v{version}.w2.r*")))
            or sorted(glob.glob(os.path.join(dumps, f"restored.v{version}.w2.r*"))))
    assert len(held) == 2, os.listdir(dumps)
    _assert_same_state(gather(files), gather(held))
    res0, base, _, base_dumps = elastic_run(tmp_path, shm_root, stage=3, nnodes=2, nproc=2, name="base",
                                            iters=iters, policy="fail", dump_steps=tuple(range(1, iters + 1)), **batch)
    assert res0.returncode == 0, res0.output[-4000:]
    _close(metrics, base, iters)
    # and the shrink before it (ZeRO-3, 4 -> 2): the 2-rank restore equals the uninterrupted run's state
    shrunk, files2 = _restored(dumps, world="2")
    _assert_same_state(gather(files2), gather(sorted(glob.glob(os.path.join(base_dumps, f"step.v{shrunk}.w4.r*")))))
