"""Issue 43, parts 4 and 5, where the process boundary is what is tested (the decisions themselves:
tests/unit/test_fast_paths.py):

- a script that builds its config dict in code (nothing names a config on the command line) under
  ``deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1``: the spare learns the section from rank 0's attach,
  builds its engine ahead of any failure, and when a worker is SIGKILLed the survivor swaps in place and the spare
  that built ahead takes the lost rank;
- a 2-stage ``PipelineModule`` job under deadpool-run: the spare builds its pipeline engine ahead (its solo group's
  point-to-point warm-up) and survives start-up instead of dying with ``recv cannot be computed locally``; at a
  SIGKILLed stage the survivor swaps in place, or with ``in_place: false`` in a config built in code rebuilds
  through a factory that reuses ``args``, and the losses are the uninterrupted run's.

Each job holds rank 1 at an early step (the harness's ``hold`` fault) until the spare says it is ready, so that the
spare's readiness, not the host's load, decides the order; the progress timeout is raised so the hold is not taken
for a hang.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from deadpool_ext.chaos import at_step
from deadpool_ext.chaos.at_step import StepFault
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import run_job
from tests.integration.helpers import JOB_TIMEOUT_S, worker_proc

pytestmark = pytest.mark.slow
ACCELERATE_LOOP = "scripts/examples/accelerate_loop.py"
PIPE = "tests/integration/workers/pipeline_resilient.py"
HOLD_FLAGS = ("--progress-timeout-s", "200")


def _events(path: str, kind: str) -> list[dict]:
    return [e for e in read_events(path) if e.get("event") == kind] if os.path.exists(path) else []


def _wait_held(proc, timeline: str, marker: str, spare_ready: bool) -> None:
    """Rank 1 held (its marker exists) and, with ``spare_ready``, the spare built ahead (its ``spare_ready``
    event), or the job ended."""
    deadline = time.time() + JOB_TIMEOUT_S
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(marker) and (not spare_ready or _events(timeline, "spare_ready")):
            return
        time.sleep(0.2)


def _deadpool_run(tmp_path, shm_root: str, name: str, script: str, args: tuple[str, ...], *, hold_step: int,
                  then, spare_ready: bool = True) -> tuple:
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    marker = os.path.join(str(tmp_path), f"{name}.hold")
    env = at_step.harness_env({at_step.ENV: StepFault("hold", hold_step, 1, marker).render()})
    job = Job(script=script, nnodes=2, nproc_per_node=1, spare_nodes=1, shm_root=shm_root, timeline=timeline,
              args=args, env_vars=env, launcher_flags=HOLD_FLAGS)
    pids: dict[str, int] = {}

    def watch(proc) -> None:
        for wid in ("node0.0", "node1.0"):
            pids[wid] = worker_proc(proc.pid, wid).pid
        _wait_held(proc, timeline, marker, spare_ready)
        then(proc, marker)

    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(), while_running=watch)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_events(timeline) if os.path.exists(timeline) else [], pids


def _section(tmp_path, shm_root: str) -> dict:
    with open("configs/gpt_tiny_zero3_cpu_noopt.json") as fh:
        cfg = json.load(fh)
    cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1}, "local": {"shm_root": shm_root}}
    return cfg


def test_a_config_built_in_code_gets_the_in_place_swap_and_a_spare_built_ahead(tmp_path, shm_root):
    """The Accelerate loop with its DeepSpeed config passed as JSON text (``--deepspeed-inline``: a dict built in
    the script, no file for the runner to see). Before issue 43 the spare waited before its script and the
    survivor's groups were not swappable ('hot_swap.in_place is false, or every rank rebuilds')."""
    inline = json.dumps(_section(tmp_path, shm_root))

    def kill_held_worker(proc, marker: str) -> None:
        if proc.poll() is None:
            worker_proc(proc.pid, "node1.0").send_signal(signal.SIGKILL)

    res, events, pids = _deadpool_run(tmp_path, shm_root, "code", ACCELERATE_LOOP, ("--deepspeed-inline", inline,
                                                                           "--steps", "5"),
                                      hold_step=2, then=kill_held_worker)
    assert res.returncode == 0, res.output[-4000:]
    # the spare built its engine ahead, for rank 1 of 2, before the failure
    ready = _events_of(events, "spare_ready")
    assert [(e["rank"], e["world_size"]) for e in ready] == [(1, 2)], ready
    # the survivor kept its process and swapped in place; the process that built ahead restored rank 1
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert [(e["pid"], e.get("in_place")) for e in survivors] == [(pids["node0.0"], True)], survivors
    spares = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert [(e["rank"], e["pid"]) for e in spares] == [(1, ready[0]["pid"])], spares
    continued = [(e["pid"], e["how"]) for e in events if e.get("event") == "continued"]
    assert (pids["node0.0"], "in_place") in continued, continued
    assert not _events_of(events, "spare_failed") and not _events_of(events, "spare_lost")


