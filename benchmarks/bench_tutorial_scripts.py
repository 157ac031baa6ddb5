#!/usr/bin/env python
"""Scripts written as DeepSpeed's tutorials write them, protected by the config section alone: recovery times.

Issue 43 ("Users' own DeepSpeed scripts, unchanged"). The scripts are ``scripts/examples/ds_tutorial_mlm.py`` (a BERT
masked-LM loop: its own shuffled ``DataLoader``, the config dict built in code, ``load_checkpoint`` /
``save_checkpoint`` with the step in ``client_state``) and ``scripts/examples/ds_tutorial_pipe.py`` (a 2-stage
``PipelineModule`` fed by DeepSpeed's own loader, ``train_batch()`` in a plain loop). Neither has a line of
deadpool_ext. 2 ranks; per script and repeat, four jobs, rank 1 (or node 0) SIGKILLed half a step after rank 0 logged
step K:

* ``swap_built``  ``deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1``, the section added (rank 1 held after
                  step 2 until the spare has built its engine ahead, so the kill meets a ready spare): node1.0 killed,
                  the node the spare built its engine for; the survivor redoes the interrupted step inside DeepSpeed's
                  own calls;
* ``swap_other``  the same, node0.0 killed (the spare was not built for it);
* ``restart``     ``torchrun --max-restarts 1 -m deadpool_ext.run``, the section added: torchrun restarts both ranks,
                  the script's own ``load_checkpoint`` returns the newest step from memory;
* ``relaunch``    what the script's user has without the extension: plain torchrun, a checkpoint every step
                  (``--save-interval 1``: the only way to lose at most one step), relaunched at once when it fails;
                  the script's ``load_checkpoint`` reads the disk. At its best: a newest checkpoint the kill cut
                  short (a stage's file still being written) is passed over for the one before (``latest``
                  rewritten, as a careful user's wrapper does), else DeepSpeed's load fails and the job stays down.

Measured: ``raw_s`` kill -> rank 0 completes the step after the one in flight at the kill (its metrics record: the
first step that needs the recovered world, whether or not the dead rank had finished its part of the in-flight one),
``minus_step_s`` that minus two normal steps (the median step of the uninterrupted part); the losses of every step
against an uninterrupted run of the same script without the section, bit for bit.

    python benchmarks/bench_tutorial_scripts.py            # 3 repeats, ~5 min on 2 cores

Writes ``benchmarks/results/tutorial_scripts.json`` and ``.md``, the jobs' logs under ``tutorial_scripts_logs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, add_output_args, machine_info, median, render_only, save_result  # noqa: E402
from recovery_procs import Monitor, read_records, run_logged  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

SCRIPTS = {"mlm": os.path.join(REPO, "scripts", "examples", "ds_tutorial_mlm.py"),
           "pipe": os.path.join(REPO, "scripts", "examples", "ds_tutorial_pipe.py")}
SIZE_ARGS = {"mlm": (), "pipe": ("--hidden", "2048", "--micro-batch", "32", "--dataset-size", "1024")}
"""Each script's size here: steps long enough (~0.1 s) that a kill half a step after a logged step lands inside the
next one on every rank."""
HOLD_STEP = 2
"""Under deadpool-run, rank 1 is held after this step until the spare has built its engine ahead (its spare_ready
event): the kill measures a hot-swap with a ready spare, as a job that has run for more than the spare's start-up."""
KINDS = ("swap_built", "swap_other", "restart", "relaunch")
KILL = {"swap_built": "node1.0", "swap_other": "node0.0", "restart": "1", "relaunch": "1"}


def _section(shm: str, simulate_nodes: int | None) -> str:
    local: dict[str, Any] = {"shm_root": shm}
    if simulate_nodes:
        local["simulate_nodes"] = simulate_nodes
    return json.dumps({"snapshot": {"interval": 1}, "replication": {"factor": 1}, "local": local})


def _args(a: argparse.Namespace, ckpt: str, metrics: str, save_interval: int, name: str) -> list[str]:
    return [*SIZE_ARGS[name], "--steps", str(a.steps), "--save-interval", str(save_interval), "--save-dir", ckpt,
            "--metrics-out", metrics]


