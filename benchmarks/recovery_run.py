"""bench_recovery, the jobs: settings per model size, and one hot-swap, baseline or reference job each.

* ``run_hotswap``: ``deadpool-run`` with a spare; SIGKILL of one worker after step K; timeline phases and
  milestones of the recovery.
* ``run_baseline``: ``torchrun`` with a DeepSpeed checkpoint every step; SIGKILL of one rank once checkpoint K is
  committed; immediate relaunch with ``--load``; breakdown of detect / relaunch / start-up and load / first step.
* ``run_reference``: the baseline command without checkpoints or faults (the uninterrupted loss trajectory).

Each returns one run's record (what goes into the results JSON, plus the raw output lines). Process handling is
in ``recovery_procs.py``; turning runs into numbers in ``recovery_analyse.py``. Split out of the single-file
``bench_recovery.py`` without changing what it does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from outside benchmarks/: common.py and recovery_procs.py live beside this file
    sys.path.insert(0, HERE)
from common import REPO, busy_fraction, write_text  # noqa: E402
from recovery_procs import (  # noqa: E402
    Monitor,
    _fresh,
    append_event,
    normal_step_s,
    read_records,
    remove_files,
    run_logged,
    settle,
    steady_step_s,
    wait_and_kill,
    watch_recovery,
)

BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
SCRIPT = os.path.join(REPO, "scripts", "pretrain_gpt.py")
NNODES, NPROC_PER_NODE, SPARE_NODES = 3, 1, 1
KILL_WORKER, KILL_RANK = "node1.0", 1
UNREADY_WORKER = "node2.0"
"""The ``unready`` runs kill this one instead: the spare built its engine ahead for node1's ranks (the node after
the first, ``cluster/membership.py`` ``shadowed_node``), so here it starts again for node2's (the fallback)."""

# Per size: micro-batch per rank, kill after step K, steps trained after K (N = K + steps_after), repeats, deadline
# of one job. ``zero``: overrides of the ZeRO section (medium: smaller buckets, as bench_snapshot_overhead.py, so
# 3 ranks + a spare + snapshot memory fit in 24 GiB; memory only, same math).
DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"micro_batch": 4, "kill_step": 3, "steps_after": 3, "repeats": 1, "timeout_s": 300, "zero": {}},
    "small": {"micro_batch": 2, "kill_step": 3, "steps_after": 3, "repeats": 2, "timeout_s": 600, "zero": {}},
    "medium": {"micro_batch": 1, "kill_step": 3, "steps_after": 2, "repeats": 1, "timeout_s": 1200,
               "zero": {"reduce_bucket_size": 50_000_000, "stage3_max_live_parameters": 100_000_000},
               # glibc malloc with a fixed mmap threshold and 2 arenas, in both jobs (fair): freed activation and
               # gather buffers go back to the OS instead of fragmenting the heap. Measured 2026-11-29, 3 ranks,
               # 3 steps: plain ZeRO-3 medium 4.7-5.0 GB RSS per rank with glibc's defaults, 3.35 GB with these,
               # same losses. With snapshots (2.78 GB shared memory per rank) 6.0 GB per rank instead of the
               # 7.2-7.4 GB of the trial in results/archive/recovery_medium_trial.json, where hot-swap did not fit.
               "env": {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}},
}
READY_RE = re.compile(r"\[pretrain_gpt\] \S+: .*steps (\d+)->(\d+)")
# Output lines whose arrival time (seconds after the kill) is recorded: a finer view of where recovery time goes
# than the timeline alone (the spare writes no event between its assignment and its restore). DeepSpeed prints the
# first line when a process loads its CPU communication op inside deepspeed.initialize; the second once per rank
# when the new engine's LR scheduler is first read (the engine is built).
MILESTONES = {
    "comm_op_loaded": "deepspeed_shm_comm_op built successfully",
    "engine_built": "Attempting to get learning rate from scheduler",
    "deadpool_attached": "deadpool_ext attached to DeepSpeed engine",
    "restore_plan": "restoring step",
    "first_pretrain_line": "[pretrain_gpt] ",
}


def latest_tag_step(ckpt_dir: str) -> int:
    try:
        with open(os.path.join(ckpt_dir, "latest")) as fh:
            m = re.search(r"(\d+)$", fh.read().strip())
        return int(m.group(1)) if m else -1
    except OSError:
        return -1


