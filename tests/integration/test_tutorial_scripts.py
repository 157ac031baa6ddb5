"""Scripts written as DeepSpeed's tutorials write them, with only the ``"deadpool"`` section added (issue 43).

``scripts/examples/ds_tutorial_mlm.py`` has no line of deadpool_ext: a masked-LM loop with its own shuffled
``DataLoader`` and a collator that masks from the global RNG, the config dict built in code, and DeepSpeed's own
resume (``load_checkpoint`` with the step in ``client_state``, ``save_checkpoint`` every few steps). Each test
compares the losses with the same script's without the section and without a failure, bit for bit.
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
from deadpool_ext.testing.launch import free_port, read_metrics, run_job
from tests.conftest import matrix
from tests.integration import test_existing_jobs as existing_jobs
from tests.integration.helpers import JOB_TIMEOUT_S, kill_at, worker_proc

pytestmark = pytest.mark.slow
SCRIPT = "scripts/examples/ds_tutorial_mlm.py"
ABORT_AT_EXIT = "terminate called without an active exception"
SUMMARY = "] summary {"
PIPE = "scripts/examples/ds_tutorial_pipe.py"


def _section(shm_root: str) -> str:
    return json.dumps({"snapshot": {"interval": 1}, "replication": {"factor": 1},
                       "local": {"shm_root": shm_root, "simulate_nodes": 2}})


def _run(tmp_path, name: str, args: list[str], *, shm_root: str | None = None, kill_after: int | None = None,
         script: str = SCRIPT):
    """The script under torchrun (2 ranks); with ``shm_root``: the section added and the runner in front, one
    restart allowed; ``kill_after``: rank 1 SIGKILLed right after that optimizer step."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    full = [*args, "--save-dir", os.path.join(str(tmp_path), f"{name}.ckpt"), "--metrics-out", metrics]
    if shm_root is not None:
        full += ["--deadpool-section", _section(shm_root)]
    env = {"DEADPOOL_TIMELINE": timeline}
    inject = kill_at(kill_after) if kill_after is not None else None
    if inject is not None:
        env.update(inject.env(os.path.join(str(tmp_path), f"{name}.fault")))
    job = Job(launcher="torchrun", script=script, wrap="deadpool_ext.run" if shm_root is not None else None,
              nproc_per_node=2, port=free_port(), max_restarts=1 if kill_after is not None else 0, args=tuple(full),
              env_vars=env)
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(),
                  while_running=(lambda p: inject(p, metrics)) if inject is not None else None)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    ok = not res.timed_out and res.returncode == 0
    if not ok and shm_root is None and ABORT_AT_EXIT in res.output and SUMMARY in res.output:
        # the script without the extension trained to the end, then gloo's threads met the interpreter's exit
        # (torch's own abort, seen once in ~30 such runs; under deadpool_ext.run, run.exit_orderly prevents it):
        # its losses are whole, and the reference is all this run is for
        ok = True
    assert ok, res.output[-4000:]
    events = read_events(timeline) if os.path.exists(timeline) else []
    rows = [json.loads(ln) for ln in open(metrics)] if os.path.exists(metrics) else []
    return read_metrics(metrics), events, rows


_REFS: dict[tuple[str, tuple[str, ...]], dict[int, float]] = {}
"""The reference losses (the script alone, no failure), by script and arguments less ``--save-interval``: where a
script saves changes nothing it trains, so one run serves every test of the module that trains alike (a save that
changed a loss would fail every comparison below)."""


def _ref(tmp_path, args: list[str], *, script: str = SCRIPT) -> dict[int, float]:
    i = args.index("--save-interval") if "--save-interval" in args else None
    key = (script, tuple(args if i is None else args[:i] + args[i + 2:]))
    if key not in _REFS:
        _REFS[key] = _run(tmp_path, "ref", args, script=script)[0]
    return dict(_REFS[key])


def _same(losses: dict, ref: dict, *, last: int) -> None:
    assert sorted(losses) == list(range(1, last + 1)), sorted(losses)
    assert losses == ref