def _steps(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's step records with their own time (the gap to the record before; the first has none)."""
    out = []
    prev = None
    for r in recs:
        if "step" not in r:
            continue
        r = dict(r)
        r["step_time_s"] = r["time"] - prev["time"] if prev is not None and r["step"] == prev["step"] + 1 else None
        out.append(r)
        prev = r
    return out


def _release_when_ready(proc: Any, marker: str, timeline: str, deadline: float) -> None:
    """Rank 1 held after step HOLD_STEP (its marker exists) and the spare built ahead: release rank 1."""
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"job ended (rc={proc.poll()}) or deadline passed before the spare was ready")
        ready = False
        if os.path.exists(timeline):
            with open(timeline, errors="replace") as fh:
                ready = any('"spare_ready"' in line for line in fh)
        if ready and os.path.exists(marker):
            break
        time.sleep(0.05)
    with open(marker + ".release", "w"):
        pass


def _kill_when(proc: Any, mon: Monitor, metrics: str, a: argparse.Namespace, label: str, deadline: float
               ) -> dict[str, Any]:
    """SIGKILL worker ``label`` half a normal step after rank 0 logged step K."""
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"job ended (rc={proc.poll()}) or deadline passed before step {a.kill_step}")
        mon.sample()
        recs = _steps(read_records(metrics))
        rec = next((r for r in recs if r["step"] == a.kill_step), None)
        if rec is not None:
            break
        time.sleep(0.02)
    step_s = median([r["step_time_s"] for r in recs if r["step_time_s"] is not None and r["step"] > HOLD_STEP + 1]
                    ) or 0.0
    while time.time() < rec["time"] + 0.5 * step_s:
        mon.sample()
        time.sleep(0.005)
    pid = mon.find(label)
    if pid is None:
        raise RuntimeError(f"no worker {label!r} under pid {proc.pid}")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    return {"t_kill": t_kill, "killed_pid": pid, "normal_step_s": step_s}


def _job(kind: str, name: str, a: argparse.Namespace, scratch: str, tag: str, shm: str) -> Any:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import free_port

    script = SCRIPTS[name]
    metrics = os.path.join(scratch, f"{tag}.jsonl")
    ckpt = os.path.join(scratch, f"{tag}.ckpt")
    if kind.startswith("swap"):
        from deadpool_ext.chaos import at_step
        from deadpool_ext.chaos.at_step import StepFault

        hold = StepFault("hold", HOLD_STEP, 1, os.path.join(scratch, f"{tag}.hold")).render()
        return Job(script=script, nnodes=2, nproc_per_node=1, spare_nodes=1, shm_root=shm,
                   timeline=os.path.join(scratch, f"{tag}.timeline.jsonl"),
                   env_vars=at_step.harness_env({at_step.ENV: hold}), launcher_flags=("--progress-timeout-s", "200"),
                   args=(*_args(a, ckpt, metrics, a.save_interval, name), "--deadpool-section",
                         _section(shm, None))), metrics
    if kind == "restart":
        return Job(launcher="torchrun", script=script, wrap="deadpool_ext.run", nproc_per_node=2, port=free_port(),
                   max_restarts=1, args=(*_args(a, ckpt, metrics, a.save_interval, name), "--deadpool-section",
                                         _section(shm, 2))), metrics
    return Job(launcher="torchrun", script=script, nproc_per_node=2, port=free_port(),
               args=tuple(_args(a, ckpt, metrics, 1, name))), metrics