def milestones(lines: list[tuple[float, str]], t0: float) -> dict[str, list[float]]:
    """Arrival times (seconds after ``t0``) of the MILESTONES lines that arrived after ``t0``; a line holding a
    pattern twice (two processes' output run together) counts twice."""
    out: dict[str, list[float]] = {k: [] for k in MILESTONES}
    for t, line in lines:
        if t < t0:
            continue
        for key, pat in MILESTONES.items():
            out[key] += [round(t - t0, 3)] * line.count(pat)
    out["first_pretrain_line"] = out["first_pretrain_line"][:1]
    return out


def write_config(path: str, size: str, d: dict[str, Any], shm_root: str | None) -> dict[str, Any]:
    with open(BASE_CONFIG) as fh:
        cfg = json.load(fh)
    cfg["train_micro_batch_size_per_gpu"] = d["micro_batch"]
    cfg["gradient_accumulation_steps"] = 1
    cfg["zero_optimization"].update(d["zero"])
    cfg.pop("deadpool", None)
    if shm_root is not None:
        cfg["deadpool"] = {"enabled": True, "snapshot": {"interval": 1}, "replication": {"factor": 1},
                           "local": {"shm_root": shm_root}}
        for key, value in d.get("deadpool", {}).items():  # per-benchmark overrides (bench_inplace_swap's mode)
            if isinstance(value, dict):
                cfg["deadpool"].setdefault(key, {}).update(value)
            else:  # a top-level key of the section, e.g. log_level
                cfg["deadpool"][key] = value
    write_text(path, json.dumps(cfg, indent=2))
    return cfg


def _effective(section: dict[str, Any]) -> dict[str, Any]:
    """The section as the job resolves it: every key, defaults included (a headline names what it ran under)."""
    from deadpool_ext.config import DeadpoolConfig

    return DeadpoolConfig.from_dict(section).to_dict()


def script_args(size: str, cfg: str, n: int, metrics: str, seed: int) -> list[str]:
    return ["--deepspeed_config", cfg, "--model-size", size, "--train-iters", str(n), "--metrics-out", metrics,
            "--seed", str(seed), "--log-interval", "1"]


def _monitor(root_pid: int, label_env: str, args: argparse.Namespace, shm_root: str | None = None) -> Monitor:
    """A Monitor of this benchmark's workers (they run SCRIPT), with the memory guard of ``--min-available-gib``."""
    return Monitor(root_pid, label_env, shm_root, script=SCRIPT,
                   min_available_bytes=int(args.min_available_gib * 2**30))