@pytest.mark.parametrize("variant", matrix(["shuffle", "accumulation"], ci=["shuffle"]))
def test_a_tutorial_loop_restarts_from_memory_through_load_checkpoint(tmp_path, shm_root, variant):
    """Rank 1 SIGKILLed after step 5; the disk holds the script's save of step 3. After the torchrun restart,
    DeepSpeed's own ``load_checkpoint`` returns memory's newer step with the client state the script saved, its
    ``step`` moved to that step; the loader continues at the batch the uninterrupted run drew next (``shuffle``: a
    ``RandomSampler`` on the global RNG and a collator masking from it, an epoch ending after step 8;
    ``accumulation``: 2 accumulation steps and a ``DistributedSampler`` whose epochs end during the run). Every loss
    bit for bit."""
    args = ["--steps", "10", "--save-interval", "3", "--dataset-size", "32"]  # 8 batches an epoch
    if variant == "accumulation":  # 48 samples over 2 ranks, micro-batches of 4, 2 of them a step: 3 steps an epoch
        args += ["--gas", "2", "--sampler", "distributed", "--dataset-size", "48", "--zero-stage", "2"]
    ref = _ref(tmp_path, args)
    assert sorted(ref) == list(range(1, 11))
    losses, events, rows = _run(tmp_path, "restart", args, shm_root=shm_root, kill_after=5)
    _same(losses, ref, last=10)
    assert all(r["step"] == r["global_steps"] for r in rows), rows  # the client state's step moved with the engine
    loaded = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert len(loaded) == 2 and {e["disk_step"] for e in loaded} == {3}, loaded
    assert {e["step"] for e in loaded} & {4, 5} and len({e["step"] for e in loaded}) == 1, loaded
    assert {e["moved"][0] for e in loaded} == {"step"}
    positioned = [e for e in events if e.get("event") == "data_position"]
    assert len(positioned) == 2, positioned


def test_a_restart_before_the_scripts_first_save_counts_from_where_the_loop_was(tmp_path, shm_root):
    """Rank 1 killed right after step 3, the script saving every 5 steps: nothing was ever saved, so each snapshot
    carried the loop's own counters (checkpoint_calls.state: its step-like variables, at the engine's count when the
    step began); after the torchrun restart ``load_checkpoint`` hands them back moved to the restored step, and the
    script goes on from there (it counted from 0 before, training every step again on top of the restored
    engine). Losses bit for bit."""
    args = ["--steps", "10", "--save-interval", "5", "--dataset-size", "32"]
    ref = _ref(tmp_path, args)
    losses, events, rows = _run(tmp_path, "restart", args, shm_root=shm_root, kill_after=3)
    _same(losses, ref, last=10)
    assert all(r["step"] == r["global_steps"] for r in rows), rows
    loaded = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert len(loaded) == 2 and {e["disk_step"] for e in loaded} == {None}, loaded
    assert {tuple(e["moved"]) for e in loaded} == {("step",)} and {e["step"] for e in loaded} & {2, 3}, loaded


def test_a_tutorial_loop_that_loads_nothing_is_told_how_to_restore(tmp_path, shm_root):
    """The same script with ``--save-dir`` never loaded (the flag ``--no-load``): told once at the first snapshot
    that a restart trains again from step 0, with the fix."""
    _, events, _ = _run(tmp_path, "noload", ["--steps", "2", "--no-load"], shm_root=shm_root)
    never = [e["unused_versions"] for e in events if e.get("event") == "never_restores"]
    assert never == [[]], never


def _dprun(tmp_path, shm_root: str, name: str, args: list[str], *, env: dict | None = None,
           kill_after_step: int | None = None, script: str = SCRIPT, **more):
    """The script under deadpool-run (2 nodes of 1 worker, 1 spare: ``test_existing_jobs._dprun``), the section added
    to its in-code config (nothing names a file)."""
    full = [*args, "--save-dir", os.path.join(str(tmp_path), f"{name}.ckpt"), "--deadpool-section",
            json.dumps({"snapshot": {"interval": 1}, "replication": {"factor": 1}, "local": {"shm_root": shm_root}})]
    res, losses, events, pids = existing_jobs._dprun(tmp_path, shm_root, name, script, full, env=env,
                                                     kill_after_step=kill_after_step, **more)
    assert res.returncode == 0, res.output[-4000:]
    return losses, events, pids


@pytest.mark.parametrize("variant,fault", matrix(
    [(v, f) for v in ("shuffle", "accumulation") for f in ("after_step", "mid_step")],
    ci=[("accumulation", "after_step"), ("shuffle", "mid_step")]))