def run_one(name: str, kind: str, a: argparse.Namespace, scratch: str, logs: str, tag: str) -> dict[str, Any]:
    from deadpool_ext.testing.launch import base_env

    script = SCRIPTS[name]
    shm = os.path.join("/dev/shm", f"bench_tutorial.{os.getpid()}.{tag}")
    os.makedirs(shm, exist_ok=True)
    job, metrics = _job(kind, name, a, scratch, tag, shm)
    label_env = "DEADPOOL_WORKER_ID" if kind.startswith("swap") else "RANK"
    out: dict[str, Any] = {"script": name, "kind": kind, "tag": tag, "cmd": shlex.join(job.argv())}

    def hook(proc: Any, deadline: float) -> None:
        mon = Monitor(proc.pid, label_env, shm if kind.startswith("swap") else None, script=script)
        if kind.startswith("swap"):
            _release_when_ready(proc, os.path.join(scratch, f"{tag}.hold"),
                                os.path.join(scratch, f"{tag}.timeline.jsonl"), deadline)
        out.update(_kill_when(proc, mon, metrics, a, KILL[kind], deadline))

    try:
        res = run_logged(job.argv(), env={**base_env(), **job.env()}, timeout_s=a.timeout_s, hook=hook,
                         log_path=os.path.join(logs, f"{tag}.log"))
        if kind == "relaunch" and "t_kill" in out:  # the user relaunches the same command at once
            # at its best: a newest checkpoint the kill cut short is passed over for the newest complete one
            out["passed_over"] = _newest_complete(os.path.join(scratch, f"{tag}.ckpt"))
            res = run_logged(job.argv(), env={**base_env(), **job.env()}, timeout_s=a.timeout_s,
                             log_path=os.path.join(logs, f"{tag}_again.log"))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    recs = _steps(read_records(metrics))
    out.update(returncode=res["returncode"], records=[{"step": r["step"], "loss": r["loss"], "time": r["time"]}
                                                      for r in recs])
    if "t_kill" not in out or res["returncode"] != 0:
        out["failed"] = res.get("error") or f"rc {res['returncode']}"
        if kind == "relaunch" and "t_kill" in out and _corrupt(os.path.join(logs, f"{tag}_again.log")):
            out["failed"] = ("DeepSpeed could not load its newest checkpoint (being written when the kill came; "
                             "the relaunch stops)")
        return out
    t_kill = out["t_kill"]
    # The step after the one in flight at the kill: the first that needs the recovered world whatever the in-flight
    # step did (the dead rank may have finished its part of it, so rank 0 may still log it after the kill).
    last_pre = max((r["step"] for r in recs if r["time"] <= t_kill), default=0)
    nxt = next((r for r in recs if r["time"] > t_kill and r["step"] >= last_pre + 2), None)
    out.update(last_step_before_kill=last_pre, raw_s=nxt["time"] - t_kill if nxt else None)
    out["minus_step_s"] = out["raw_s"] - 2 * out["normal_step_s"] if out["raw_s"] is not None else None
    return out


def _newest_complete(ckpt: str) -> list[str]:
    """Point DeepSpeed's ``latest`` at the newest tag whose files are all whole (each ``.pt`` a complete zip
    archive, checked by its central directory, nothing loaded) and hold every file name of the oldest tag; the
    tags passed over (newest first). What a careful user's relaunch wrapper does; the baseline at its best."""
    import re
    import zipfile

    tags = sorted((d for d in os.listdir(ckpt) if re.fullmatch(r"global_step\d+", d)) if os.path.isdir(ckpt)
                  else [], key=lambda d: int(d.removeprefix("global_step")), reverse=True)
    if not tags:
        return []
    oldest = set(os.listdir(os.path.join(ckpt, tags[-1])))
    passed: list[str] = []
    for t in tags:
        names = set(os.listdir(os.path.join(ckpt, t)))
        whole = names >= oldest and all(zipfile.is_zipfile(os.path.join(ckpt, t, n)) for n in names
                                        if n.endswith(".pt"))
        if whole:
            if passed:
                with open(os.path.join(ckpt, "latest"), "w") as fh:
                    fh.write(t)
            return passed
        passed.append(t)
    return passed