def run_hotswap(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                logs: str) -> dict[str, Any]:
    from deadpool_ext.recovery.timeline import phases, read_events
    from deadpool_ext.testing.jobs import DEADPOOL_RUN, Job
    from deadpool_ext.testing.launch import base_env

    k, n = d["kill_step"], d["kill_step"] + d["steps_after"]
    shm_root = os.path.join("/dev/shm", f"bench_recovery.{os.getpid()}.{tag}")
    os.makedirs(shm_root, exist_ok=True)
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    section = write_config(cfg_path, size, d, shm_root)["deadpool"]
    metrics, timeline = os.path.join(scratch, f"{tag}.metrics.jsonl"), os.path.join(scratch, f"{tag}.timeline.jsonl")
    _fresh(metrics, timeline)
    job = Job(script=SCRIPT, nnodes=NNODES, nproc_per_node=NPROC_PER_NODE, spare_nodes=SPARE_NODES, shm_root=shm_root,
              timeline=timeline, launcher_flags=tuple(d.get("launcher_flags", ())),
              args=tuple(script_args(size, cfg_path, n, metrics, args.seed)))
    cmd = job.argv()
    out: dict[str, Any] = {"kind": "hotswap", "tag": tag,
                           "cmd": shlex.join(["deadpool-run"] + cmd[len(DEADPOOL_RUN):]),
                           "train_iters": n, "kill_step": k, "settle": settle(args.settle_s, args.settle_busy),
                           "deadpool_config_effective": _effective(section)}
    mon_box: dict[str, Monitor] = {}

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mon = mon_box["m"] = _monitor(proc.pid, "DEADPOOL_WORKER_ID", args, shm_root)
        victim = d.get("kill_worker", KILL_WORKER)
        kill = wait_and_kill(proc, deadline, mon, metrics, k, args.kill_delay_frac, victim)
        append_event(timeline, {"event": "fault", "time": kill["t_kill"], "generation": 0, "source": "injector",
                                "pid": kill["killed_pid"], "worker": victim})
        out["fault"] = kill
        print(f"[bench]   hotswap: SIGKILLed {victim} (pid {kill['killed_pid']}) "
              f"{kill['kill_delay_s']:.2f} s after step {k}", flush=True)
        out["hung"] = watch_recovery(proc, deadline, mon, metrics, kill["t_kill"], args.recovery_timeout_s)

    print(f"[bench] {size} {tag}: {out['cmd']}", flush=True)
    try:
        job = run_logged(cmd, env=base_env(d.get("env")), timeout_s=d["timeout_s"], hook=hook,
                         log_path=os.path.join(logs, f"{size}_{tag}.log"))
    finally:
        mon = mon_box.get("m")
        out["memory"] = mon.summary() if mon else None
        out["removed_ds_shm_files"] = remove_files(mon.ds_shm) if mon else 0
        shutil.rmtree(shm_root, ignore_errors=True)
    out.update({k_: job[k_] for k_ in ("returncode", "timed_out", "error", "log")})
    out["wall_s"] = job["end"] - job["start"]
    recs = read_records(metrics)
    out["records"] = recs
    out["timeline"] = read_events(timeline) if os.path.exists(timeline) else []
    if "fault" not in out:
        out["failed"] = (mon.low_memory if mon is not None and mon.low_memory else
                         f"no fault injected: {job['error'] or 'job ended early'} (rc {job['returncode']})")
        return out
    t_kill = out["fault"]["t_kill"]
    out["events"] = hotswap_event_details(out["timeline"], t_kill)
    noticed = out["events"].get("survivor_noticed_first")
    m = measure_after_kill(recs, recs, t_kill, k, t_kill + noticed if noticed is not None else None)
    out.update(m)
    ph = [p for p in phases(out["timeline"]) if p["generation"] == 1]
    out["phases"] = ph[0] if ph else None
    out["log_milestones"] = milestones(job["lines"], t_kill)
    if mon is not None and m.get("first_after"):
        out["busy_fraction_recovery"] = mon.busy_between(t_kill, m["first_after"]["time"])
    if mon is not None:
        out["rss_before_kill"] = mon.rss_at(t_kill)
        out["rss_max_after_kill"] = mon.rss_max_after(t_kill)
        out["rss_end"] = rss_end([[t, r] for t, r in mon.series])
    if mon is not None and mon.low_memory:
        out["failed"] = mon.low_memory
        return out
    if out.get("hung"):
        out["failed"] = (f"recovery hung: no step completed for {args.recovery_timeout_s:.0f} s after the kill "
                         f"(all workers' stacks dumped to {out['log']})")
    elif out["returncode"] != 0:
        out["failed"] = f"job exited rc={out['returncode']}{' (timed out)' if out['timed_out'] else ''}"
    elif not out["phases"]:
        out["failed"] = "the kill led to no recovery in the timeline (wrong process killed?)"
    elif not m.get("first_after"):
        out["failed"] = "no step completed after the kill"
    return out


def rss_end(series: list[list[Any]], min_workers: int = NNODES * NPROC_PER_NODE) -> dict[str, int]:
    """RSS per worker at the last sample that still saw a whole world of workers (before they began to exit)."""
    return next((dict(r) for _, r in reversed(series) if len([v for v in r.values() if v > 0]) >= min_workers), {})