def test_a_tutorial_loop_survives_a_hot_swap_unchanged(tmp_path, shm_root, variant, fault):
    """Under deadpool-run with a spare, the plain loop (no resilient_steps, no ResilientLoop) survives a lost node:
    the survivor keeps its process and engine, and the step the lost peer interrupted is redone inside DeepSpeed's
    own forward / backward / step from the recorded micro-batches; the spare restores through the script's
    ``load_checkpoint`` and its loader continues at the right batch. ``after_step``: rank 1 killed in-process right
    after its optimizer step 4; ``mid_step``: SIGKILLed from outside once rank 0 logged step 3, wherever it is.
    Every loss bit for bit against the script without the section."""
    # the script saves every 2 steps: the spare's client state (its step) is the one saved at step 2, moved on
    args = ["--steps", "10", "--save-interval", "2", "--dataset-size", "32"]
    if variant == "accumulation":
        args += ["--gas", "2", "--sampler", "distributed", "--dataset-size", "48", "--zero-stage", "2"]
    ref = _ref(tmp_path, args)
    if fault == "after_step":
        marker = os.path.join(str(tmp_path), "fault.marker")
        losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, env=at_step.harness_env(
            {at_step.ENV: StepFault("kill", 4, 1, marker).render()}))
    else:
        losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, kill_after_step=3)
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert [(e["pid"], e.get("in_place")) for e in survivors] == [(pids["node0.0"], True)], survivors
    redone = [e for e in events if e.get("event") == "continued" and e.get("how") == "redo_in_place"]
    assert [e["pid"] for e in redone] == [pids["node0.0"]], redone
    spare = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert len(spare) == 1 and spare[0]["pid"] not in pids.values(), spare
    assert set(losses) == set(range(1, 11)) and losses == ref


def test_a_spare_restored_to_the_step_of_the_scripts_first_save_counts_from_it(tmp_path, shm_root):
    """Snapshots every 2 steps, the script saving every 2: rank 1 killed right after step 3, so the survivor and the
    spare restore step 2, whose snapshot was taken before the script's save at step 2 (a save follows its step's
    snapshot). The spare's ``load_checkpoint`` hands back the client state of that save (``{"step": 2}``, published
    in the job's store), not an empty one: a spare counting from 0 trained two steps more than the survivor and
    waited at the end for collectives nobody joined. Losses bit for bit."""
    args = ["--steps", "10", "--save-interval", "2", "--dataset-size", "32"]
    ref = _ref(tmp_path, args)
    full = [*args, "--save-dir", os.path.join(str(tmp_path), "swap.ckpt"), "--deadpool-section",
            json.dumps({"snapshot": {"interval": 2}, "replication": {"factor": 1}, "local": {"shm_root": shm_root}})]
    marker = os.path.join(str(tmp_path), "fault.marker")
    res, losses, events, pids = existing_jobs._dprun(
        tmp_path, shm_root, "swap", SCRIPT, full,
        env=at_step.harness_env({at_step.ENV: StepFault("kill", 3, 1, marker).render()}))
    assert res.returncode == 0, res.output[-4000:]
    spare = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert [e["step"] for e in spare] == [2], spare
    assert set(losses) == set(range(1, 11)) and losses == ref


@pytest.mark.full_matrix(covered_by="test_a_tutorial_pipeline_job_survives_a_hot_swap_unchanged (the spare restores "
                         "its stage from memory through the script's load_checkpoint, its DeepSpeed loader positioned) "
                         "and tests/integration/test_ds_wrappers.py::test_pipeline_engine_saves_loads_and_resumes_"
                         "through_the_checkpoint_engine (a pipeline's load_checkpoint routed to memory)")
