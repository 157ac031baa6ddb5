"""Existing jobs, unchanged (issue 15): a hand-written DataLoader loop with only the README's lines, and an
unmodified Hugging Face Trainer script, on real torchrun jobs (gloo, 2 CPU ranks, ZeRO-3).

- the own loop survives a SIGKILLed worker under plain ``torchrun --max-restarts 1`` (the process group on the
  attempt-prefixed store, built by the extension itself) with losses identical bit for bit to the same script
  with no ``"deadpool"`` section and no failure;
- the Trainer script attaches through ``python -m deadpool_ext.run`` (snapshots every step, committed), trains
  bit for bit like plain torchrun, and under plain torchrun the section is ignored, as ``deadpool check`` says;
- a runner job whose engine is built without the section named on the command line stops with one line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from deadpool_ext.chaos import at_step
from deadpool_ext.chaos.at_step import StepFault
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import base_env, free_port, read_metrics, run_job, wait_for_step
from tests.conftest import matrix
from tests.integration.helpers import JOB_TIMEOUT_S, KillAt, kill_at, kill_node_agents, worker_proc

pytestmark = pytest.mark.slow
OWN_LOOP = "scripts/examples/own_loop.py"
HF_TRAINER = "scripts/examples/hf_trainer.py"


def _config(tmp_path, shm_root: str | None, base: str = "configs/gpt_tiny_zero3_cpu.json", **over) -> str:
    with open(base) as fh:
        cfg = json.load(fh)
    if shm_root is None:
        cfg.pop("deadpool", None)
    else:
        cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1},
                           "local": {"shm_root": shm_root, "simulate_nodes": 2}, **over}
    path = os.path.join(str(tmp_path), f"ds_{'none' if shm_root is None else 'dp'}_{len(os.listdir(tmp_path))}.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def _job(tmp_path, name: str, script: str, args: list[str], *, runner: bool = False, max_restarts: int = 0,
         inject: KillAt | None = None, wrap: str | None = None):
    """``wrap``: a module that runs the script (the Lightning reference runs' CPU shim), instead of the runner. The
    workers write their timeline events to ``NAME.timeline.jsonl`` (:func:`_events`)."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    env = {"DEADPOOL_TIMELINE": _timeline(tmp_path, name)}
    if inject is not None:
        env.update(inject.env(os.path.join(str(tmp_path), f"{name}.fault")))
    job = Job(launcher="torchrun", script=script, wrap="deadpool_ext.run" if runner else wrap, nproc_per_node=2,
              port=free_port(), max_restarts=max_restarts, args=tuple(args), metrics=metrics, env_vars=env)
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(),
                  while_running=(lambda p: inject(p, metrics)) if inject is not None else None)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_metrics(metrics)


def _timeline(tmp_path, name: str) -> str:
    return os.path.join(str(tmp_path), f"{name}.timeline.jsonl")


def _events(tmp_path, name: str, kind: str) -> list[dict]:
    """The ``kind`` events the job ``name``'s processes wrote (``recovery/timeline.py``), in order."""
    path = _timeline(tmp_path, name)
    return [e for e in read_events(path) if e.get("event") == kind] if os.path.exists(path) else []


def _attached_by(tmp_path, name: str) -> set[str]:
    """The packages whose ``deepspeed.initialize`` call the extension attached to, in job ``name``."""
    return {e["by"].split(".")[0] for e in _events(tmp_path, name, "attached")}


def _finished(res, tag: str) -> bool:
    """The job trained to the end: exit status 0, or - for a reference run under plain torchrun, whose code is not
    under test - its summary printed last (gloo may abort at interpreter exit after that: "terminate called without
    an active exception", seen once in several runs of the plain HF Trainer script)."""
    return res.returncode == 0 or _summary_or_none(res, tag) is not None


def _summary_or_none(res, tag: str) -> dict | None:
    lines = [ln for ln in res.output.splitlines() if ln.startswith(f"[{tag}] summary ")]
    return json.JSONDecoder().raw_decode(lines[-1][len(f"[{tag}] summary "):])[0] if lines else None


def _summary(res, tag: str) -> dict:
    s = _summary_or_none(res, tag)
    assert s is not None, res.output[-3000:]
    return s


def _attempts(tmp_path, name: str) -> list[tuple[str, int]]:
    """(store, attempt) of every process group the workers of job ``name`` built, sorted: under torchrun
    ``agent_attempt_prefixed``, the agent's store under a per-attempt prefix (pytorch/pytorch#135712)."""
    return sorted((e["store"], e["attempt"]) for e in _events(tmp_path, name, "process_group"))


def _plain_then_runner(tmp_path, script: str, tag: str, args: list[str]) -> None:
    """The same script and config (with a section) under plain torchrun, then through the runner: plain ignores
    the section; the runner attaches (through Accelerate), commits a snapshot every step, and trains bit for bit
    like plain (4 steps)."""
    plain, plain_losses = _job(tmp_path, "plain", script, args)
    assert _finished(plain, tag), plain.output[-3000:]
    assert _summary(plain, tag)["deadpool"] is None  # plain torchrun: DeepSpeed dropped the section
    res, losses = _job(tmp_path, "runner", script, args, runner=True)
    assert res.returncode == 0, res.output[-4000:]
    assert _attached_by(tmp_path, "runner") == {"accelerate"}, res.output[-3000:]
    stats = _summary(res, tag)["deadpool"]
    assert stats and stats["committed_version"] == 4, stats
    assert sorted(losses) == [1, 2, 3, 4] and losses == plain_losses