def hotswap_event_details(events: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
    """Finer points of the hot-swap timeline, seconds after the kill."""
    rel = lambda t: None if t is None else t - t_kill  # noqa: E731
    fail = next((e for e in events if e.get("event") == "failure" and e.get("generation") == 0), None)
    assign = next((e for e in events if e.get("event") == "assignment" and e.get("generation") == 1), None)
    surv = [e for e in events
            if e.get("event") == "recover" and e.get("role") == "survivor" and e.get("generation") == 1]
    spare = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare" and e.get("generation") == 1]
    caught = [e for e in events if e.get("event") == "caught_up" and e.get("generation") == 1]
    mx = lambda xs: max(xs) if xs else None  # noqa: E731
    mn = lambda xs: min(xs) if xs else None  # noqa: E731
    return {
        "launcher_detected": rel(fail["detected_at"]) if fail else None,
        "assignment_published": rel(assign["published_at"]) if assign else None,
        "survivor_noticed_first": rel(mn([e["noticed_at"] for e in surv])),
        "survivor_noticed_last": rel(mx([e["noticed_at"] for e in surv])),
        "survivor_assigned_last": rel(mx([e["assigned_at"] for e in surv])),
        "survivor_pg_ready_last": rel(mx([e["pg_ready_at"] for e in surv])),
        "survivor_engine_ready_last": rel(mx([e["engine_ready_at"] for e in surv])),
        "survivor_restored_last": rel(mx([e["restored_at"] for e in surv])),
        "spare_restored": rel(mx([e["restored_at"] for e in spare])),
        "spare_restore_call_s": mx([e.get("restore_s") for e in spare if e.get("restore_s") is not None]),
        "spare_restored_from": [e.get("restored_from") for e in spare],
        "caught_up_last": rel(mx([e["time"] for e in caught])),
        "failed_step": mx([e.get("failed_step") for e in surv if e.get("failed_step") is not None]),
        "restored_version": mx([e.get("restored_version") or 0 for e in surv + spare]),
        "recomputed_steps_reported": mx([e.get("recomputed_steps") for e in caught
                                         if e.get("recomputed_steps") is not None]),
    }


def measure_after_kill(pre_recs: list[dict[str, Any]], post_recs: list[dict[str, Any]], t_kill: float,
                       k: int, t_fail: float | None = None) -> dict[str, Any]:
    """``t_fail``: when the survivors saw the failure (hot-swap). A step whose record lands between the kill and
    that moment completed without the killed rank's further help (it had already sent its part): it counts as
    completed before the failure, and the step to wait for is the next one."""
    pre = [r for r in pre_recs if r["time"] <= max(t_kill, t_fail or t_kill)]
    last_pre = max((r["step"] for r in pre), default=0)
    first_after = next((r for r in post_recs if r["time"] > t_kill and r["step"] > last_pre), None)
    out: dict[str, Any] = {"last_step_before_kill": last_pre, "normal_step_s": normal_step_s(pre_recs, k),
                           "first_after": first_after}
    if first_after is None:
        return out
    if post_recs is pre_recs:  # the same job went on (hot-swap): every step but 1 and the redone one
        step_s = steady_step_s(pre_recs, {first_after["step"]})
    else:  # a relaunch: the first job's steps 2..K, then the relaunched job's after its first (the redo)
        step_s = steady_step_s([r for r in pre_recs if r["step"] <= k], set(), after=post_recs)
    out["normal_step_s"] = step_s
    raw = first_after["time"] - t_kill
    later = [r for r in post_recs if r["time"] > first_after["time"]]
    out.update({"raw_s": raw, "minus_step_s": raw - step_s if step_s is not None else None,
                "first_any_after": next((r for r in post_recs if r["time"] > t_kill), None),
                "step_time_after_s": [r["step_time_s"] for r in later],
                "first_step_time_after_s": first_after["step_time_s"]})
    return out


def run_baseline(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                 logs: str) -> dict[str, Any]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    k, n = d["kill_step"], d["kill_step"] + d["steps_after"]
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, None)
    ckpt = os.path.join(scratch, f"{tag}.ckpt")
    m1, m2 = os.path.join(scratch, f"{tag}.metrics1.jsonl"), os.path.join(scratch, f"{tag}.metrics2.jsonl")
    _fresh(ckpt, m1, m2)
    save = ["--save", ckpt, "--save-interval", "1"]
    cmd1 = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=NNODES * NPROC_PER_NODE, port=free_port(),
               args=tuple(script_args(size, cfg_path, n, m1, args.seed) + save)).argv()
    out: dict[str, Any] = {"kind": "baseline", "tag": tag, "cmd": shlex.join(cmd1), "train_iters": n, "kill_step": k,
                           "settle": settle(args.settle_s, args.settle_busy)}
    env = base_env(d.get("env"))
    mons: dict[str, Monitor] = {}

    def hook1(proc: subprocess.Popen, deadline: float) -> None:
        mon = mons["1"] = _monitor(proc.pid, "RANK", args)
        kill = wait_and_kill(proc, deadline, mon, m1, k, args.kill_delay_frac, f"{KILL_RANK}",
                             ready=lambda: latest_tag_step(ckpt) >= k)
        kill["checkpoint_latest_at_kill"] = latest_tag_step(ckpt)
        out["fault"] = kill
        while proc.poll() is None and time.time() < min(deadline, kill["t_kill"] + args.detect_wait_s):
            time.sleep(0.02)
        kill["t_exit"] = time.time() if proc.poll() is not None else None
        print(f"[bench]   baseline: SIGKILLed rank {KILL_RANK} (pid {kill['killed_pid']}) {kill['kill_delay_s']:.2f} s "
              f"after step {k}; torchrun exited "
              f"{'after %.2f s' % (kill['t_exit'] - kill['t_kill']) if kill['t_exit'] else 'NOT (killed)'}", flush=True)

    print(f"[bench] {size} {tag}: {out['cmd']}", flush=True)
    try:
        job1 = run_logged(cmd1, env=env, timeout_s=d["timeout_s"], hook=hook1,
                          log_path=os.path.join(logs, f"{size}_{tag}_1.log"))
        out["job1"] = {k_: job1[k_] for k_ in ("returncode", "timed_out", "error", "log")}
        if "fault" not in out:
            low = mons["1"].low_memory if "1" in mons else None
            out["failed"] = low or f"no fault injected: {job1['error'] or 'job ended early'} (rc {job1['returncode']})"
            return out
        # Relaunch at once: the same command, a fresh port, resuming from the newest checkpoint.
        cmd2 = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=NNODES * NPROC_PER_NODE, port=free_port(),
                   args=tuple(script_args(size, cfg_path, n, m2, args.seed) + save + ["--load", ckpt])).argv()
        out["relaunch_cmd"] = shlex.join(cmd2)

        def hook2(proc: subprocess.Popen, deadline: float) -> None:
            mon = mons["2"] = _monitor(proc.pid, "RANK", args)
            out["hung"] = watch_recovery(proc, deadline, mon, m2, out["fault"]["t_kill"], args.recovery_timeout_s)

        job2 = run_logged(cmd2, env=env, timeout_s=d["timeout_s"], hook=hook2,
                          log_path=os.path.join(logs, f"{size}_{tag}_2.log"))
        out["job2"] = {k_: job2[k_] for k_ in ("returncode", "timed_out", "error", "log")}
    finally:
        for mon in mons.values():
            out["removed_ds_shm_files"] = out.get("removed_ds_shm_files", 0) + remove_files(mon.ds_shm)
        if not args.keep_scratch:
            shutil.rmtree(ckpt, ignore_errors=True)
    out["memory"] = {key: mon.summary() for key, mon in mons.items()}
    recs1, recs2 = read_records(m1), read_records(m2)
    out["records1"], out["records2"] = recs1, recs2
    out["wall_s"] = job2["end"] - job1["start"]
    t_kill = out["fault"]["t_kill"]
    m = measure_after_kill(recs1, recs2, t_kill, k)
    out.update(m)
    ready = next(((t, mt) for t, line in job2["lines"] if (mt := READY_RE.search(line))), None)
    t_exit = out["fault"].get("t_exit")
    out["loaded_step"] = int(ready[1].group(1)) if ready else None
    out["log_milestones"] = milestones(job2["lines"], job2["start"])
    fa = m.get("first_after")
    out["breakdown"] = {
        "detect_s": (t_exit - t_kill) if t_exit else None,
        "relaunch_s": job2["start"] - (t_exit or t_kill),
        "startup_and_load_s": (ready[0] - job2["start"]) if ready else None,
        "first_step_s": (fa["time"] - ready[0]) if ready and fa else None,
        "total_s": m.get("raw_s"),
    }
    if "2" in mons and fa:
        out["busy_fraction_recovery"] = busy_between_runs(mons, t_kill, fa["time"])
    low = [m_.low_memory for m_ in mons.values() if m_.low_memory]
    if low:
        out["failed"] = low[0]
        return out
    if out.get("hung"):
        out["failed"] = f"relaunched job made no step within {args.recovery_timeout_s:.0f} s of the kill"
    elif job2["returncode"] != 0:
        out["failed"] = f"relaunched job exited rc={job2['returncode']}{' (timed out)' if job2['timed_out'] else ''}"
    elif not fa:
        out["failed"] = "no step completed after the relaunch"
    return out