def test_a_pipeline_job_takes_a_spare_in_place_built_ahead_or_rebuilds_bit_for_bit(tmp_path, shm_root):
    """A 2-stage ``PipelineModule`` job (``train_batch`` in a ``ResilientLoop``) under deadpool-run with one spare,
    rank 1 (the last stage) SIGKILLed after step 2, every loss after it equal to the uninterrupted run's:

    - config file, the defaults: the spare builds its pipeline engine ahead for rank 1 (its warm-up send/recv
      answered by its solo group) instead of dying at start-up with an INFO ``spare_lost`` event; the survivor
      swaps in place (its interrupted ``train_batch`` abandoned: timers, activation shapes, buffers) and the spare
      that built ahead takes rank 1;
    - config dict built in code with ``hot_swap.in_place: false`` and a rebuild factory that passes the same
      ``args`` (``args.deepspeed_config``) again: the active ranks assumed the defaults, the spare learns the
      section from rank 0's attach and waits; the survivor rebuilds through the factory (its ``args`` still hold
      the config, and the global batch is kept at the pipeline's data-parallel size, not the world's) and the spare
      builds after its assignment."""
    from tests.conftest import make_config

    section = {"snapshot": {"interval": 1}, "local": {"shm_root": shm_root}}
    batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    cfg = make_config(tmp_path, stage=0, deadpool=section, **batch)
    with open(make_config(tmp_path, stage=0, deadpool={**section, "hot_swap": {"in_place": False}}, **batch)) as fh:
        in_code = fh.read()   # JSON text on the command line: nothing names a file before the start

    def release(proc, marker: str) -> None:
        with open(marker + ".release", "w") as fh:
            json.dump({"released": time.time()}, fh)

    def kill_held_worker(proc, marker: str) -> None:
        if proc.poll() is None:
            worker_proc(proc.pid, "node1.0").send_signal(signal.SIGKILL)

    runs, outcome = {}, {}
    for name, config, extra, then in (("ref", cfg, (), release), ("in_place", cfg, (), kill_held_worker),
                                      ("rebuild", in_code, ("--rebuild",), kill_held_worker)):
        out = os.path.join(str(tmp_path), f"{name}.jsonl")
        res, events, pids = _deadpool_run(tmp_path, shm_root, name, PIPE, (config, "6", out, *extra), hold_step=2,
                                          then=then, spare_ready=name != "rebuild")
        assert res.returncode == 0, res.output[-4000:]
        assert not _events_of(events, "spare_failed") and not _events_of(events, "spare_lost"), events
        ready = _events_of(events, "spare_ready")
        assert [(e["rank"], e["world_size"]) for e in ready] == ([] if name == "rebuild" else [(1, 2)]), ready
        survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
        spares = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
        outcome[name] = ([(e["pid"] == pids["node0.0"], bool(e.get("in_place"))) for e in survivors],
                         [(e["rank"], e["built_ahead"], e["pid"] in [r["pid"] for r in ready]) for e in spares],
                         [e["state"] for e in _events_of(events, "spare_state")])
        with open(out) as fh:
            runs[name] = {r["step"]: r["loss"] for r in map(json.loads, fh)}   # a redone step: the last value
    assert outcome == {"ref": ([], [], ["building_ahead", "waiting"]),   # its spare waits until the job ends
                       "in_place": ([(True, True)], [(1, True, True)], ["building_ahead", "waiting", "joining",
                                                                        "joined"]),
                       "rebuild": ([(True, False)], [(1, False, False)], ["waiting", "building", "joined"])}, outcome
    assert sorted(runs["ref"]) == list(range(1, 7)), runs
    for name in ("in_place", "rebuild"):
        assert {3, 4, 5, 6} <= set(runs[name]) and all(runs[name][s] == runs["ref"][s] for s in runs[name]), runs


def _events_of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("event") == kind]