def _same_trajectory(losses: dict, ref: dict, *, killed: int, last: int) -> None:
    """Every logged loss equals the uninterrupted run's, bit for bit (redone steps included), and every step is
    logged but possibly the killed one: the kill fires inside its optimizer step, before the script logs it, and
    if that step's snapshot was already committed the restart continues after it (not redone, never logged)."""
    assert set(range(1, last + 1)) - set(losses) <= {killed}, sorted(losses)
    assert losses == {s: ref[s] for s in losses}


@pytest.mark.full_matrix(covered_by="test_hand_written_loops_survive_a_lost_worker_bit_for_bit[restart-accelerate_loop]"
                                    " (a hand-written loop under torchrun --max-restarts 1, restored from memory, "
                                    "every loss bit for bit, the attempt-prefixed store)")
def test_own_loop_survives_a_torchrun_restart_bit_for_bit(tmp_path, shm_root):
    steps = ["--steps", "10"]
    ref, ref_losses = _job(tmp_path, "ref", OWN_LOOP, ["--deepspeed_config", _config(tmp_path, None), *steps])
    assert ref.returncode == 0, ref.output[-3000:]
    assert sorted(ref_losses) == list(range(1, 11))
    res, losses = _job(tmp_path, "restart", OWN_LOOP, ["--deepspeed_config", _config(tmp_path, shm_root), *steps],
                       max_restarts=1, inject=kill_at(5))
    assert res.returncode == 0, res.output[-4000:]
    s = _summary(res, "own_loop")
    assert s["start_step"] >= 4 and s["deadpool"]["restore"]["outcome"] == "restored", s  # the restart restored
    assert _attempts(tmp_path, "restart") == [("agent_attempt_prefixed", a) for a in (0, 0, 1, 1)]
    _same_trajectory(losses, ref_losses, killed=5, last=10)


@pytest.mark.full_matrix(covered_by="test_hf_trainer_hot_swaps_in_place_bit_for_bit (the unmodified script attached "
                                    "through the runner under deadpool-run, every loss bit for bit with plain "
                                    "torchrun's, the snapshot metrics in the Trainer's log entries) and "
                                    "test_hf_trainer_survives_a_torchrun_restart_bit_for_bit (the runner, torchrun)")
def test_hf_trainer_attaches_through_the_runner_and_trains_bit_for_bit(tmp_path, shm_root):
    args = ["--max-steps", "4", "--output-dir", str(tmp_path / "out")]
    hf_base = "configs/hf_trainer_zero3_cpu.json"
    _plain_then_runner(tmp_path, HF_TRAINER, "hf_trainer", ["--deepspeed", _config(tmp_path, shm_root, hf_base),
                                                             *args])
    with open(tmp_path / "out" / "trainer_state.json") as fh:  # the runner's (it ran second)
        assert json.load(fh)["total_flos"] == _whole_model_flops(4)  # the whole model's FLOPs, every step
    _snapshot_metrics_in_the_trainers_log(os.path.join(str(tmp_path), "runner.jsonl"))