def run_solo(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
             logs: str) -> dict[str, Any]:
    """The relaunch's floor (issue 44's conservative baseline): one rank of the job alone on a quiet host
    (``torchrun --nproc-per-node 1``, the same script, model and config), from the launch to the script's ready
    line (its engine built, training about to start), loading nothing. The relaunch + load measured beside it
    restarts every rank at once on this host; no relaunch of any rank, anywhere, can be faster than this."""
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, None)
    metrics = os.path.join(scratch, f"{tag}.metrics.jsonl")
    _fresh(metrics)
    cmd = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=1, port=free_port(),
              args=tuple(script_args(size, cfg_path, 1, metrics, args.seed))).argv()
    out: dict[str, Any] = {"kind": "solo", "tag": tag, "cmd": shlex.join(cmd),
                           "settle": settle(args.settle_s, args.settle_busy)}
    print(f"[bench] {size} {tag}: {out['cmd']}", flush=True)
    job = run_logged(cmd, env=base_env(d.get("env")), timeout_s=d["timeout_s"],
                     log_path=os.path.join(logs, f"{size}_{tag}.log"))
    ready = next((t for t, line in job["lines"] if READY_RE.search(line)), None)
    out.update({k_: job[k_] for k_ in ("returncode", "timed_out", "error", "log")})
    out["startup_s"] = ready - job["start"] if ready is not None else None
    if job["returncode"] != 0 or ready is None:
        out["failed"] = f"exited rc={job['returncode']}" if job["returncode"] != 0 else "no ready line"
    return out