def test_a_tutorial_pipeline_job_restarts_from_memory_through_load_checkpoint(tmp_path, shm_root):
    """``ds_tutorial_pipe.py``: a 2-stage ``PipelineModule`` fed by DeepSpeed's own loader (``training_data=``, a
    ``RepeatingLoader`` the engine iterates before the script's ``load_checkpoint``), dropout on both stages,
    ``train_batch()`` in a plain loop. Rank 1 SIGKILLed in step 5's optimizer step, the disk holding the script's
    save of step 3:
    after the torchrun restart ``load_checkpoint`` returns memory's step, and the engine's iterator, made at
    ``deepspeed.initialize``, is positioned where the uninterrupted run's was (the epoch ends after step 8). Every
    loss bit for bit."""
    args = ["--steps", "10", "--save-interval", "3"]
    ref = _ref(tmp_path, args, script=PIPE)
    assert sorted(ref) == list(range(1, 11))
    losses, events, rows = _run(tmp_path, "restart", args, shm_root=shm_root, kill_after=5, script=PIPE)
    assert all(r["step"] == r["global_steps"] for r in rows), rows
    loaded = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert len(loaded) == 2 and {e["disk_step"] for e in loaded} == {3}, loaded
    restored = {e["step"] for e in loaded}
    assert restored in ({4}, {5}), loaded
    # the last stage dies in step 5's optimizer step, before train_batch broadcasts the loss, so the first run
    # never prints step 5. Restored at 5 (both stages' snapshot of 5 committed before the kill), the restart goes
    # on at 6 and step 5's loss is never printed; restored at 4 (the first stage's snapshot of 5 not yet
    # committed: the agreement takes the newest step every rank holds), step 5 is trained again and printed
    expected = [s for s in range(1, 11) if s != 5 or restored == {4}]
    assert sorted(losses) == expected, (sorted(losses), loaded)
    assert losses == {s: ref[s] for s in expected}
    positioned = [e for e in events if e.get("event") == "data_position"]
    assert len(positioned) == 2, positioned


@pytest.mark.parametrize("fault", matrix(["after_step", "mid_step"], ci=["mid_step"]))
def test_a_tutorial_pipeline_job_survives_a_hot_swap_unchanged(tmp_path, shm_root, fault):
    """``ds_tutorial_pipe.py`` under deadpool-run with a spare: the plain ``train_batch()`` loop survives a lost
    stage. The survivor keeps its process and engine; the interrupted ``train_batch`` is redone inside DeepSpeed's
    own call from its recorded micro-batches and RNG; the spare builds its stage ahead, restores through the script's
    ``load_checkpoint`` and its DeepSpeed loader continues at the right batch. ``after_step``: rank 1 killed
    in-process right after its optimizer step 4; ``mid_step``: SIGKILLed from outside once rank 0 logged step 3.
    Every loss bit for bit against the script without the section."""
    args = ["--steps", "10", "--save-interval", "2"]
    ref = _ref(tmp_path, args, script=PIPE)
    if fault == "after_step":
        marker = os.path.join(str(tmp_path), "fault.marker")
        losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, script=PIPE, env=at_step.harness_env(
            {at_step.ENV: StepFault("kill", 4, 1, marker).render()}))
    else:
        losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, script=PIPE, kill_after_step=3)
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert [(e["pid"], e.get("in_place")) for e in survivors] == [(pids["node0.0"], True)], survivors
    redone = [e for e in events if e.get("event") == "continued" and e.get("how") == "redo_in_place"]
    assert [e["pid"] for e in redone] == [pids["node0.0"]], redone
    spare = [e for e in events if e.get("event") == "continued" and e.get("how") == "load_checkpoint"]
    assert len(spare) == 1 and spare[0]["pid"] not in pids.values(), spare
    assert set(losses) == set(range(1, 11)) and losses == ref