def _corrupt(log_path: str) -> bool:
    try:
        with open(log_path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return False
    return "PytorchStreamReader failed" in text or "failed finding central directory" in text


def reference(name: str, a: argparse.Namespace, scratch: str, logs: str) -> dict[int, float]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    m = os.path.join(scratch, f"{name}_reference.jsonl")
    job = Job(launcher="torchrun", script=SCRIPTS[name], nproc_per_node=2, port=free_port(),
              args=tuple(_args(a, os.path.join(scratch, f"{name}_ref.ckpt"), m, a.save_interval, name)))
    run_logged(job.argv(), env={**base_env(), **job.env()}, timeout_s=a.timeout_s,
               log_path=os.path.join(logs, f"{name}_reference.log"))
    return {r["step"]: r["loss"] for r in read_records(m)}


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    an: dict[str, Any] = {}
    for name in doc["scripts"]:
        ref = {int(k): v for k, v in doc["reference_losses"][name].items()}
        an[name] = {}
        for kind in KINDS:
            runs = [r for r in doc["runs"] if r["script"] == name and r["kind"] == kind]
            ok = [r for r in runs if not r.get("failed")]
            # the last loss written for each step (a relaunch writes a step again) against the uninterrupted run;
            # a step a restart restored but whose line the killed attempt never wrote is counted apart
            same, unlogged = [], []
            for r in ok:
                last = {x["step"]: x["loss"] for x in r["records"]}
                same.append(all(ref.get(st) == v for st, v in last.items()))
                unlogged.append(sorted(set(ref) - set(last)))
            raws = [r["raw_s"] for r in ok if r.get("raw_s") is not None]
            minus = [r["minus_step_s"] for r in ok if r.get("minus_step_s") is not None]
            an[name][kind] = {"n": len(ok), "failed": len(runs) - len(ok), "raw_s": median(raws),
                              "failed_why": sorted({str(r["failed"]) for r in runs if r.get("failed")}),
                              "raw_min_s": min(raws) if raws else None, "raw_max_s": max(raws) if raws else None,
                              "minus_step_s": median(minus), "normal_step_s": median(
                                  [r["normal_step_s"] for r in ok if r.get("normal_step_s")]),
                              "raw_each_s": raws, "losses_identical": bool(ok) and all(same),
                              "unlogged_steps": unlogged,
                              "passed_over": sum(1 for r in runs if r.get("passed_over"))}
        # relaunch / kind, paired repeat by repeat (the same round of the rotation)
        rel = {r["tag"].rsplit("_r", 1)[1]: r.get("raw_s") for r in doc["runs"]
               if r["script"] == name and r["kind"] == "relaunch" and not r.get("failed")}
        for kind in KINDS[:3]:
            ratios = [rel[r["tag"].rsplit("_r", 1)[1]] / r["raw_s"] for r in doc["runs"]
                      if r["script"] == name and r["kind"] == kind and not r.get("failed") and r.get("raw_s")
                      and rel.get(r["tag"].rsplit("_r", 1)[1])]
            an[name][kind].update(speedup=median(ratios), speedup_min=min(ratios) if ratios else None,
                                  speedup_max=max(ratios) if ratios else None, speedup_pairs=len(ratios))
    return an


def render(doc: dict[str, Any]) -> str:
    an = doc["analysis"]

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    intro = " ".join((__doc__ or "").split("\n\n")[1].split())
    lines = [f"# {doc['title']}", "", f"Measured {doc['date']} at commit `{doc.get('commit', '?')}` with "
             f"`{doc['command']}` ({doc['wall_s']:.0f} s), {doc['repeats']} repeat(s) per job, on "
             f"{doc['machine'].get('cpu_count', '?')} CPUs. {intro}", ""]
    head = ("| script | | hot-swap, spare built for the node | hot-swap, another node | torchrun restart from "
            "memory | relaunch + disk load (no extension) |")
    lines += [head, "|---|---|---|---|---|---|"]
    for name in doc["scripts"]:
        a = an[name]
        lines.append(f"| {name} | kill -> the step after the one in flight, median [min, max] (s) | " + " | ".join(
            f"{f(a[k]['raw_s'])} [{f(a[k]['raw_min_s'])}, {f(a[k]['raw_max_s'])}]" for k in KINDS) + " |")
        lines.append("| | that minus two normal steps (s) | "
                     + " | ".join(f(a[k]["minus_step_s"]) for k in KINDS) + " |")
        lines.append("| | faster than the relaunch, paired by round: median [min, max] | " + " | ".join(
            f"{f(a[k]['speedup'], 1)}x [{f(a[k]['speedup_min'], 1)}, {f(a[k]['speedup_max'], 1)}] "
            f"({a[k]['speedup_pairs']} pair(s))" for k in KINDS[:3]) + " | |")
        lines.append("| | losses bit-identical to the uninterrupted run | " + " | ".join(
            f"{a[k]['losses_identical']} ({a[k]['n']} run(s){_failed(a[k])})" for k in KINDS) + " |")
        lines.append(f"| | relaunches whose newest checkpoint the kill cut short (the one before loaded) | | | | "
                     f"{a['relaunch'].get('passed_over', '-')} of {a['relaunch']['n'] + a['relaunch']['failed']} |")
        lines.append(f"| | normal step (s) | {f(a['swap_built']['normal_step_s'], 3)} | | | "
                     f"{f(a['relaunch']['normal_step_s'], 3)} |")
    lines += ["", "The relaunch restarts both ranks at once on this host (import, engine build, disk load), so it is "
              "slower here than one rank's start-up on a quiet cluster node; the hot-swap's spare was started with "
              "the job. `swap_other` is the expected case where the failed node is not the one the spare built "
              "for: the masked-LM loop's spare relabels its engine in place (issue 44, pure data parallelism); a "
              "pipeline job's spare starts its script again (no relabel across pipeline stages). A relaunch that "
              "saves every step pays for it in every step (the pipeline's normal step above). The relaunch's losses "
              "differ after the kill: without the extension the scripts' loaders start their data again from the "
              "first batch (DeepSpeed's checkpoint holds no data position), so the relaunched run trains on other "
              "batches than the uninterrupted one."]
    return "\n".join(lines) + "\n"


def _failed(cell: dict[str, Any]) -> str:
    out = f", {cell['failed']} failed: {'; '.join(cell['failed_why'])}" if cell["failed"] else ""
    gaps = [u for u in cell["unlogged_steps"] if u]
    if gaps:
        out += f"; step(s) restored but never logged by the killed attempt: {gaps}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill-step", type=int, default=9)
    p.add_argument("--save-interval", type=int, default=4, help="the script's own checkpoint interval (protected "
                   "jobs; the relaunch saves every step)")
    p.add_argument("--scripts", default="mlm,pipe")
    p.add_argument("--timeout-s", type=float, default=300.0)
    add_output_args(p, "tutorial_scripts")
    a = p.parse_args(argv)
    if a.render_only:
        return render_only(a.render_only, render)
    names = [n for n in a.scripts.split(",") if n]
    bad = [n for n in names if n not in SCRIPTS]
    if bad:
        p.error(f"--scripts: unknown {bad}; allowed: {sorted(SCRIPTS)}")
    if a.kill_step < HOLD_STEP + 4 or a.kill_step >= a.steps - 2:
        p.error(f"--kill-step must be >= {HOLD_STEP + 4} and < --steps minus 2")
    import subprocess

    t0 = time.time()
    logs = os.path.join(a.out, f"{a.name}_logs")
    os.makedirs(logs, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_tutorial.")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    doc: dict[str, Any] = {"benchmark": "tutorial_scripts", "title": "DeepSpeed tutorial-style scripts, protected by "
                           "the config section alone: recovery", "date": time.strftime("%Y-%m-%d"), "commit": commit,
                           "command": shlex.join(["python", "benchmarks/bench_tutorial_scripts.py", *sys.argv[1:]]),
                           "machine": machine_info(), "repeats": a.repeats, "scripts": names, "runs": [],
                           "reference_losses": {}}
    total = len(names) * (1 + a.repeats * len(KINDS))
    done = 0
    try:
        for name in names:
            doc["reference_losses"][name] = reference(name, a, scratch, logs)
            done += 1
            for i in range(a.repeats):
                for kind in KINDS[i % 4:] + KINDS[:i % 4]:  # rotated: slow drift of the machine favours no kind
                    tag = f"{name}_{kind}_r{i}"
                    run = run_one(name, kind, a, scratch, logs, tag)
                    doc["runs"].append(run)
                    done += 1
                    el = time.time() - t0
                    print(f"[bench {done}/{total}, ~{el / done * (total - done):.0f} s left] {tag}: "
                          f"raw {run.get('raw_s')} {run.get('failed') or ''}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc["wall_s"] = time.time() - t0
    doc["analysis"] = analyse(doc)
    print(save_result(a.out, a.name, doc, render), flush=True)
    return 0 if all(not r.get("failed") for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