def busy_between_runs(mons: dict[str, Monitor], t0: float, t1: float) -> float | None:
    samples = sorted(mons["1"].cpu + mons["2"].cpu)
    if len(samples) < 2:
        return None
    a = min(samples, key=lambda s: abs(s[0] - t0))
    b = min(samples, key=lambda s: abs(s[0] - t1))
    return busy_fraction(a[1:], b[1:]) if b[0] > a[0] else None


def run_reference(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                  logs: str) -> dict[str, Any]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    n = d["kill_step"] + d["steps_after"]
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, None)
    metrics = os.path.join(scratch, f"{tag}.metrics.jsonl")
    _fresh(metrics)
    cmd = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=NNODES * NPROC_PER_NODE, port=free_port(),
              args=tuple(script_args(size, cfg_path, n, metrics, args.seed))).argv()
    out: dict[str, Any] = {"kind": "reference", "tag": tag, "cmd": shlex.join(cmd), "train_iters": n}
    mons: dict[str, Monitor] = {}

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mon = mons["m"] = _monitor(proc.pid, "RANK", args)
        while proc.poll() is None and time.time() < deadline:
            mon.sample()
            time.sleep(0.2)

    print(f"[bench] {size} {tag}: {out['cmd']}", flush=True)
    job = run_logged(cmd, env=base_env(d.get("env")), timeout_s=d["timeout_s"], hook=hook,
                     log_path=os.path.join(logs, f"{size}_{tag}.log"))
    if "m" in mons:
        out["memory"] = mons["m"].summary()
        remove_files(mons["m"].ds_shm)
    out.update({k_: job[k_] for k_ in ("returncode", "timed_out", "error", "log")})
    out["wall_s"] = job["end"] - job["start"]
    out["records"] = read_records(metrics)
    if job["returncode"] != 0:
        out["failed"] = f"exited rc={job['returncode']}"
    return out


def params_from_logs(entry: dict[str, Any]) -> int | None:
    """The model's parameter count as the training script printed it in a job log (runs of this invocation)."""
    for r in entry["runs"]["hotswap"] + entry["runs"]["baseline"]:
        for key in ("log", "job1"):
            path = r.get("log") if key == "log" else (r.get("job1") or {}).get("log")
            if path and os.path.exists(os.path.join(REPO, path)):
                with open(os.path.join(REPO, path)) as fh:
                    mt = re.search(r"\[pretrain_gpt\] \S+: ([\d.]+)M params", fh.read())
                if mt:
                    return int(float(mt.group(1)) * 1e6)
    return None
