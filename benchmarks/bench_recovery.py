#!/usr/bin/env python
"""Recovery time after a SIGKILL: deadpool hot-swap against kill + relaunch + DeepSpeed ``load_checkpoint``.

Issue "Hot-swap", item 8. GPT small (~25M) and medium (~125M), DeepSpeed ZeRO-3 fp32 with torch Adam, 3 ranks
(one per simulated node) on one host. Per model size and repeat, two jobs (plus, for some sizes, one reference):

* ``hotswap``   ``deadpool-run --nnodes 3 --nproc-per-node 1 --spare-nodes 1`` (3 active nodes + 1 pre-started
                spare), deadpool snapshots every step (tier 1 + one peer replica). After step K the benchmark
                SIGKILLs the worker ``node1.0`` (rank 1); the launcher fences node1 (drops its memory), the spare
                takes rank 1 and restores its state from the peer replica, survivors rebuild communicators and
                the DeepSpeed engine in-process; the job trains on to step N.
* ``baseline``  what users have today: ``torchrun --nproc-per-node 3 --max-restarts 0`` with
                ``--save CKPT --save-interval 1`` (a DeepSpeed checkpoint to local disk every step: the only way
                to lose at most one step) and no deadpool section. After step K (and once checkpoint K is
                committed: ``latest`` names it) rank 1 is SIGKILLed; torchrun fails the job; the benchmark
                relaunches the same command with ``--load CKPT`` at once (no scheduler delay) and waits for
                the first completed step.
* ``reference`` (``--reference-sizes``) the baseline command without checkpointing and without a fault: the
                loss trajectory of an uninterrupted run.

The kill lands at the same point of the step cycle in both jobs: ``--kill-delay-frac`` (default 0.5) of a
normal step after rank 0 logged step K, i.e. in the middle of step K+1, whose work is lost in both jobs.

Definitions (all wall clock, ``time.time()`` of this host; rank 0's metrics record ``time`` is written right
after a step completes):

* ``raw_s``       = time of the first metrics record whose step is > the last step completed before the kill,
                    minus ``t_kill``. This is "SIGKILL to the next completed step", end to end; it contains the
                    redo of the step that was in flight (and any older step the restored state predates).
* ``minus_step_s`` = ``raw_s`` - one normal step (median ``step_time_s`` of steps 2..K of the same job): the
                    time recovery costs on top of redoing the interrupted step.
* hot-swap phases: ``deadpool_ext.recovery.timeline.phases`` over the job's timeline (detect, agree, rebuild,
  restore, recompute, total), with the injector's ``fault`` event at ``t_kill``.
* baseline phases: detect = kill -> torchrun exits (the job is seen dead); relaunch = exit -> new torchrun
  started (the benchmark reaps leftovers); startup = start -> rank 0 prints its first line after
  ``load_checkpoint`` (imports, process group, model build, ``deepspeed.initialize``, load); first step =
  that line -> first completed step.

Usage::

    python benchmarks/bench_recovery.py --quick       # tiny model, 1 repeat + reference, ~1-2 min
    python benchmarks/bench_recovery.py               # small (2 repeats + reference) + medium (baseline only), ~6 min

Medium's hot-swap job does not fit in this machine's 24 GiB (see DEFAULTS); ``--force-hotswap`` tries it anyway,
and a memory guard (``--min-available-gib``) stops any job before the machine runs out of memory.

Writes ``benchmarks/results/recovery.json`` and ``.md`` (``recovery_quick.*`` for --quick) and the jobs' logs
under ``benchmarks/results/recovery_logs/`` (``recovery_quick_logs/``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    REPO,
    busy_fraction,
    dir_bytes,
    fmt_bytes,
    fmt_s,
    machine_info,
    mapped_files,
    md_table,
    median,
    process_memory,
    ratio,
    summarize,
    system_cpu,
    write_json,
    write_text,
)

BASE_CONFIG = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
SCRIPT = os.path.join(REPO, "scripts", "pretrain_gpt.py")
NNODES, NPROC_PER_NODE, SPARE_NODES = 3, 1, 1
KILL_WORKER, KILL_RANK = "node1.0", 1
TARGET_E2E_S = {"small": 10.0}
TARGET_SPEEDUP = 5.0
MIN_AVAILABLE_BYTES = int(1.5 * 2**30)  # --min-available-gib

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
               # 7.2-7.4 GB of the trial in results/recovery_medium_trial.json, where hot-swap did not fit.
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


# ==================================================================================================
# processes
# ==================================================================================================
class Monitor:
    """Samples a job while it runs: its worker processes (labelled by an environment variable), their RSS and peak
    RSS, the DeepSpeed /dev/shm buffers they map (to remove exactly those afterwards), the bytes under the job's
    shm root, and the machine's CPU busy fraction."""

    def __init__(self, root_pid: int, label_env: str, shm_root: str | None = None, interval_s: float = 1.0) -> None:
        self.root_pid, self.label_env, self.shm_root, self.interval_s = root_pid, label_env, shm_root, interval_s
        self.labels: dict[int, str | None] = {}
        self.peak_hwm: dict[str, int] = {}
        self.peak_rss_sum = 0
        self.peak_shm_bytes = 0
        self.ds_shm: set[str] = set()
        self.cpu: list[tuple[float, float, float]] = [(time.time(), *system_cpu())]
        self.series: list[tuple[float, dict[str, int]]] = []  # (time, {label: rss bytes}) per sample
        self.min_available: int | None = None
        self.low_memory: str | None = None
        self._last = 0.0

    def _children(self) -> list[Any]:
        import psutil

        try:
            # Workers are the launcher's (torchrun's, deadpool-run's) direct children. Not recursive: a worker's own
            # children inherit its environment and would carry its label (a first run of this benchmark SIGKILLed
            # such a process instead of the worker, and no fault happened).
            return psutil.Process(self.root_pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []

    def workers(self) -> dict[str, int]:
        """label -> pid of the live worker processes (direct children of the root running the training script)."""
        out: dict[str, int] = {}
        for p in self._children():
            if p.pid not in self.labels:
                try:
                    cmd = p.cmdline()
                    if not any(os.path.basename(c) == os.path.basename(SCRIPT) for c in cmd):
                        continue  # not exec'ed yet (still a fork of the launcher) or not a worker: look again later
                    self.labels[p.pid] = p.environ().get(self.label_env)
                except Exception:  # noqa: BLE001 - gone, zombie or not readable yet: try again next time
                    continue
            label = self.labels[p.pid]
            if label is not None:
                if label in out:
                    raise RuntimeError(f"two workers labelled {self.label_env}={label}: pids {out[label]} and {p.pid}")
                out[label] = p.pid
        return out

    def find(self, label: str) -> int | None:
        return self.workers().get(label)

    def sample(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        rss_sum = 0
        rss: dict[str, int] = {}
        for label, pid in self.workers().items():
            mem = process_memory(pid)
            rss[label] = mem.get("rss", 0)
            rss_sum += mem.get("rss", 0)
            self.peak_hwm[label] = max(self.peak_hwm.get(label, 0), mem.get("hwm", 0))
            self.ds_shm |= mapped_files(pid, "/dev/shm/deepspeed_")
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
        self.series.append((now, rss))
        avail = _mem_available()
        if avail is not None:
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            if avail < MIN_AVAILABLE_BYTES and self.low_memory is None:
                # The machine is shared: stop this job before the kernel's OOM killer picks someone else's process.
                self.low_memory = (f"stopped by the benchmark: MemAvailable {avail / 2**30:.2f} GiB < "
                                   f"{MIN_AVAILABLE_BYTES / 2**30:.2f} GiB (workers' RSS {rss_sum / 2**30:.2f} GiB)")
                from deadpool_ext.testing.launch import kill_tree

                kill_tree(self.root_pid)
        if self.shm_root and os.path.isdir(self.shm_root):
            self.peak_shm_bytes = max(self.peak_shm_bytes, dir_bytes(self.shm_root))
        self.cpu.append((now, *system_cpu()))

    def busy_between(self, t0: float, t1: float) -> float | None:
        """Machine busy fraction between the samples nearest to t0 and t1."""
        if len(self.cpu) < 2:
            return None
        a = min(self.cpu, key=lambda s: abs(s[0] - t0))
        b = min(self.cpu, key=lambda s: abs(s[0] - t1))
        return busy_fraction(a[1:], b[1:]) if b[0] > a[0] else None

    def rss_at(self, t: float) -> dict[str, int]:
        """RSS per worker at the last sample at or before ``t``."""
        before = [r for ts, r in self.series if ts <= t]
        return before[-1] if before else {}

    def rss_max_after(self, t: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for ts, r in self.series:
            if ts > t:
                for k, v in r.items():
                    out[k] = max(out.get(k, 0), v)
        return out

    def summary(self) -> dict[str, Any]:
        return {"peak_rss_sum_bytes": self.peak_rss_sum, "peak_hwm_bytes": dict(sorted(self.peak_hwm.items())),
                "peak_shm_root_bytes": self.peak_shm_bytes or None, "min_mem_available_bytes": self.min_available,
                "low_memory_stop": self.low_memory,
                "rss_series": [[round(t, 2), {k: round(v / 2**20) for k, v in r.items()}] for t, r in self.series],
                "rss_series_unit": "[unix time, {worker: RSS MiB}] per sample (about 1 s apart)",
                "busy_fraction": busy_fraction(self.cpu[0][1:], self.cpu[-1][1:]) if len(self.cpu) > 1 else None}


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_logged(cmd: list[str], *, env: dict[str, str], timeout_s: float, log_path: str,
               hook: Callable[[subprocess.Popen, float], None] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own session with a deadline; ``hook(proc, deadline)`` runs meanwhile. Every output line
    is time-stamped on arrival (the log shows seconds since start). The whole tree is killed at the end."""
    from deadpool_ext.testing.launch import kill_tree

    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = start + timeout_s
    timed_out, error = False, None
    try:
        if hook is not None:
            hook(proc, deadline)
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        timed_out = True
    except Exception as exc:  # noqa: BLE001 - recorded; the tree is reaped below either way
        error = f"{type(exc).__name__}: {exc}"
    finally:
        exited = proc.poll() is not None
        kill_tree(proc.pid)
        reader.join(5)
    end = time.time()
    write_text(log_path, f"$ {shlex.join(cmd)}\n" + "".join(f"[{t - start:8.3f}] {line}" for t, line in lines))
    return {"returncode": proc.returncode if exited else None, "timed_out": timed_out, "error": error,
            "start": start, "end": end, "lines": lines, "log": os.path.relpath(log_path, REPO)}


def remove_files(paths: set[str]) -> int:
    n = 0
    for path in paths:
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def read_records(path: str) -> list[dict[str, Any]]:
    """Metrics records in file order (a partly written last line is skipped)."""
    out: list[dict[str, Any]] = []
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def latest_tag_step(ckpt_dir: str) -> int:
    try:
        with open(os.path.join(ckpt_dir, "latest")) as fh:
            m = re.search(r"(\d+)$", fh.read().strip())
        return int(m.group(1)) if m else -1
    except OSError:
        return -1


def normal_step_s(records: list[dict[str, Any]], upto: int) -> float | None:
    """Median step time of steps 2..upto (step 1 is warm-up); all steps if that leaves none."""
    vals = [r["step_time_s"] for r in records if 2 <= r["step"] <= upto]
    return median(vals or [r["step_time_s"] for r in records if r["step"] <= upto])


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


def wait_and_kill(proc: subprocess.Popen, deadline: float, mon: Monitor, metrics: str, kill_step: int,
                  delay_frac: float, label: str, ready: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Wait until rank 0 logged ``kill_step`` (and ``ready()``), then until ``delay_frac`` of a normal step more has
    passed, then SIGKILL the worker ``label``. Returns what happened, ``t_kill`` included."""
    rec_k = None
    while rec_k is None:
        if proc.poll() is not None:
            raise RuntimeError(f"job exited (rc={proc.returncode}) before step {kill_step}")
        if time.time() > deadline:
            raise TimeoutError(f"step {kill_step} not reached before the deadline")
        mon.sample()
        recs = read_records(metrics)
        rec_k = next((r for r in recs if r["step"] == kill_step), None)
        time.sleep(0.05)
    step_s = normal_step_s(recs, kill_step)
    target_t = rec_k["time"] + delay_frac * step_s
    pid = mon.find(label)
    waited_ready = False
    while time.time() < target_t or (ready is not None and not ready()):
        if ready is not None and time.time() >= target_t:
            waited_ready = True
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("job ended (or deadline passed) while waiting to inject the fault")
        mon.sample()
        pid = pid or mon.find(label)
        time.sleep(0.01)
    pid = pid or mon.find(label)
    if pid is None:
        raise RuntimeError(f"no worker labelled {label!r} ({mon.label_env}) under pid {proc.pid}")
    mon.sample(force=True)
    target = _describe(pid)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    return {"t_kill": t_kill, "killed_pid": pid, "killed": label, "target": target, "step_k_time": rec_k["time"],
            "kill_delay_s": t_kill - rec_k["time"], "planned_delay_s": delay_frac * step_s,
            "normal_step_s_at_kill": step_s, "waited_for_checkpoint": waited_ready}


def watch_recovery(proc: subprocess.Popen, deadline: float, mon: Monitor, metrics: str, t_kill: float,
                   stall_s: float) -> bool:
    """Sample until the job exits. If no step completes for ``stall_s`` after the kill (or after the last step
    completed since), the job is declared hung: every worker gets SIGUSR1 (deadpool_ext registers faulthandler on
    it: all threads' stacks go to the job log), then the job is stopped. Returns True if it hung. (A step may still
    complete on rank 0 just after the kill, so "a step after the kill" alone does not prove recovery.)"""
    while proc.poll() is None and time.time() < deadline:
        mon.sample()
        last = max([t_kill] + [r["time"] for r in read_records(metrics)])
        if time.time() - last > stall_s:
            print("[bench]   no step completed before the recovery timeout: hung; dumping stacks (SIGUSR1) and "
                  "stopping the job", flush=True)
            for pid in mon.workers().values():
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(3.0)
            from deadpool_ext.testing.launch import kill_tree

            kill_tree(proc.pid)
            return True
        time.sleep(0.1)
    return False


def _describe(pid: int) -> dict[str, Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {"ppid": p.ppid(), "status": p.status(), "cmdline": " ".join(p.cmdline())[:300]}
    except psutil.Error as exc:
        return {"error": repr(exc)}


def _fresh(*paths: str) -> None:
    """Remove leftovers of an earlier job at these paths (metrics files are opened for appending)."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def append_event(path: str, rec: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def settle(max_s: float, threshold: float) -> dict[str, Any]:
    """Wait (at most ``max_s``) until the machine's CPU busy fraction over one second is below ``threshold``: the
    machine is shared, and other jobs' load lengthens every phase. Returns what was seen."""
    t0 = time.time()
    seen = []
    while True:
        a = system_cpu()
        time.sleep(1.0)
        b = busy_fraction(a, system_cpu())
        seen.append(b)
        if b is None or b < threshold or time.time() - t0 >= max_s:
            return {"waited_s": time.time() - t0, "busy_fraction_before": b, "loadavg": list(os.getloadavg()),
                    "quiet": b is not None and b < threshold}


# ==================================================================================================
# jobs
# ==================================================================================================
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
    write_text(path, json.dumps(cfg, indent=2))
    return cfg


def script_args(size: str, cfg: str, n: int, metrics: str, seed: int) -> list[str]:
    return ["--deepspeed_config", cfg, "--model-size", size, "--train-iters", str(n), "--metrics-out", metrics,
            "--seed", str(seed), "--log-interval", "1"]


def run_hotswap(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                logs: str) -> dict[str, Any]:
    from deadpool_ext.recovery.timeline import phases, read_events
    from deadpool_ext.testing.launch import base_env

    k, n = d["kill_step"], d["kill_step"] + d["steps_after"]
    shm_root = os.path.join("/dev/shm", f"bench_recovery.{os.getpid()}.{tag}")
    os.makedirs(shm_root, exist_ok=True)
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, shm_root)
    metrics, timeline = os.path.join(scratch, f"{tag}.metrics.jsonl"), os.path.join(scratch, f"{tag}.timeline.jsonl")
    _fresh(metrics, timeline)
    launcher = [sys.executable, "-m", "deadpool_ext.launcher.cli"]
    flags = ["--nnodes", str(NNODES), "--nproc-per-node", str(NPROC_PER_NODE), "--spare-nodes", str(SPARE_NODES),
             "--shm-root", shm_root, "--timeline", timeline, SCRIPT]
    cmd = launcher + flags + script_args(size, cfg_path, n, metrics, args.seed)
    out: dict[str, Any] = {"kind": "hotswap", "tag": tag,
                           "cmd": shlex.join(["deadpool-run"] + flags +
                                             script_args(size, cfg_path, n, metrics, args.seed)),
                           "train_iters": n, "kill_step": k, "settle": settle(args.settle_s, args.settle_busy)}
    mon_box: dict[str, Monitor] = {}

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mon = mon_box["m"] = Monitor(proc.pid, "DEADPOOL_WORKER_ID", shm_root)
        kill = wait_and_kill(proc, deadline, mon, metrics, k, args.kill_delay_frac, KILL_WORKER)
        append_event(timeline, {"event": "fault", "time": kill["t_kill"], "generation": 0, "source": "injector",
                                "pid": kill["killed_pid"], "worker": KILL_WORKER})
        out["fault"] = kill
        print(f"[bench]   hotswap: SIGKILLed {KILL_WORKER} (pid {kill['killed_pid']}) "
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
    step_s = normal_step_s(pre_recs, k)
    out: dict[str, Any] = {"last_step_before_kill": last_pre, "normal_step_s": step_s, "first_after": first_after}
    if first_after is None:
        return out
    raw = first_after["time"] - t_kill
    later = [r for r in post_recs if r["time"] > first_after["time"]]
    out.update({"raw_s": raw, "minus_step_s": raw - step_s if step_s is not None else None,
                "first_any_after": next((r for r in post_recs if r["time"] > t_kill), None),
                "step_time_after_s": [r["step_time_s"] for r in later],
                "first_step_time_after_s": first_after["step_time_s"]})
    return out


def run_baseline(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                 logs: str) -> dict[str, Any]:
    from deadpool_ext.testing.launch import base_env, free_port, torchrun_cmd

    k, n = d["kill_step"], d["kill_step"] + d["steps_after"]
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, None)
    ckpt = os.path.join(scratch, f"{tag}.ckpt")
    m1, m2 = os.path.join(scratch, f"{tag}.metrics1.jsonl"), os.path.join(scratch, f"{tag}.metrics2.jsonl")
    _fresh(ckpt, m1, m2)
    save = ["--save", ckpt, "--save-interval", "1"]
    cmd1 = torchrun_cmd(NNODES * NPROC_PER_NODE, SCRIPT, script_args(size, cfg_path, n, m1, args.seed) + save,
                        port=free_port())
    out: dict[str, Any] = {"kind": "baseline", "tag": tag, "cmd": shlex.join(cmd1), "train_iters": n, "kill_step": k,
                           "settle": settle(args.settle_s, args.settle_busy)}
    env = base_env(d.get("env"))
    mons: dict[str, Monitor] = {}

    def hook1(proc: subprocess.Popen, deadline: float) -> None:
        mon = mons["1"] = Monitor(proc.pid, "RANK")
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
        cmd2 = torchrun_cmd(NNODES * NPROC_PER_NODE, SCRIPT,
                            script_args(size, cfg_path, n, m2, args.seed) + save + ["--load", ckpt], port=free_port())
        out["relaunch_cmd"] = shlex.join(cmd2)

        def hook2(proc: subprocess.Popen, deadline: float) -> None:
            mon = mons["2"] = Monitor(proc.pid, "RANK")
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


def busy_between_runs(mons: dict[str, Monitor], t0: float, t1: float) -> float | None:
    samples = sorted(mons["1"].cpu + mons["2"].cpu)
    if len(samples) < 2:
        return None
    a = min(samples, key=lambda s: abs(s[0] - t0))
    b = min(samples, key=lambda s: abs(s[0] - t1))
    return busy_fraction(a[1:], b[1:]) if b[0] > a[0] else None


def run_reference(size: str, d: dict[str, Any], scratch: str, tag: str, args: argparse.Namespace,
                  logs: str) -> dict[str, Any]:
    from deadpool_ext.testing.launch import base_env, free_port, torchrun_cmd

    n = d["kill_step"] + d["steps_after"]
    cfg_path = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg_path, size, d, None)
    metrics = os.path.join(scratch, f"{tag}.metrics.jsonl")
    _fresh(metrics)
    cmd = torchrun_cmd(NNODES * NPROC_PER_NODE, SCRIPT, script_args(size, cfg_path, n, metrics, args.seed),
                       port=free_port())
    out: dict[str, Any] = {"kind": "reference", "tag": tag, "cmd": shlex.join(cmd), "train_iters": n}
    mons: dict[str, Monitor] = {}

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mon = mons["m"] = Monitor(proc.pid, "RANK")
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


# ==================================================================================================
# analysis
# ==================================================================================================
def losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """step -> loss; a step recomputed after recovery appears twice and the later value wins."""
    out: dict[int, float] = {}
    for r in records:
        out[int(r["step"])] = float(r["loss"])
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    common = sorted(set(a) & set(b))
    diff = [{"step": s, "a": a[s], "b": b[s]} for s in common if a[s] != b[s]]
    return {"steps": common, "identical": bool(common) and not diff, "mismatches": diff,
            "max_abs_diff": max((abs(x["a"] - x["b"]) for x in diff), default=0.0)}


def redo_check(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps logged twice (once before the kill, once recomputed): equal?"""
    seen: dict[int, float] = {}
    twice = []
    for r in records:
        s = int(r["step"])
        if s in seen:
            twice.append({"step": s, "before": seen[s], "after": float(r["loss"]),
                          "equal": seen[s] == float(r["loss"])})
        seen[s] = float(r["loss"])
    return {"steps": twice, "all_equal": all(x["equal"] for x in twice)}


def loss_checks(hs: dict[str, Any] | None, bl: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """Exact loss comparisons of one repeat (``hs`` None: the baseline's own checks only)."""
    bl_l = losses(bl.get("records1", []) + bl.get("records2", []))
    out: dict[str, Any] = {"baseline_redone_steps": redo_check(bl.get("records1", []) + bl.get("records2", []))}
    ref_l = losses(ref["records"]) if ref and ref.get("records") else None
    if ref_l:
        out["baseline_vs_reference"] = compare(bl_l, ref_l)
    if hs is None:
        return out
    hs_l = losses(hs.get("records", []))
    out["hotswap_vs_baseline"] = compare(hs_l, bl_l)
    out["hotswap_redone_steps"] = redo_check(hs.get("records", []))
    out["steps_after_kill_compared"] = [s for s in out["hotswap_vs_baseline"]["steps"]
                                        if s > min(hs.get("last_step_before_kill") or 0,
                                                   bl.get("last_step_before_kill") or 0)]
    if ref_l:
        out["hotswap_vs_reference"] = compare(hs_l, ref_l)
    return out


def analyze_size(size: str, entry: dict[str, Any]) -> dict[str, Any]:
    runs = entry["runs"]
    hs_ok = [r for r in runs["hotswap"] if not r.get("failed")]
    bl_ok = [r for r in runs["baseline"] if not r.get("failed")]
    ref = runs.get("reference")

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        return median([r[key] for r in rs if r.get(key) is not None])

    phase_keys = ("detect_s", "agree_s", "rebuild_s", "restore_s", "recompute_s", "total_s")
    phases = {p: median([r["phases"][p] for r in hs_ok if r.get("phases") and r["phases"].get(p) is not None])
              for p in phase_keys}
    bkeys = ("detect_s", "relaunch_s", "startup_and_load_s", "first_step_s", "total_s")
    bphases = {p: median([r["breakdown"][p] for r in bl_ok if r["breakdown"].get(p) is not None]) for p in bkeys}
    hs_raw, hs_minus = med(hs_ok, "raw_s"), med(hs_ok, "minus_step_s")
    bl_raw, bl_minus = med(bl_ok, "raw_s"), med(bl_ok, "minus_step_s")
    an: dict[str, Any] = {
        "hotswap": {"n": len(hs_ok), "raw_s": summarize([r["raw_s"] for r in hs_ok]),
                    "minus_step_s": summarize([r["minus_step_s"] for r in hs_ok if r.get("minus_step_s") is not None]),
                    "normal_step_s": med(hs_ok, "normal_step_s"), "phases_median": phases,
                    "restored_version": [r["events"]["restored_version"] for r in hs_ok],
                    "last_step_before_kill": [r["last_step_before_kill"] for r in hs_ok],
                    "first_step_time_after_s": med(hs_ok, "first_step_time_after_s"),
                    "step_time_after_s": median([x for r in hs_ok for x in r.get("step_time_after_s", [])]),
                    "busy_fraction_recovery": med(hs_ok, "busy_fraction_recovery")},
        "baseline": {"n": len(bl_ok), "raw_s": summarize([r["raw_s"] for r in bl_ok]),
                     "minus_step_s": summarize([r["minus_step_s"] for r in bl_ok if r.get("minus_step_s") is not None]),
                     "normal_step_s": med(bl_ok, "normal_step_s"), "phases_median": bphases,
                     "loaded_step": [r.get("loaded_step") for r in bl_ok],
                     "last_step_before_kill": [r["last_step_before_kill"] for r in bl_ok],
                     "first_step_time_after_s": med(bl_ok, "first_step_time_after_s"),
                     "step_time_after_s": median([x for r in bl_ok for x in r.get("step_time_after_s", [])]),
                     "busy_fraction_recovery": med(bl_ok, "busy_fraction_recovery")},
        "speedup_raw": ratio(bl_raw, hs_raw),
        "speedup_minus_step": ratio(bl_minus, hs_minus) if hs_minus and hs_minus > 0 else None,
        "failed_runs": [{"kind": r["kind"], "tag": r["tag"], "why": r["failed"]}
                        for r in runs["hotswap"] + runs["baseline"] + ([ref] if ref else []) if r.get("failed")],
    }
    checks = []
    for bl in runs["baseline"]:
        rep = bl["tag"].split("_")[-1]
        hs = next((h for h in runs["hotswap"] if h["tag"].split("_")[-1] == rep), None)
        checks.append({"repeat": rep, **loss_checks(hs, bl, ref)})
    an["loss_checks"] = checks
    an["losses_identical"] = None if not runs["hotswap"] else bool(checks) and all(
        c["hotswap_vs_baseline"]["identical"] and c["hotswap_redone_steps"]["all_equal"]
        and c.get("hotswap_vs_reference", {"identical": True})["identical"] for c in checks)
    targets: dict[str, Any] = {}
    if size in TARGET_E2E_S:
        t = TARGET_E2E_S[size]
        targets["end_to_end_raw"] = {"target_s": t, "value_s": hs_raw, "met": hs_raw is not None and hs_raw <= t}
        targets["end_to_end_minus_step"] = {"target_s": t, "value_s": hs_minus,
                                            "met": hs_minus is not None and hs_minus <= t}
    targets["speedup_raw"] = {"target": TARGET_SPEEDUP, "value": an["speedup_raw"],
                              "met": an["speedup_raw"] is not None and an["speedup_raw"] >= TARGET_SPEEDUP}
    targets["speedup_minus_step"] = {"target": TARGET_SPEEDUP, "value": an["speedup_minus_step"],
                                     "met": an["speedup_minus_step"] is not None
                                     and an["speedup_minus_step"] >= TARGET_SPEEDUP}
    an["raw_speedup_ceiling"] = raw_speedup_ceiling(an)
    an["ready"] = ready_to_redo(hs_ok, bl_ok)
    an["targets"] = targets
    return an


def ready_to_redo(hs_ok: list[dict[str, Any]], bl_ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Kill -> every rank ready to redo the interrupted step, measured directly (not by subtracting a step, whose
    run-to-run noise is seconds for GPT medium): hot-swap detect + agree + rebuild + restore (the last rank,
    spare included, restored); baseline detect + relaunch + start-up and ``load_checkpoint`` (rank 0 ready)."""
    def total(r: dict[str, Any], src: str, keys: tuple[str, ...]) -> float | None:
        vals = [(r.get(src) or {}).get(k) for k in keys]
        return None if any(v is None for v in vals) else sum(vals)

    hs = [t for t in (total(r, "phases", ("detect_s", "agree_s", "rebuild_s", "restore_s")) for r in hs_ok)
          if t is not None]
    bl = [t for t in (total(r, "breakdown", ("detect_s", "relaunch_s", "startup_and_load_s")) for r in bl_ok)
          if t is not None]
    h, b = median(hs), median(bl)
    return {"hotswap_s": h, "baseline_s": b, "hotswap_each_s": hs, "baseline_each_s": bl, "speedup": ratio(b, h)}


def raw_speedup_ceiling(an: dict[str, Any]) -> dict[str, float | None]:
    """The ceiling of the raw ratio: a recovery that took no time at all still redoes the interrupted step."""
    bl_raw = an["baseline"]["raw_s"]["median"]
    return {"with_first_step_after_recovery": ratio(bl_raw, an["hotswap"]["first_step_time_after_s"]),
            "with_normal_step": ratio(bl_raw, an["hotswap"]["normal_step_s"])}


def _f(x: float | None, digits: int = 2) -> str | None:
    return None if x is None else f"{x:.{digits}f}"


def render_markdown(doc: dict[str, Any]) -> str:
    L = ["# Recovery time after SIGKILL: hot-swap vs. kill + relaunch + `load_checkpoint`", ""]
    m = doc.get("machine", {})
    v = m.get("versions", {})
    L.append(f"Command: `{doc['command']}`  ")
    L.append(f"Machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model')}), {fmt_bytes(m.get('mem_total_bytes'))} RAM, "
             f"load at start {m.get('loadavg')} (shared with other engineers' test runs); torch {v.get('torch')}, "
             f"deepspeed {v.get('deepspeed')}, transformers {v.get('transformers')}; git "
             f"{str((m.get('git') or {}).get('commit'))[:10]}"
             f"{' (dirty)' if (m.get('git') or {}).get('dirty') else ''}, "
             f"deadpool_ext source digest {(m.get('source_digest') or {}).get('deadpool_ext')}; {m.get('time_utc')}; "
             f"total wall {_f(doc.get('wall_s'), 0)} s.")
    L.append("")
    L.append("Setup: GPT-2 (HF architecture), DeepSpeed ZeRO-3 fp32, torch Adam, 3 ranks, one per simulated node, on "
             "one 2-core host (`OMP_NUM_THREADS=1`). Hot-swap: `deadpool-run --nnodes 3 --nproc-per-node 1 "
             "--spare-nodes 1`, snapshots every step, replication factor 1; the worker `node1.0` (rank 1) is "
             "SIGKILLed and its node's memory is dropped by the launcher, so rank 1's state comes from a peer "
             "replica. Baseline: `torchrun` with a DeepSpeed checkpoint to local disk every step, rank 1 SIGKILLed "
             "once checkpoint K is committed, relaunched at once (no scheduler delay) with `--load`. Kill point in "
             f"both: {doc['settings']['kill_delay_frac']} of a normal step after rank 0 logged step K (mid step K+1).")
    L.append("")
    L.append("**Definitions.** *raw* = wall time from the SIGKILL to the completion of the first step after the last "
             "step completed before the kill (\"SIGKILL to next completed step\", end to end; includes redoing the "
             "interrupted step). *minus step* = raw minus one normal step (median of steps 2..K of the same job): what "
             "recovery costs on top of redoing the interrupted step. Medians over repeats.")
    L.append("")
    for size, entry in doc["sizes"].items():
        an = entry.get("analysis")
        s = entry["settings"]
        L.append(f"## {size} ({_f((entry.get('params') or 0) / 1e6, 1)}M parameters, micro-batch "
                 f"{s['micro_batch']}/rank, seq {entry.get('seq_len')}, kill after step {s['kill_step']} of "
                 f"{s['kill_step'] + s['steps_after']}, {s['repeats']} repeat(s))")
        L.append("")
        if s.get("env"):
            L.append("Worker environment, both jobs: " + ", ".join(f"`{k}={v}`" for k, v in s["env"].items()) +
                     " (glibc malloc: freed large buffers go back to the OS; without it medium hot-swap does not "
                     "fit in 24 GiB).")
            L.append("")
        if entry.get("error"):
            L.append(f"**Not completed:** {entry['error']}")
            L.append("")
        if s.get("hotswap_skip") and not entry["runs"]["hotswap"]:
            L.append(f"**Hot-swap not run for {size}:** {s['hotswap_skip']}. Only the baseline was measured; there "
                     "is no speedup for this size.")
            L.append("")
        if not an:
            continue
        hs, bl = an["hotswap"], an["baseline"]
        rd = an.get("ready") or ready_to_redo(
            [r for r in entry["runs"]["hotswap"] if not r.get("failed")],
            [r for r in entry["runs"]["baseline"] if not r.get("failed")])
        rows = [
            ["end to end, raw (kill -> next completed step)", fmt_s(hs["raw_s"]["median"]),
             fmt_s(bl["raw_s"]["median"]),
             _f(an["speedup_raw"], 1) + "x" if an["speedup_raw"] else None],
            ["end to end minus one normal step", fmt_s(hs["minus_step_s"]["median"]),
             fmt_s(bl["minus_step_s"]["median"]),
             _f(an["speedup_minus_step"], 1) + "x" if an["speedup_minus_step"] else None],
            ["kill -> every rank ready to redo the step (measured, no step subtracted)",
             fmt_s(rd.get("hotswap_s")), fmt_s(rd.get("baseline_s")),
             _f(rd.get("speedup"), 1) + "x" if rd.get("speedup") else None],
            ["raw, each repeat", ", ".join(f"{x:.2f}" for x in _vals(entry, "hotswap", "raw_s")),
             ", ".join(f"{x:.2f}" for x in _vals(entry, "baseline", "raw_s")), None],
            ["normal step time (steps 2..K)", fmt_s(hs["normal_step_s"]), fmt_s(bl["normal_step_s"]), None],
            ["first step after recovery (its own step time)", fmt_s(hs["first_step_time_after_s"]),
             fmt_s(bl["first_step_time_after_s"]), None],
            ["later steps after recovery (median)", fmt_s(hs["step_time_after_s"]), fmt_s(bl["step_time_after_s"]),
             None],
            ["last step before kill / state resumed from", f"{hs['last_step_before_kill']} / {hs['restored_version']}",
             f"{bl['last_step_before_kill']} / {bl['loaded_step']}", None],
            ["machine busy during recovery", _pct(hs["busy_fraction_recovery"]), _pct(bl["busy_fraction_recovery"]),
             None],
        ]
        L.append(md_table(["", "hot-swap", "baseline (relaunch + load)", "speedup"], rows))
        L.append("")
        if entry["runs"]["hotswap"]:
            L.append("Hot-swap phases (timeline `phases()`, medians; detect = kill -> launcher detection, agree -> "
                     "every survivor has its new process group, rebuild -> engine rebuilt, restore -> state restored "
                     "(spare included), recompute -> failed step done again, total = kill -> caught up):")
            L.append("")
            ph = hs["phases_median"]
            prow = [[r["tag"]] + [_f(r["phases"].get(p)) if r.get("phases") else None for p in
                                  ("detect_s", "agree_s", "rebuild_s", "restore_s", "recompute_s", "total_s")]
                    + [_f(r.get("raw_s"))] for r in entry["runs"]["hotswap"]]
            prow.append(["**median**"] + [_f(ph[p]) for p in ("detect_s", "agree_s", "rebuild_s", "restore_s",
                                                              "recompute_s", "total_s")] + [_f(hs["raw_s"]["median"])])
            L.append(md_table(["run", "detect", "agree", "rebuild", "restore", "recompute", "total", "raw (metrics)"],
                              prow))
            L.append("")
            ev = [r["events"] for r in entry["runs"]["hotswap"] if r.get("events")]
            if ev:
                e = {k: median([x[k] for x in ev if isinstance(x.get(k), (int, float))]) for k in ev[0]
                     if isinstance(ev[0].get(k), (int, float)) or ev[0].get(k) is None}
                L.append("Hot-swap milestones, seconds after the kill (medians): survivors notice the error "
                         f"{_f(e.get('survivor_noticed_first'))}-{_f(e.get('survivor_noticed_last'))}; launcher "
                         f"detects {_f(e.get('launcher_detected'))}; assignment published "
                         f"{_f(e.get('assignment_published'))}; last survivor has it "
                         f"{_f(e.get('survivor_assigned_last'))}, process group {_f(e.get('survivor_pg_ready_last'))}, "
                         f"engine {_f(e.get('survivor_engine_ready_last'))}, restored "
                         f"{_f(e.get('survivor_restored_last'))}; spare restored {_f(e.get('spare_restored'))} (its "
                         f"restore call {_f(e.get('spare_restore_call_s'))} s, from "
                         f"{', '.join(sorted({str(x) for r in ev for x in r.get('spare_restored_from') or []})) or '?'}"
                         f"); caught up {_f(e.get('caught_up_last'))}.")
                L.append("")
                L.append("Hot-swap output lines, seconds after the kill (" + "; ".join(
                    f"{r['tag']}: " + _milestone_text(r.get("log_milestones") or {}) for r in entry["runs"]["hotswap"]
                    if r.get("log_milestones")) + ").")
                L.append("")
        bp = bl["phases_median"]
        L.append("Baseline breakdown (medians): " + ", ".join(
            f"{lbl} {fmt_s(bp[k])}" for k, lbl in (("detect_s", "detect (kill -> torchrun exits)"),
                                                   ("relaunch_s", "relaunch (exit -> new torchrun)"),
                                                   ("startup_and_load_s",
                                                    "startup + `load_checkpoint` (-> rank 0 ready)"),
                                                   ("first_step_s", "first step"), ("total_s", "total"))) + ".")
        L.append("")
        L.append("Baseline relaunch output lines, seconds after the relaunch (" + "; ".join(
            f"{r['tag']}: " + _milestone_text(r.get("log_milestones") or {}) for r in entry["runs"]["baseline"]
            if r.get("log_milestones")) + ").")
        L.append("")
        L += _where_time_goes(entry, an)
        t = an["targets"]
        L.append("Targets:")
        L.append("")
        if "end_to_end_raw" in t:
            L.append(f"- end to end <= {t['end_to_end_raw']['target_s']:.0f} s: raw **{_met(t['end_to_end_raw'])}** "
                     f"({fmt_s(t['end_to_end_raw']['value_s'])}); minus a step **{_met(t['end_to_end_minus_step'])}** "
                     f"({fmt_s(t['end_to_end_minus_step']['value_s'])})")
        L.append(f"- >= {TARGET_SPEEDUP:.0f}x faster than the baseline: raw **{_met(t['speedup_raw'])}** "
                 f"({_x(t['speedup_raw']['value'])}); minus a step **{_met(t['speedup_minus_step'])}** "
                 f"({_x(t['speedup_minus_step']['value'])})")
        c = an.get("raw_speedup_ceiling") or raw_speedup_ceiling(an)
        if c.get("with_normal_step"):
            L.append(f"- ceiling of the raw ratio on this machine: a recovery taking 0 s still redoes the interrupted "
                     f"step, so raw could be at most {_x(c.get('with_first_step_after_recovery'))} (baseline raw / "
                     f"the hot-swap's first step after recovery) or {_x(c['with_normal_step'])} (/ a normal step)")
        L.append("- per-phase breakdown: above")
        L.append("")
        L.append("Loss check (same seed, world size 3; floats compared exactly):")
        L.append("")
        for c in an["loss_checks"]:
            hv = c.get("hotswap_vs_baseline")
            line = f"- repeat {c['repeat']}: " + ("no hot-swap run" if hv is None else (
                f"hot-swap vs baseline over steps {_span(hv['steps'])} "
                f"(after the kill: {_span(c['steps_after_kill_compared'])}): "
                f"**{'bit-identical' if hv['identical'] else 'DIFFERENT'}**"
                + (f" ({len(hv['mismatches'])} steps differ, max |diff| {hv['max_abs_diff']:.3g})"
                   if hv['mismatches'] else "")))
            for key, lbl in (("hotswap_vs_reference", "hot-swap vs uninterrupted run"),
                             ("baseline_vs_reference", "baseline vs uninterrupted run")):
                if key in c:
                    line += f"; {lbl}: **{'bit-identical' if c[key]['identical'] else 'DIFFERENT'}**"
            for key, lbl in (("hotswap_redone_steps", "hot-swap"), ("baseline_redone_steps", "baseline")):
                if c.get(key, {}).get("steps"):
                    line += (f"; {lbl} steps logged twice {[x['step'] for x in c[key]['steps']]}: "
                             f"{'equal' if c[key]['all_equal'] else 'DIFFERENT'}")
            L.append(line)
        L.append("")
        mem_hs = [r["memory"] for r in entry["runs"]["hotswap"] if r.get("memory")]
        mem_bl = [r["memory"].get("1") for r in entry["runs"]["baseline"] if r.get("memory") and r["memory"].get("1")]
        if mem_hs or mem_bl:
            L.append("Memory (max over the run): " + "; ".join(filter(None, [
                (f"hot-swap sum of worker RSS {fmt_bytes(max(x['peak_rss_sum_bytes'] for x in mem_hs))} (4 processes "
                 "incl. the spare), largest worker peak "
                 f"{fmt_bytes(max(max(x['peak_hwm_bytes'].values(), default=0) for x in mem_hs))}, deadpool shared "
                 f"memory {fmt_bytes(max((x['peak_shm_root_bytes'] or 0) for x in mem_hs))}") if mem_hs else None,
                (f"baseline sum of worker RSS {fmt_bytes(max(x['peak_rss_sum_bytes'] for x in mem_bl))}, largest "
                 f"worker peak {fmt_bytes(max(max(x['peak_hwm_bytes'].values(), default=0) for x in mem_bl))}")
                if mem_bl else None,
            ])) + ".")
            L.append("")
        surv = [(r["rss_before_kill"], r["rss_max_after_kill"], r.get("rss_end") or {})
                for r in entry["runs"]["hotswap"]
                if r.get("rss_before_kill") and r.get("rss_max_after_kill")]
        if surv:
            before, after, end = surv[0]
            L.append("Hot-swap worker RSS just before the kill -> max after it -> last sample before the job ended "
                     "(first repeat): " + ", ".join(
                         f"{w} {fmt_bytes(before.get(w))} -> {fmt_bytes(after.get(w))} -> {fmt_bytes(end.get(w))}"
                         for w in sorted(set(before) | set(after)) if w in after)
                     + f" ({KILL_WORKER} was killed; RSS includes the /dev/shm snapshot pages each process touched).")
            L.append("")
        if an["failed_runs"]:
            L.append("Failed runs: " + "; ".join(f"{x['kind']} {x['tag']}: {x['why']}" for x in an["failed_runs"]))
            L.append("")
        L.append("Commands (paths are the run's scratch files):")
        L.append("")
        for r in entry["runs"]["hotswap"][:1] + entry["runs"]["baseline"][:1]:
            L.append(f"- {r['kind']}: `{r['cmd']}`")
            if r.get("relaunch_cmd"):
                L.append(f"- baseline relaunch: `{r['relaunch_cmd']}`")
        if entry["runs"].get("reference"):
            L.append(f"- reference: `{entry['runs']['reference']['cmd']}`")
        L.append("")
    if doc.get("notes"):
        L.append("## Notes")
        L.append("")
        L += [f"- {n}" for n in doc["notes"]]
        L.append("")
    return "\n".join(L)


def _where_time_goes(entry: dict[str, Any], an: dict[str, Any]) -> list[str]:
    """A reading of the milestones (medians over repeats, seconds): which work sits on each side's critical path."""
    out: list[str] = []

    def med_of(runs: list[dict[str, Any]], fn: Callable[[dict[str, Any]], float | None]) -> float | None:
        vals = []
        for r in runs:
            try:
                v = fn(r)
            except (KeyError, TypeError, ValueError, IndexError):
                v = None
            if v is not None:
                vals.append(v)
        return median(vals)

    hs = [r for r in entry["runs"]["hotswap"] if not r.get("failed")]
    if hs:
        ev = lambda k: med_of(hs, lambda r: r["events"][k])  # noqa: E731
        ops = lambda f: med_of(hs, lambda r: f(sorted(r["log_milestones"]["comm_op_loaded"])))  # noqa: E731
        op_first, op_last = ops(lambda v: v[0]), ops(lambda v: v[-1])
        built = med_of(hs, lambda r: max(r["log_milestones"]["engine_built"]))
        pub = ev("assignment_published")
        out.append(
            "Where the hot-swap time goes (medians, seconds after the kill): the launcher sees the exit at "
            f"{_f(ev('launcher_detected'))} and publishes the new assignment at {_f(pub)}; the survivors leave "
            f"generation 0 at {_f(ev('survivor_noticed_first'))}-{_f(ev('survivor_noticed_last'))} (their step stopped "
            "by the launcher's notice, or a collective with the dead peer failing, whichever comes first), tear down "
            f"and have the new process group at {_f(ev('survivor_pg_ready_last'))}. They build a new model and call "
            "`deepspeed.initialize` again (without DeepSpeed's initial weight broadcast when every rank restores "
            f"next; the first DeepSpeed comm backend is up at {_f(op_first)}), then wait in its collectives for the "
            f"last process, whose backend is up at {_f(op_last)} "
            f"({_f(None if op_last is None or pub is None else op_last - pub)} s after the assignment; the spare "
            "imported DeepSpeed and transformers, built its first model and loaded the comm op while it waited, so "
            f"after its assignment it only forms the process group). All engines are built at {_f(built)} "
            "(`deepspeed.initialize` on the new world, "
            f"{_f(None if built is None or op_last is None else built - op_last)} s after the last backend); state is "
            f"restored at {_f(ev('survivor_restored_last'))} (restore phase "
            f"{_f(an['hotswap']['phases_median']['restore_s'])} s: scan + checksums of every held buffer, fetch of "
            f"rank 1's replica, restore); the redone step completes at {_f(an['hotswap']['raw_s']['median'])}.")
        out.append("")
    bl = [r for r in entry["runs"]["baseline"] if not r.get("failed")]
    if bl:
        opl = med_of(bl, lambda r: max(r["log_milestones"]["comm_op_loaded"]))
        built = med_of(bl, lambda r: max(r["log_milestones"]["engine_built"]))
        ready = med_of(bl, lambda r: r["log_milestones"]["first_pretrain_line"][0])
        bp = an["baseline"]["phases_median"]
        out.append(
            f"Where the baseline time goes (medians): torchrun exits {_f(bp['detect_s'])} s after the kill; in the "
            f"relaunched job (seconds after the relaunch) the last process loads DeepSpeed's comm op at {_f(opl)} "
            f"(interpreter start, imports, process group, model build), engines are built at {_f(built)} "
            f"(`deepspeed.initialize`, {_f(None if built is None or opl is None else built - opl)} s), rank 0 is ready "
            f"after `load_checkpoint` at {_f(ready)}, and the redone step takes {_f(bp['first_step_s'])} s more.")
        out.append("")
    return out


def _milestone_text(ms: dict[str, list[float]]) -> str:
    names = {"comm_op_loaded": "DeepSpeed comm op loaded (per process)", "engine_built": "engine built (per rank)",
             "deadpool_attached": "deadpool attached", "restore_plan": "restore plan",
             "first_pretrain_line": "first line of the training script"}
    return ", ".join(f"{names[k]} {', '.join(f'{x:.2f}' for x in v)}" for k, v in ms.items() if v and k in names)


def _vals(entry: dict[str, Any], kind: str, key: str) -> list[float]:
    return [r[key] for r in entry["runs"][kind] if r.get(key) is not None]


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.0f}%"


def _met(t: dict[str, Any]) -> str:
    if t.get("value", t.get("value_s")) is None:
        return "not measured"
    return "met" if t.get("met") else "not met"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


# ==================================================================================================
# main
# ==================================================================================================
def slim(run: dict[str, Any]) -> dict[str, Any]:
    """What goes into the JSON: everything but the raw output lines."""
    return {k: v for k, v in run.items() if k != "lines"}


def rerender(path: str) -> int:
    """Recompute the analysis and markdown of an existing results JSON (no jobs are run)."""
    with open(path) as fh:
        doc = json.load(fh)
    for size, entry in doc["sizes"].items():
        for r in entry["runs"]["hotswap"]:
            series = (r.get("memory") or {}).get("rss_series")
            if series and not r.get("rss_end"):  # runs before rss_end skipped samples taken while workers exited
                r["rss_end"] = {k: v * 2**20 for k, v in rss_end(series).items()}
        entry["analysis"] = analyze_size(size, entry)
    write_json(path, doc)
    md_path = os.path.splitext(path)[0] + ".md"
    write_text(md_path, render_markdown(doc))
    print(f"[bench] rewrote {path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,medium", help="comma-separated model sizes (tiny, small, medium)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 repeat")
    p.add_argument("--repeats", type=int, default=None, help="repeats per size (default: small 2, medium 1)")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (default: per size)")
    p.add_argument("--kill-step", type=int, default=None, help="kill after this step (>= 3; default 3)")
    p.add_argument("--steps-after", type=int, default=None, help="steps trained after the kill step")
    p.add_argument("--kill-delay-frac", type=float, default=0.5,
                   help="kill this fraction of a normal step after rank 0 logged the kill step")
    p.add_argument("--reference-sizes", default="tiny,small",
                   help="sizes that also get one uninterrupted reference run for the loss check ('' for none)")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of one job (default: per size)")
    p.add_argument("--recovery-timeout-s", type=float, default=120.0,
                   help="declare a job hung (dump stacks, stop it) when no step completes for this long after the kill")
    p.add_argument("--detect-wait-s", type=float, default=120.0,
                   help="baseline: how long to wait for torchrun to exit after the kill before killing it")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="before each job, wait at most this long for the shared machine to be quiet")
    p.add_argument("--settle-busy", type=float, default=0.35, help="'quiet' = CPU busy fraction below this")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--force-hotswap", action="store_true",
                   help="run the hot-swap job also for sizes marked as not fitting this machine (medium)")
    p.add_argument("--min-available-gib", type=float, default=1.5,
                   help="stop a job when the machine's MemAvailable falls below this (shared machine: keep the OOM "
                        "killer away from other people's processes)")
    p.add_argument("--name", default=None,
                   help="results file stem (default recovery[_quick]); must start with recovery")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--scratch-root", default=None,
                   help="parent of checkpoints and metrics (default $TMPDIR; a real disk)")
    p.add_argument("--keep-scratch", action="store_true")
    p.add_argument("--rerender", metavar="JSON", default=None,
                   help="recompute analysis and markdown of an existing results file, run nothing")
    args = p.parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)

    global MIN_AVAILABLE_BYTES
    MIN_AVAILABLE_BYTES = int(args.min_available_gib * 2**30)
    sizes = ["tiny"] if args.quick else [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in DEFAULTS:
            p.error(f"unknown size {s!r}; choose from {', '.join(DEFAULTS)}")
    stem = args.name or ("recovery_quick" if args.quick else "recovery")
    if not stem.startswith("recovery"):
        p.error("--name must start with recovery")
    out_dir = os.path.abspath(args.out)
    json_path, md_path = os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")
    logs = os.path.join(out_dir, f"{stem}_logs")
    os.makedirs(logs, exist_ok=True)
    command = shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]])
    t_start = time.time()
    doc: dict[str, Any] = {
        "benchmark": "recovery", "command": command, "machine": machine_info(),
        "targets": {"end_to_end_s": TARGET_E2E_S, "speedup": TARGET_SPEEDUP},
        "settings": {"nnodes": NNODES, "nproc_per_node": NPROC_PER_NODE, "spare_nodes": SPARE_NODES,
                     "killed": {"hotswap": KILL_WORKER, "baseline": f"RANK={KILL_RANK}"},
                     "kill_delay_frac": args.kill_delay_frac, "seed": args.seed,
                     "settle_s": args.settle_s, "settle_busy": args.settle_busy},
        "definitions": {
            "raw_s": "time of the first metrics record with step > last step completed before the kill, minus t_kill",
            "minus_step_s": "raw_s minus the median step_time_s of steps 2..K of the same job",
            "hotswap_phases": "deadpool_ext.recovery.timeline.phases() of the job's timeline; fault event at t_kill",
            "baseline_breakdown": "detect = kill -> torchrun exit; relaunch = exit -> new torchrun; startup_and_load = "
                                  "new torchrun -> rank 0's first line after load_checkpoint; first_step = that -> "
                                  "first completed step",
        },
        "sizes": {}, "notes": [],
    }
    scratch = tempfile.mkdtemp(prefix="bench_recovery.", dir=args.scratch_root)
    rc = 0
    try:
        for size in sizes:
            from deadpool_ext.training.models import MODEL_SIZES

            d = dict(DEFAULTS[size])
            for key, val in (("micro_batch", args.micro_batch), ("kill_step", args.kill_step),
                             ("steps_after", args.steps_after), ("repeats", args.repeats),
                             ("timeout_s", args.timeout_s)):
                if val is not None:
                    d[key] = val
            if d["kill_step"] < 3:
                p.error("--kill-step must be >= 3 (warm-up)")
            layers, hidden, heads, seq = MODEL_SIZES[size]
            entry: dict[str, Any] = {"settings": d, "seq_len": seq, "model": {"layers": layers, "hidden": hidden,
                                                                              "heads": heads},
                                     "runs": {"hotswap": [], "baseline": [], "reference": None}}
            doc["sizes"][size] = entry
            size_scratch = os.path.join(scratch, size)  # metrics files are appended to: never share them across sizes
            os.makedirs(size_scratch, exist_ok=True)
            try:
                for i in range(d["repeats"]):
                    # Alternate the order so slow drift of the shared machine does not favour one side.
                    order = ("hotswap", "baseline") if i % 2 == 0 else ("baseline", "hotswap")
                    for kind in order:
                        if kind == "hotswap" and d.get("hotswap_skip") and not args.force_hotswap:
                            if i == 0:
                                print(f"[bench] {size}: hot-swap not run: {d['hotswap_skip']}", flush=True)
                            continue
                        fn = run_hotswap if kind == "hotswap" else run_baseline
                        res = fn(size, d, size_scratch, f"{kind}_r{i}", args, logs)
                        entry["runs"][kind].append(slim(res))
                        _print_run(size, res)
                        _save(doc, entry, size, json_path, md_path, t_start)
                if size in [s for s in args.reference_sizes.split(",") if s]:
                    ref = run_reference(size, d, size_scratch, "reference", args, logs)
                    entry["runs"]["reference"] = slim(ref)
                    _save(doc, entry, size, json_path, md_path, t_start)
            except Exception as exc:  # noqa: BLE001 - record and go on to the next size
                import traceback

                entry["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                rc = 1
            recs = [r for r in entry["runs"]["hotswap"] if r.get("records")]
            entry["params"] = _params_from_logs(entry)
            if recs or entry["runs"]["baseline"]:
                _save(doc, entry, size, json_path, md_path, t_start)
                _print_summary(size, entry)
            if entry.get("analysis", {}).get("failed_runs"):
                rc = 1
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    doc["wall_s"] = time.time() - t_start
    write_json(json_path, doc)
    write_text(md_path, render_markdown(doc))
    print(f"[bench] wrote {os.path.relpath(json_path, REPO)} and {os.path.relpath(md_path, REPO)} "
          f"({doc['wall_s']:.0f} s)", flush=True)
    return rc


def _params_from_logs(entry: dict[str, Any]) -> int | None:
    for r in entry["runs"]["hotswap"] + entry["runs"]["baseline"]:
        for key in ("log", "job1"):
            path = r.get("log") if key == "log" else (r.get("job1") or {}).get("log")
            if path and os.path.exists(os.path.join(REPO, path)):
                with open(os.path.join(REPO, path)) as fh:
                    mt = re.search(r"\[pretrain_gpt\] \S+: ([\d.]+)M params", fh.read())
                if mt:
                    return int(float(mt.group(1)) * 1e6)
    return None


def _save(doc: dict[str, Any], entry: dict[str, Any], size: str, json_path: str, md_path: str, t_start: float) -> None:
    entry["params"] = _params_from_logs(entry)
    try:
        entry["analysis"] = analyze_size(size, entry)
    except Exception as exc:  # noqa: BLE001 - a partial result still gets written
        entry["analysis"] = None
        entry["analysis_error"] = f"{type(exc).__name__}: {exc}"
    doc["wall_s"] = time.time() - t_start
    write_json(json_path, doc)
    write_text(md_path, render_markdown(doc))


def _print_run(size: str, r: dict[str, Any]) -> None:
    if r.get("failed"):
        print(f"[bench] {size} {r['tag']}: FAILED: {r['failed']} (log "
              f"{r.get('log') or (r.get('job1') or {}).get('log')})",
              flush=True)
    if r.get("raw_s") is None:
        return
    extra = ""
    if r["kind"] == "hotswap" and r.get("phases"):
        ph = r["phases"]
        extra = " phases " + " ".join(f"{k[:-2]} {_f(ph.get(k))}" for k in
                                      ("detect_s", "agree_s", "rebuild_s", "restore_s", "recompute_s", "total_s"))
    elif r["kind"] == "baseline":
        extra = " " + " ".join(f"{k[:-2]} {_f(v)}" for k, v in r["breakdown"].items())
    print(f"[bench] {size} {r['tag']}: raw {r['raw_s']:.2f} s, minus step {_f(r.get('minus_step_s'))} s "
          f"(step {_f(r.get('normal_step_s'))} s; wall {r.get('wall_s', 0):.0f} s);{extra}", flush=True)


def _print_summary(size: str, entry: dict[str, Any]) -> None:
    an = entry.get("analysis")
    if not an:
        print(f"[bench] {size}: no analysis ({entry.get('analysis_error') or entry.get('error')})", flush=True)
        return
    print(f"[bench] {size}: hot-swap raw {_f(an['hotswap']['raw_s']['median'])} s (minus step "
          f"{_f(an['hotswap']['minus_step_s']['median'])}), baseline raw {_f(an['baseline']['raw_s']['median'])} s "
          f"(minus step {_f(an['baseline']['minus_step_s']['median'])}); speedup {_f(an['speedup_raw'])}x raw, "
          f"{_f(an['speedup_minus_step'])}x minus step; losses identical: {an['losses_identical']}", flush=True)
    for name, t in an["targets"].items():
        print(f"    target {name}: {'met' if t['met'] else 'NOT met'} ({t})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