HF_BASE = "configs/hf_trainer_zero3_cpu.json"
HF_STEPS = 8


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The Trainer script under plain torchrun (no section, no failure), once per model build for the module:
    ``reference(zero_init) -> (step -> loss, output dir with its trainer_state.json and train_results.json)``."""
    done: dict[bool, tuple[dict, str]] = {}

    def reference(zero_init: bool) -> tuple[dict, str]:
        if zero_init not in done:
            tmp = tmp_path_factory.mktemp("hf_ref")
            out = str(tmp / "out")
            plain, losses = _job(tmp, "plain", HF_TRAINER, ["--deepspeed", _config(tmp, None, HF_BASE), "--max-steps",
                                                            str(HF_STEPS), "--output-dir", out,
                                                            *(["--zero-init"] if zero_init else [])])
            assert _finished(plain, "hf_trainer"), plain.output[-3000:]
            done[zero_init] = losses, out
        return done[zero_init]

    return reference


def _whole_model_flops(steps: int, *, world: int = 2, grad_accum: int = 2) -> float:
    """HF's FLOP estimate (6 x tokens x non-embedding parameters) over the script's whole model for ``steps`` steps
    of every rank: what ``total_flos`` is in an uninterrupted run under the extension, where a ZeRO-3 parameter
    counts at its full size in every process (``patches/transformers_trainer_flops.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_trainer_example", HF_TRAINER)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from transformers import GPT2LMHeadModel

    params = GPT2LMHeadModel(script.model_config()).num_parameters(exclude_embeddings=True)
    return float(steps * world * grad_accum * 6 * script.BATCH * script.SEQ * params)


def _trainer_bookkeeping_whole(out: str, ref_out: str) -> None:
    """What the Trainer wrote after the recovery equals the uninterrupted run's: trainer_state.json's log_history
    holds every step once with the same entries (loss, grad_norm, learning rate, epoch bit for bit), global_step
    and epoch; train_loss (train_results.json and the final log entry). That no RNG file is looked for (so no false
    warning) is test_attach_hook's. total_flos: exactly the whole model's estimate for every step, as an
    uninterrupted run under the extension counts it (plain torchrun's reference counts less: HF's ZeRO-3 estimate
    counts only the parameters gathered at that moment).
    train_runtime: the training time of the steps that count (README), only checked to be there."""
    def read(d: str) -> tuple[dict, dict]:
        with open(os.path.join(d, "trainer_state.json")) as fh, open(os.path.join(d, "train_results.json")) as fr:
            return json.load(fh), json.load(fr)

    (state, results), (ref_state, ref_results) = read(out), read(ref_out)
    keys = ("step", "loss", "grad_norm", "learning_rate", "epoch")
    entries = [{k: e.get(k) for k in keys} for e in state["log_history"] if "loss" in e]
    ref_entries = [{k: e.get(k) for k in keys} for e in ref_state["log_history"] if "loss" in e]
    assert [e["step"] for e in entries] == list(range(1, HF_STEPS + 1)), entries  # every step, once
    assert entries == ref_entries
    assert (state["global_step"], state["epoch"]) == (ref_state["global_step"], ref_state["epoch"]) == \
        (HF_STEPS, ref_state["epoch"])
    assert results["train_loss"] == ref_results["train_loss"], (results, ref_results)
    assert results["train_runtime"] > 0
    final = [e for e in state["log_history"] if "train_loss" in e]
    assert len(final) == 1 and final[0]["train_loss"] == ref_results["train_loss"], final
    whole = _whole_model_flops(HF_STEPS)
    assert final[0]["total_flos"] == state["total_flos"] == whole, (state["total_flos"], whole)
    assert ref_state["total_flos"] < whole, (ref_state["total_flos"], whole)  # plain HF under ZeRO-3 counts less


def test_hf_trainer_survives_a_torchrun_restart_bit_for_bit(tmp_path, shm_root, hf_reference):
    """Gradient accumulation 2: the Trainer fast-forwards 2 batches per step already done. The model is built as
    standard Trainer scripts build it (from_config: under ZeRO-3 inside zero.Init), with the shipped config. Rank 0
    dies right after its optimizer step 4 (whose snapshot is then never sealed: the Trainer had not posted its
    state of step 4); both ranks restart and restore step 3 from memory, the Trainer's bookkeeping with it."""
    plain_losses, ref_out = hf_reference(True)
    out = str(tmp_path / "out")
    args = ["--max-steps", str(HF_STEPS), "--output-dir", out, "--zero-init"]
    res, losses = _job(tmp_path, "restart", HF_TRAINER, ["--deepspeed", _config(tmp_path, shm_root, HF_BASE), *args],
                       runner=True, max_restarts=1, inject=kill_at(4, rank=0))
    assert res.returncode == 0, res.output[-4000:]
    continued = [(e["framework"], e["how"], e["step"], e["trainer_state"]) for e in _events(tmp_path, "restart",
                                                                                             "continued")]
    assert continued == [("hf_trainer", "restart", 3, "as_uninterrupted")] * 2, continued  # both ranks
    stats = _summary(res, "hf_trainer")["deadpool"]
    assert stats["restore"]["outcome"] == "restored" and stats["restore"]["version"] == 3, stats["restore"]
    _same_trajectory(losses, plain_losses, killed=4, last=HF_STEPS)
    _trainer_bookkeeping_whole(out, ref_out)


def _dprun(tmp_path, shm_root: str, name: str, script: str, args: list[str], *, env: dict | None = None,
           kill_after_step: int | None = None, then=None, launcher_flags: tuple[str, ...] = ()):
    """The script under deadpool-run: 2 nodes of 1 worker and 1 spare; ``env``: a harness's in-process fault;
    ``kill_after_step``: SIGKILL node1.0 from outside once rank 0 logged that step (wherever its step then is);
    ``then(proc, timeline)``: called once the workers' pids are known, while the job runs."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    timeline = os.path.join(str(tmp_path), f"{name}.timeline.jsonl")
    job = Job(script=script, nnodes=2, nproc_per_node=1, spare_nodes=1, shm_root=shm_root, timeline=timeline,
              args=tuple(args), metrics=metrics, env_vars=dict(env or {}), launcher_flags=launcher_flags)
    pids: dict[str, int] = {}

    def watch(proc) -> None:
        for wid in ("node0.0", "node1.0"):
            pids[wid] = worker_proc(proc.pid, wid).pid
        if kill_after_step is not None:
            wait_for_step(metrics, kill_after_step, timeout_s=JOB_TIMEOUT_S, proc=proc)
            worker_proc(proc.pid, "node1.0").send_signal(signal.SIGKILL)
        if then is not None:
            then(proc, timeline)

    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(), while_running=watch)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_metrics(metrics), read_events(timeline) if os.path.exists(timeline) else [], pids


def _swap_fault(tmp_path, after_step: bool, rank: int = 1) -> tuple[dict | None, int | None]:
    """(harness env, kill_after_step) for ``_dprun``: ``rank`` killed in-process right after its optimizer step 4,
    or rank 1 SIGKILLed from outside wherever it is once rank 0 logged step 3."""
    if after_step:
        marker = os.path.join(str(tmp_path), "fault.marker")
        return at_step.harness_env({at_step.ENV: StepFault("kill", 4, rank, marker).render()}), None
    return None, 3


def _hot_swapped_in_place(events, pids, framework: str, *, reused: bool = True, lost: int = 1) -> None:
    """One hot-swap, in place: the survivor kept its process (and its engine) and ``framework`` continued there, in
    place; the spare restored rank ``lost`` (rank r runs on node r). ``reused``: the framework builds its engine
    again through deepspeed.initialize, which returns the recovered one (the HF Trainer does; Lightning's loop runs
    again on the engine it holds)."""
    survivor = pids[f"node{1 - lost}.0"]
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    spares = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert [(e["pid"], e.get("in_place")) for e in survivors] == [(survivor, True)], survivors
    assert [e["rank"] for e in spares] == [lost] and spares[0]["pid"] not in pids.values(), spares
    continued = [(e["pid"], e["framework"], e["how"]) for e in events if e.get("event") == "continued"]
    assert (survivor, framework, "in_place") in continued, continued
    reuse = [e["pid"] for e in events if e.get("event") == "engine_reused"]
    assert reuse == ([survivor] if reused else []), events


@pytest.mark.parametrize("fault", matrix(["after_optimizer_step-rank1", "after_optimizer_step-rank0",
                                          "sigkill_anywhere-rank1"],
                                         ci=["after_optimizer_step-rank0"]))  # rank 1 lost: the loops below
def test_hf_trainer_hot_swaps_in_place_bit_for_bit(tmp_path, shm_root, fault, hf_reference):
    """An unmodified Trainer script (ZeRO-3, gradient accumulation 2) under deadpool-run: rank 1 or rank 0 dies
    (right after its optimizer step 4, or rank 1 SIGKILLed from outside wherever it is after rank 0 logged step 3);
    the survivor keeps its process, engine, optimizer and scheduler, the Trainer's loop is re-entered at the
    restored step, the spare takes the lost rank (rank 0 too: it then writes the Trainer's files), every logged loss
    equals plain torchrun's bit for bit, and the Trainer's bookkeeping is the uninterrupted run's."""
    plain_losses, ref_out = hf_reference(False)
    lost = int(fault[-1])
    out = str(tmp_path / "out")
    args = ["--max-steps", str(HF_STEPS), "--output-dir", out]
    cfg = _config(tmp_path, shm_root, HF_BASE, local={"shm_root": shm_root})
    env, kill = _swap_fault(tmp_path, fault.startswith("after_optimizer_step"), lost)
    res, losses, events, pids = _dprun(tmp_path, shm_root, "swap", HF_TRAINER, ["--deepspeed", cfg, *args], env=env,
                                       kill_after_step=kill)
    assert res.returncode == 0, res.output[-4000:]
    _hot_swapped_in_place(events, pids, "hf_trainer", lost=lost)  # the Trainer's loop re-entered in place
    assigned = [(e["how"], e["built_rank"], e["rank"]) for e in events if e.get("event") == "spare_assigned"]
    # the spare built its engine for node1's rank 1; rank 0 lost: it takes rank 0 with that engine and Accelerate's
    # and the Trainer's copies of the rank relabelled in place (framework_takeover.py), not from its first line
    assert assigned == [("relabel" if lost == 0 else "as_built", 1, lost)], assigned
    kept = [e["trainer_state"] for e in events if e.get("event") == "continued" and e["how"] == "in_place"]
    assert kept == ["as_uninterrupted"], kept  # the Trainer's state as the uninterrupted run had it at that step
    _same_trajectory(losses, plain_losses, killed=4, last=HF_STEPS)
    s = _summary(res, "hf_trainer")
    assert s["global_step"] == HF_STEPS and s["logged_steps"] == list(range(1, HF_STEPS + 1)), s
    _trainer_bookkeeping_whole(out, ref_out)
    _snapshot_metrics_in_the_trainers_log(os.path.join(str(tmp_path), "swap.jsonl"))


def _snapshot_metrics_in_the_trainers_log(path: str) -> None:
    """The snapshot metrics joined the Trainer's own log entries (what log_history and reporting callbacks see)."""
    with open(path) as fh:  # the Trainer's log entries (the example also records when training began)
        entries = [e for e in (json.loads(line) for line in fh if line.strip()) if "loss" in e]
    assert entries and all("deadpool/snapshot_memory_mb" in e for e in entries), entries
    assert all("deadpool/commit_lag_steps" in e for e in entries[1:]), entries  # after the first commit
    assert entries[-1]["deadpool/blocking_ms"] >= 0 and entries[-1]["deadpool/commit_lag_steps"] <= 1, entries[-1]


NO_SECTION = '''
import json, os, sys
import torch, deepspeed
from deadpool_ext.distributed import init_distributed
cfg = json.load(open(sys.argv[sys.argv.index("--deepspeed_config") + 1]))
cfg.pop("deadpool")  # what a framework that rebuilds the config without unknown keys does
model = torch.nn.Linear(4, 4)
deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
open(sys.argv[-1] + f".trained.{os.environ['RANK']}", "w").close()  # only if the engine came back unprotected
'''


def test_runner_refuses_an_engine_built_without_the_section_on_the_command_line(tmp_path, shm_root):
    script = tmp_path / "drops_section.py"
    script.write_text(NO_SECTION)
    cfg = _config(tmp_path, shm_root)
    res, _ = _job(tmp_path, "drops", str(script), ["--deepspeed_config", cfg], runner=True)
    assert res.returncode != 0 and not [p for p in os.listdir(tmp_path) if ".trained." in p]
    refused = [(e["error"], e["built_by"].split(":")[0], e["exit_status"]) for e in _events(tmp_path, "drops",
                                                                                            "refused")]
    assert refused == [("NotAttachedError", "__main__", 2)] * 2, res.output[-3000:]  # each rank, in one line


def test_deadpool_run_names_a_worker_that_exited_on_its_own(tmp_path):
    """A script that fails by itself under deadpool-run: the final line says so (not "out of spares", not --load)."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(1)\n")
    job = Job(script=str(script), nnodes=1, nproc_per_node=1, timeline=_timeline(tmp_path, "fails"))
    res = run_job(job.argv(), timeout_s=120, env=job.env())
    assert res.returncode == 1 and not res.timed_out, res.output[-3000:]
    stopped = [(e["cause"], e["exits"]) for e in _events(tmp_path, "fails", "stopped")]
    assert stopped == [("exited_on_its_own", {"node0.0": 1})], res.output[-3000:]  # its line: final.stop_line


LOSES_A_PEER = '''
import os, signal, sys
import torch, torch.distributed as dist
import deadpool_ext as dp
mode, cfg, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
engine, _, _, _ = dp.initialize(model=model, config=cfg, model_parameters=model.parameters())
data = [torch.randn(4, 8) for _ in range(32)]
for step in dp.resilient_steps(engine, data, max_steps=steps):
    with step as batch:
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
    if mode == "unprotected" and int(engine.global_steps) == 2:
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # the script's own collective, outside the step: its peer is gone
if mode == "after_done" and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # lost after the last step, every step committed
dist.barrier()  # the closing barrier
'''


@pytest.mark.parametrize("mode", matrix(["unprotected", "after_done"], ci=["unprotected"]))
def test_deadpool_run_says_what_a_lost_peer_did(tmp_path, shm_root, mode):
    """Under deadpool-run (2 nodes, 1 spare), rank 1 dies where no step can be redone. ``unprotected``: during the
    script's own barrier after step 2; the spare takes rank 1 and the survivor, whose loop cannot continue, stops
    with LOST_PEER_EXIT, so the job stops for a lost peer in an unprotected loop, never as "the script's own error"
    (run.py unprotected_loss_line, final.stop_cause). ``after_done``: in the closing barrier after every rank
    finished its last step (resilient_steps wrote trained/): the job's work is done, it ends with status 0, the
    lost node named once (decide.py work_done)."""
    script = tmp_path / "loses_a_peer.py"
    script.write_text(LOSES_A_PEER)
    cfg = _config(tmp_path, shm_root, "configs/gpt_tiny_zero3_cpu.json", local={"shm_root": shm_root})
    res, _, events, _ = _dprun(tmp_path, shm_root, mode, str(script), [mode, cfg, "3"])
    kinds = [e.get("event") for e in events]
    if mode == "unprotected":
        assert res.returncode == 1, res.output[-4000:]
        stopped = [(e["cause"], e["exits"]) for e in events if e.get("event") == "stopped"]
        assert stopped == [("unprotected_loop", {"node0.0": 4})], res.output[-4000:]
        losses = [(e["generation"], e["exit_status"]) for e in events if e.get("event") == "unprotected_loss"]
        assert losses == [(0, 4)], res.output[-4000:]
    else:
        assert res.returncode == 0, res.output[-4000:]
        done = [(e["lost"], e["step"]) for e in events if e.get("event") == "lost_after_done"]
        assert done == [(["node1"], 3)], res.output[-4000:]
        assert "stopped" not in kinds and "assignment" not in kinds[kinds.index("lost_after_done"):], kinds


def test_check_names_every_bad_key_and_the_launch_paths(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "deadpool": {
        "snapshot": {"intervall": 2, "background": "yes"}, "replication": {"factor": -1}}}))
    cli = [sys.executable, "-m", "deadpool_ext.cli", "check"]
    r = subprocess.run(cli + [str(bad), "--json"], capture_output=True, text=True, timeout=120, env=base_env())
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and not rep["ok"] and len(rep["problems"]) == 3, rep
    assert rep["bad_keys"] == ["deadpool.snapshot.intervall", "deadpool.snapshot.background",
                               "deadpool.replication.factor"], rep
    good = subprocess.run(cli + ["configs/hf_trainer_zero3_cpu.json", "--json"], capture_output=True, text=True,
                          timeout=120, env=base_env())
    rep = json.loads(good.stdout)
    assert good.returncode == 0 and rep["ok"] and rep["problems"] == []
    honoured = {p["launch"].split(" ")[0]: p["honoured"] for p in rep["launch_paths"]}
    assert honoured == {"deadpool-run": True, "deadpool_ext.deepspeed.initialize(...)": True, "plain": False}
    missing = subprocess.run(cli + [str(tmp_path / "nope.json"), "--json"], capture_output=True, text=True, timeout=60,
                             env=base_env())
    assert missing.returncode == 2 and not missing.stdout  # refused before any report (its line: test_attach_hook)


@pytest.mark.full_matrix(covered_by="test_hand_written_loops_survive_a_lost_worker_bit_for_bit[restart-accelerate_loop]"
                                    " (the same script through the runner, every loss bit for bit)")
def test_accelerate_loop_attaches_through_the_runner_and_trains_bit_for_bit(tmp_path, shm_root):
    script, base = "scripts/examples/accelerate_loop.py", "configs/gpt_tiny_zero3_cpu_noopt.json"
    _plain_then_runner(tmp_path, script, "accelerate_loop", ["--deepspeed", _config(tmp_path, shm_root, base),
                                                              "--steps", "4"])


ACCELERATE = "scripts/examples/accelerate_loop.py"
ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
num_processes: 2
num_machines: 1
machine_rank: 0
use_cpu: false
"""


def _accelerate_launch(tmp_path, name: str, launch: list[str], script_args: list[str], *, env: dict | None = None,
                       inject: KillAt | None = None):
    """``accelerate launch LAUNCH -m deadpool_ext.run accelerate_loop.py`` with no DeepSpeed config on the script's
    command line: Accelerate names it (its YAML, its flag or ACCELERATE_DEEPSPEED_CONFIG_FILE)."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    extra = dict(env or {}, HF_HOME=str(tmp_path / "hf_home"),  # no user's default Accelerate config
                 DEADPOOL_TIMELINE=_timeline(tmp_path, name))
    if inject is not None:
        extra.update(inject.env(os.path.join(str(tmp_path), f"{name}.fault")))
    job = Job(launcher="accelerate", port=free_port(), launcher_flags=tuple(launch), wrap="deadpool_ext.run",
              script=ACCELERATE, args=tuple(script_args), metrics=metrics, env_vars=extra)
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env(),
                  while_running=(lambda p: inject(p, metrics)) if inject is not None else None)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    return res, read_metrics(metrics)


def test_accelerate_launch_config_yaml_attaches_and_survives_a_restart(tmp_path, shm_root):
    """Accelerate's own config path: its YAML names the DeepSpeed config (``deepspeed_config_file``), the script
    passes none (``Accelerator()``). The runner finds the section in what ``accelerate launch`` hands the workers,
    builds the process group on the attempt-prefixed store and the hook attaches through ``accelerator.prepare``;
    rank 1 dies right after its optimizer step 3 and ``--max_restarts 1`` restores both ranks from memory."""
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text(ACCELERATE_YAML.format(ds=_config(tmp_path, shm_root, "configs/gpt_tiny_zero3_cpu_noopt.json")))
    res, losses = _accelerate_launch(tmp_path, "yaml", ["--config_file", str(yaml), "--max_restarts", "1",
                                                        "--monitor_interval", "0.2"], ["--steps", "6"],
                                     inject=kill_at(3))
    assert res.returncode == 0, res.output[-4000:]
    assert _attached_by(tmp_path, "yaml") == {"accelerate"}, res.output[-3000:]
    s = _summary(res, "accelerate_loop")
    assert s["start_step"] >= 2 and s["deadpool"]["restore"]["outcome"] == "restored", s
    assert _attempts(tmp_path, "yaml") == [("agent_attempt_prefixed", a) for a in (0, 0, 1, 1)]
    assert set(range(1, 7)) - set(losses) <= {3}, sorted(losses)
    # the survivor's failed collective before the restart: it stops with one line naming the restart (not a
    # traceback; run.py restart_teardown_line), which knows the restarted job restores (resilient_steps ran)
    stops = [(e["restart"], e["max_restarts"], e["restores"])
             for e in _events(tmp_path, "yaml", "stopped_for_restart")]
    assert stops == [(1, 1, True)], res.output[-4000:]


@pytest.mark.full_matrix(covered_by="test_accelerate_launch_config_yaml_attaches_and_survives_a_restart (accelerate "
                         "launch's other route to the DeepSpeed config: the section found in what it hands the "
                         "workers, attached through accelerator.prepare, a restart) and tests/unit/test_attach_hook.py "
                         "(the no-restore line)")
def test_accelerate_launch_config_from_the_environment_attaches(tmp_path, shm_root):
    """``ACCELERATE_DEEPSPEED_CONFIG_FILE`` set by the user, ``accelerate launch --use_deepspeed`` without a YAML:
    attached through ``accelerator.prepare``, a snapshot committed every step. The loop is the plain one (no
    ``resilient_steps``, no ``resume()``): the extension says once, at the first snapshot, that nothing restores,
    with the line that fixes it. Rank 1 dies after step 2 and ``--max_restarts 1`` restarts the job: the survivor's
    line does not promise a restore from memory (it says the job trains again from step 0), and the restarted
    job's first snapshot names the versions of the first attempt it left unused."""
    cfg = _config(tmp_path, shm_root, "configs/gpt_tiny_zero3_cpu_noopt.json")
    res, losses = _accelerate_launch(tmp_path, "env", ["--use_deepspeed", "--num_processes", "2", "--num_machines",
                                                       "1", "--max_restarts", "1", "--monitor_interval", "0.2"],
                                     ["--steps", "3", "--plain-loop"], env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": cfg},
                                     inject=kill_at(2))
    assert res.returncode == 0, res.output[-4000:]
    assert _attached_by(tmp_path, "env") == {"accelerate"}, res.output[-3000:]
    s = _summary(res, "accelerate_loop")
    assert s["start_step"] == 0 and s["deadpool"]["committed_version"] == 3 and sorted(set(losses)) == [1, 2, 3]
    # the survivor's line before the restart knows that nothing restores (run.py restart_teardown_line)
    stops = [(e["restart"], e["restores"]) for e in _events(tmp_path, "env", "stopped_for_restart")]
    assert stops == [(1, False)], res.output[-4000:]
    # said once per attempt, with its fix (base.py never_restored_lines): a fresh start names nothing of an earlier
    # attempt; the restarted one names what the first left in memory
    never = [e["unused_versions"] for e in _events(tmp_path, "env", "never_restores")]
    assert len(never) == 2 and never[0] == [] and never[1] and max(never[1]) >= 1, never


LOOPS = {  # script, its config, the flags naming the config and the steps, the summary's tag
    "own_loop": (OWN_LOOP, "configs/gpt_tiny_zero3_cpu.json", "--deepspeed_config", "--steps"),
    "accelerate_loop": (ACCELERATE, "configs/gpt_tiny_zero3_cpu_noopt.json", "--deepspeed", "--steps"),
}


@pytest.mark.parametrize("mode,tag", matrix(
    [(m, t) for m in ("hot_swap", "restart") for t in sorted(LOOPS)],
    ci=[("hot_swap", "own_loop"), ("restart", "accelerate_loop")]))
def test_hand_written_loops_survive_a_lost_worker_bit_for_bit(tmp_path, shm_root, tag, mode):
    """A hand-written DeepSpeed loop and an Accelerate loop with ``resilient_steps`` (two lines): rank 1 dies right
    after its optimizer step 4; under deadpool-run the survivor recovers in place (same process, same engine) and
    the spare takes rank 1; under ``torchrun --max-restarts 1`` every worker restarts and restores from memory.
    Either way the loader's next batch is the one an uninterrupted run sees, and every logged loss equals the same
    script's without the section, bit for bit."""
    script, base, cfg_flag, steps_flag = LOOPS[tag]
    steps = [steps_flag, "10"]
    ref, ref_losses = _job(tmp_path, "ref", script, [cfg_flag, _config(tmp_path, None, base), *steps])
    assert _finished(ref, tag), ref.output[-3000:]
    assert sorted(ref_losses) == list(range(1, 11))
    if mode == "hot_swap":
        marker = os.path.join(str(tmp_path), "fault.marker")
        env = at_step.harness_env({at_step.ENV: StepFault("kill", 4, 1, marker).render()})
        cfg = _config(tmp_path, shm_root, base, local={"shm_root": shm_root})
        res, losses, events, pids = _dprun(tmp_path, shm_root, "swap", script, [cfg_flag, cfg, *steps], env=env)
        assert res.returncode == 0, res.output[-4000:]
        survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
        assert [(e["pid"], e.get("in_place")) for e in survivors] == [(pids["node0.0"], True)], survivors
        continued = [(e["pid"], e["framework"], e["how"]) for e in events if e.get("event") == "continued"]
        assert continued == [(pids["node0.0"], "resilient_steps", "in_place")], continued
        assert _summary(res, tag)["swaps"] == 1
    else:
        cfg_args = [cfg_flag, _config(tmp_path, shm_root, base)]
        if tag == "accelerate_loop":  # a config dict built in code: no file for the runner to see before the start
            with open(cfg_args[1]) as fh:
                cfg_args = ["--deepspeed-inline", fh.read()]
        res, losses = _job(tmp_path, "restart", script, [*cfg_args, *steps],
                           runner=tag == "accelerate_loop", max_restarts=1, inject=kill_at(4))
        assert res.returncode == 0, res.output[-4000:]
        s = _summary(res, tag)
        assert s["start_step"] >= 3 and s["deadpool"]["restore"]["outcome"] == "restored", s
        assert _attempts(tmp_path, "restart") == [("agent_attempt_prefixed", a) for a in (0, 0, 1, 1)]
        events = read_events(_timeline(tmp_path, "restart"))
    # the loader's position came back with the restored step, on both ranks of the new generation or attempt
    positioned = [e for e in events if e.get("event") == "data_position"]
    assert len(positioned) == 2 and len({e["step"] for e in positioned}) == 1, positioned
    _same_trajectory(losses, ref_losses, killed=4, last=10)


@pytest.mark.full_matrix(covered_by="test_memory_tiers::test_relaunch_under_the_deepspeed_launcher_restores_"
                                    "from_memory (the same relaunch path) and "
                                    "test_own_loop_survives_a_torchrun_restart_bit_for_bit")
def test_own_loop_survives_a_relaunch_under_the_deepspeed_launcher(tmp_path, shm_root):
    """DeepSpeed's launcher ends the job when a worker dies and never restarts it; relaunching the same command
    with ``local.keep_after_exit_s`` (the node agent keeps tier 1 meanwhile) restores the own loop from memory: the
    process group on the launcher's variables, the data position from the snapshot, losses bit-identical."""
    steps = ["--steps", "10"]
    ref, ref_losses = _job(tmp_path, "ref", OWN_LOOP, ["--deepspeed_config", _config(tmp_path, None), *steps])
    assert _finished(ref, "own_loop"), ref.output[-3000:]
    cfg = _config(tmp_path, shm_root, local={"shm_root": shm_root, "keep_after_exit_s": 120, "simulate_nodes": 2})
    metrics = os.path.join(str(tmp_path), "relaunch.jsonl")
    job = Job(launcher="deepspeed", script=OWN_LOOP, nproc_per_node=2, port=free_port(), config=cfg,
              args=tuple(steps), metrics=metrics,
              env_vars={**at_step.harness_env({at_step.ENV: StepFault("kill", 4, 1, os.path.join(
                  str(tmp_path), "ds.fault")).render()}), "DEADPOOL_TIMELINE": _timeline(tmp_path, "relaunch")})
    cmd, env = job.argv(), job.env()
    try:
        first = run_job(cmd, timeout_s=JOB_TIMEOUT_S, env=env)
        assert first.returncode != 0 and not first.timed_out, first.output[-3000:]
        second = run_job(cmd, timeout_s=JOB_TIMEOUT_S, env=env)  # the fault fires once (its marker exists)
        assert second.returncode == 0, second.output[-4000:]
        s = _summary(second, "own_loop")
        assert s["start_step"] >= 3 and s["deadpool"]["restore"]["outcome"] == "restored", s
        positioned = {e["step"] for e in _events(tmp_path, "relaunch", "data_position")}
        assert positioned == {s["start_step"]}, positioned  # the loader's position of the restored step
        _same_trajectory(read_metrics(metrics), ref_losses, killed=4, last=10)
    finally:  # the agents would otherwise hold the memory for the whole window after the test
        kill_node_agents(shm_root)


def test_snapshot_metrics_go_through_deepspeeds_monitor(tmp_path, shm_root):
    cfg_path = _config(tmp_path, shm_root)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "own"}
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    res, _ = _job(tmp_path, "monitor", OWN_LOOP, ["--deepspeed_config", cfg_path, "--steps", "4"])
    assert res.returncode == 0, res.output[-3000:]
    d = tmp_path / "csv" / "own"
    files = sorted(p.name for p in d.iterdir())
    for name in ("Deadpool_blocking_ms.csv", "Deadpool_commit_lag_steps.csv", "Deadpool_snapshot_mb.csv",
                 "Deadpool_snapshot_memory_mb.csv"):
        assert name in files, files
    rows = (d / "Deadpool_commit_lag_steps.csv").read_text().splitlines()
    # a header, then one row per optimizer step from the first commit seen on (step 1 when the snapshot worker
    # committed step 1 before the monitor wrote it, else step 2) to step 4, x = global_samples (8 a step)
    samples = [int(r.split(",")[0]) for r in rows[1:]]
    assert rows[0].split(",")[0] == "step" and samples in ([8, 16, 24, 32], [16, 24, 32]), rows
    assert all(0 <= float(r.split(",")[1]) <= 2 for r in rows[1:]), rows


LIGHTNING = "scripts/examples/lightning_fit.py"
LIGHTNING_BASE = "configs/lightning_zero3_cpu.json"
LIGHTNING_ARGS = ["--max-steps", "8", "--samples", "24"]  # 6 batches, 3 steps an epoch: the run crosses 2 epochs
LIGHTNING_CPU = "deadpool_ext.testing.lightning_cpu"  # the reference: Lightning's DeepSpeed on CPU, no extension


def _rows(tmp_path, name: str) -> list[dict]:
    with open(os.path.join(str(tmp_path), f"{name}.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory):
    """The Lightning script without the extension (Lightning's DeepSpeed on CPU only), once for the module:
    (step -> loss, rows of the metrics file)."""
    tmp = tmp_path_factory.mktemp("lightning_ref")
    ref, ref_losses = _job(tmp, "ref", LIGHTNING, ["--deepspeed", _config(tmp, None, LIGHTNING_BASE), *LIGHTNING_ARGS],
                           wrap=LIGHTNING_CPU)
    assert _finished(ref, "lightning_fit"), ref.output[-3000:]
    assert sorted(ref_losses) == list(range(1, 9))
    return ref_losses, _rows(tmp, "ref")


@pytest.mark.parametrize("mode", matrix(["hot_swap_after_step", "hot_swap_rank0", "hot_swap_sigkill_anywhere",
                                         "restart"], ci=["hot_swap_rank0"]))
def test_lightning_survives_a_lost_worker_bit_for_bit(tmp_path, shm_root, mode, lightning_reference):
    """An unmodified Lightning script (``DeepSpeedStrategy`` ZeRO-3, gradient accumulation 2, a DeepSpeed scheduler
    that Lightning steps itself, a shuffled loader whose epochs end during the run): rank 1 dies (right after its
    optimizer step 4, or SIGKILLed from outside wherever it is once rank 0 logged step 3). Under deadpool-run the
    survivor keeps its process and engine and its fit loop runs again from the restored step, the spare takes
    rank 1; under ``torchrun --max-restarts 1 -m deadpool_ext.run`` both restart and restore from memory. Every
    logged loss (epoch and batch index too) equals the same script's without the extension, bit for bit.
    ``hot_swap_rank0``: rank 0 dies after its step 4 instead, and the spare, built for node1's rank 1, takes rank 0
    in place with Lightning's copies of the rank relabelled (``framework_takeover.py``): it then writes Lightning's
    rank-zero output. (``hot_swap_after_step`` and ``*_sigkill_anywhere`` run with DEADPOOL_FULL_MATRIX=1; the HF
    Trainer's test covers that fault in CI.)"""
    ref_losses, ref_rows = lightning_reference
    if mode == "restart":
        res, losses = _job(tmp_path, "restart", LIGHTNING, ["--deepspeed", _config(tmp_path, shm_root, LIGHTNING_BASE),
                                                            *LIGHTNING_ARGS],
                           runner=True, max_restarts=1, inject=kill_at(4))
        assert res.returncode == 0, res.output[-4000:]
        continued = {(e["framework"], e["how"], e["step"]) for e in _events(tmp_path, "restart", "continued")}
        stats = _summary(res, "lightning_fit")["deadpool"]
        assert continued == {("lightning", "restart", stats["restore"]["version"])}, continued
        assert stats["restore"]["outcome"] == "restored" and stats["restore"]["version"] >= 3, stats["restore"]
        rows = _rows(tmp_path, "restart")
    else:
        cfg = _config(tmp_path, shm_root, LIGHTNING_BASE, local={"shm_root": shm_root})
        lost = 0 if mode == "hot_swap_rank0" else 1
        env, kill = _swap_fault(tmp_path, mode != "hot_swap_sigkill_anywhere", lost)
        res, losses, events, pids = _dprun(tmp_path, shm_root, "swap", LIGHTNING, ["--deepspeed", cfg,
                                                                                  *LIGHTNING_ARGS],
                                           env=env, kill_after_step=kill)
        assert res.returncode == 0, res.output[-4000:]
        _hot_swapped_in_place(events, pids, "lightning", reused=False, lost=lost)  # the fit loop ran again in place
        assigned = [(e["how"], e["built_rank"], e["rank"]) for e in events if e.get("event") == "spare_assigned"]
        assert assigned == [("relabel" if lost == 0 else "as_built", 1, lost)], assigned
        started = [e["malloc_arena_max"] for e in events if e.get("event") == "start"]
        assert started == ["2"], started  # --malloc-arena-max: bounded heap arenas, survivors' memory not growing
        rows = _rows(tmp_path, "swap")
    _same_trajectory(losses, ref_losses, killed=4, last=8)
    assert _summary(res, "lightning_fit")["global_step"] == 8
    where = {r["step"]: (r["epoch"], r["batch_idx"]) for r in ref_rows}
    assert all(where[r["step"]] == (r["epoch"], r["batch_idx"]) for r in rows), rows