def test_a_stage_the_spare_did_not_build_for_is_started_from_its_warm_parent(tmp_path, shm_root):
    """``ds_tutorial_pipe.py`` under deadpool-run, rank 0 (pipeline stage 0) held right after its optimizer step 2
    until the spare has built stage 1 ahead (it shadows node1; its ``spare_ready`` event), then SIGKILLed. A pipeline
    engine cannot take another stage in place (``takeover.refusal``), so the spare starts again for stage 0: a fresh
    child of its warm parent, the imports done (``rebuild/warm.py``), not a fresh interpreter. The launcher's
    process for the spare stays the same. Every loss bit for bit against the script without the section. (The hold
    makes the spare's readiness, not the host's speed, decide the order: a spare still importing when the stage is
    lost is assigned before it builds, and never starts again.)"""
    args = ["--steps", "10", "--save-interval", "2"]
    ref = _ref(tmp_path, args, script=PIPE)
    marker = os.path.join(str(tmp_path), "hold.marker")

    def kill_when_the_spare_is_ready(proc, timeline: str) -> None:
        deadline = time.time() + JOB_TIMEOUT_S
        while proc.poll() is None and time.time() < deadline:
            if os.path.exists(marker) and os.path.exists(timeline) and any(
                    e.get("event") == "spare_ready" for e in read_events(timeline)):
                worker_proc(proc.pid, "node0.0").send_signal(signal.SIGKILL)
                return
            time.sleep(0.2)

    losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, script=PIPE, env=at_step.harness_env(
        {at_step.ENV: StepFault("hold", 2, 0, marker).render()}), then=kill_when_the_spare_is_ready,
        launcher_flags=("--progress-timeout-s", "200"))
    assigned = [(e["how"], e["built_rank"], e["rank"], e.get("warm")) for e in events
                if e.get("event") == "spare_assigned"]
    assert assigned == [("start_again", 1, 0, True)], assigned
    held = [e for e in events if e.get("event") == "spare_warm_parent"]
    assert len(held) == 1 and "deepspeed" in held[0]["imported"], held
    ready = [e["pid"] for e in events if e.get("event") == "spare_ready"]
    spare = [e["pid"] for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert len(ready) == len(spare) == 1 and held[0]["pid"] not in ready + spare and ready != spare, (ready, spare)
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert [(e["pid"], e.get("in_place")) for e in survivors] == [(pids["node1.0"], True)], survivors
    # rank 0 prints each step's loss: held inside its step 2 (after the optimizer step), its line for step 2 died
    # with it when the restore resumes after step 2, committed on both ranks
    assert set(range(1, 11)) - set(losses) <= {2} and losses == {s: ref[s] for s in losses}, (losses, ref)


@pytest.mark.parametrize("last_save", matrix(["at_the_end", "before"], ci=["at_the_end"]))
def test_a_node_lost_at_the_last_step_of_a_plain_loop_ends_the_job_with_status_0(tmp_path, shm_root, last_save):
    """Rank 1 killed right after its optimizer step 10, the loop's last: a plain loop has no end marker, so the
    loss is a failure and the spare takes rank 1, restored to step 10. ``at_the_end``: the survivor was in the
    script's save of step 10, recovers in place, skips the save and ends; the spare's script, resumed at its last
    step, trains one step more, alone. ``before``: no save at step 10, the survivor's script ends at once (before
    the spare's generation, or as it is published). Either way the job's work is done: status 0, the lost node
    named once (launcher/done.py), not a hang until a collective's timeout and "the script's own error". (When the
    loss cut step 10's snapshot short, step 9 is restored and step 10 trained again by both: a plain recovery.)"""
    args = ["--steps", "10", "--save-interval", "5" if last_save == "at_the_end" else "3", "--dataset-size", "32"]
    ref = _ref(tmp_path, args)
    marker = os.path.join(str(tmp_path), "fault.marker")
    losses, events, _ = _dprun(tmp_path, shm_root, "lost", args, env=at_step.harness_env(
        {at_step.ENV: StepFault("kill", 10, 1, marker).render()}))
    restored = {e["restored_version"] for e in events if e.get("event") == "recover"}
    done = [(e["lost"], e["step"]) for e in events if e.get("event") == "lost_after_done"]
    if restored == {9}:  # step 10's snapshot cut short by the loss: both ranks train step 10 again and end together
        assert done == [], events
    else:
        assert restored <= {10} and done == [(["node1"], 10)], events
    assert not [e for e in events if e.get("event") == "stopped"]
    assert set(losses) == set(range(1, 11)) and losses == ref


def test_a_spare_restored_before_the_scripts_first_save_counts_from_the_survivors_loop(tmp_path, shm_root):
    """The script saves every 5 steps; rank 1 killed right after step 3, before any save: no client state was ever
    saved, so the survivor publishes its loop's counters as it recovers (checkpoint_calls.publish_live) and the
    spare's load_checkpoint hands them back moved to the restored step. A spare handed an empty client state counted
    from 0, trained while the survivor saved at step 5, and their collectives no longer matched (a hang until the
    collective timeout, then the job stopped out of spares). Losses bit for bit."""
    args = ["--steps", "10", "--save-interval", "5", "--dataset-size", "32"]
    ref = _ref(tmp_path, args)
    marker = os.path.join(str(tmp_path), "fault.marker")
    losses, events, pids = _dprun(tmp_path, shm_root, "swap", args, env=at_step.harness_env(
        {at_step.ENV: StepFault("kill", 3, 1, marker).render()}))
    spare = [(e["step"], e["moved"]) for e in events if e.get("event") == "continued" and e.get("how") ==
             "load_checkpoint"]
    assert len(spare) == 1 and spare[0][1] == ["step"] and spare[0][0] in (2, 3), spare
    assert set(losses) == set(range(1, 11)) and losses == ref
