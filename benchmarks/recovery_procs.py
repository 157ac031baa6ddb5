"""bench_recovery, the processes of one job: sampling, logging, fault injection, hang detection.

Nothing here knows about hot-swap or the baseline. It runs a command with a deadline and time-stamps its output,
watches the job's worker processes (RSS, the DeepSpeed /dev/shm buffers they map, the machine's load), SIGKILLs
one worker at a chosen point of the step cycle, and declares a job hung when no step completes.
``recovery_run.py`` builds the jobs from these pieces. Split out of the single-file ``bench_recovery.py``
without changing what it does.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from outside benchmarks/ (a test, run_all): common.py lives beside this file
    sys.path.insert(0, HERE)
from common import REPO, busy_fraction, dir_bytes, mapped_files, median, process_memory, system_cpu, write_text  # noqa: E402

from deadpool_ext.rebuild.warm import PARENT_NAME as WARM_PARENT  # noqa: E402

# Default of ``--min-available-gib`` (1.5 GiB). The machine is shared: a job is stopped before the kernel's OOM
# killer could pick someone else's process.
DEFAULT_MIN_AVAILABLE_BYTES = int(1.5 * 2**30)


class Monitor:
    """Samples a job while it runs: its worker processes (labelled by an environment variable), their RSS and peak
    RSS, the DeepSpeed /dev/shm buffers they map (to remove exactly those afterwards), the bytes under the job's
    shm root, and the machine's CPU busy fraction."""

    def __init__(self, root_pid: int, label_env: str, shm_root: str | None = None, interval_s: float = 1.0, *,
                 script: str, min_available_bytes: int = DEFAULT_MIN_AVAILABLE_BYTES) -> None:
        self.root_pid, self.label_env, self.shm_root, self.interval_s = root_pid, label_env, shm_root, interval_s
        # Passed in rather than read from module globals, so this module needs nothing of the benchmark's settings:
        # ``script`` is the training script (a child running anything else is not a worker), ``min_available_bytes``
        # the memory guard of --min-available-gib.
        self.script_name = os.path.basename(script)
        self.min_available_bytes = min_available_bytes
        self.labels: dict[int, str | None] = {}
        self.peak_hwm: dict[str, int] = {}
        self.peak_rss_sum = 0
        self.peak_shm_bytes = 0
        self.ds_shm: set[str] = set()
        self.cpu: list[tuple[float, float, float]] = [(time.time(), *system_cpu())]
        self.series: list[tuple[float, dict[str, int]]] = []  # (time, {label: rss bytes}) per sample
        # (time, {label: {part: bytes}}) per sample, the parts of rss: anonymous memory (the heap, tensors) and the
        # /dev/shm pages it touched (snapshot slots, replicas), which grow and shrink for different reasons
        self.parts: list[tuple[float, dict[str, dict[str, int]]]] = []
        self.min_available: int | None = None
        self.low_memory: str | None = None
        self._last = 0.0

    def _children(self) -> list[Any]:
        import psutil

        try:
            # Workers are the launcher's (torchrun's, deadpool-run's) direct children. Not recursive: a worker's own
            # children inherit its environment and would carry its label (a first run of this benchmark SIGKILLed
            # such a process instead of the worker, and no fault happened). A spare's warm parent stands for its
            # child, the process that runs the script (rebuild/warm.py).
            out = []
            for p in psutil.Process(self.root_pid).children(recursive=False):
                try:
                    out += p.children(recursive=False)[:1] if p.name() == WARM_PARENT else [p]
                except psutil.Error:
                    continue
            return out
        except psutil.NoSuchProcess:
            return []

    def workers(self) -> dict[str, int]:
        """label -> pid of the live worker processes (direct children of the root running the training script)."""
        out: dict[str, int] = {}
        for p in self._children():
            if p.pid not in self.labels:
                try:
                    cmd = p.cmdline()
                    if not any(os.path.basename(c) == self.script_name for c in cmd):
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
        parts: dict[str, dict[str, int]] = {}
        for label, pid in self.workers().items():
            mem = process_memory(pid)
            rss[label] = mem.get("rss", 0)
            parts[label] = {k: mem.get(k, 0) for k in ("rss_anon", "rss_shmem", "rss_file")}
            rss_sum += mem.get("rss", 0)
            self.peak_hwm[label] = max(self.peak_hwm.get(label, 0), mem.get("hwm", 0))
            self.ds_shm |= mapped_files(pid, "/dev/shm/deepspeed_")
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
        self.series.append((now, rss))
        self.parts.append((now, parts))
        avail = _mem_available()
        if avail is not None:
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            if avail < self.min_available_bytes and self.low_memory is None:
                # The machine is shared: stop this job before the kernel's OOM killer picks someone else's process.
                self.low_memory = (f"stopped by the benchmark: MemAvailable {avail / 2**30:.2f} GiB < "
                                   f"{self.min_available_bytes / 2**30:.2f} GiB "
                                   f"(workers' RSS {rss_sum / 2**30:.2f} GiB)")
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

    def rss_median(self, t0: float, t1: float) -> dict[str, int]:
        """Each worker's median RSS over the samples in [``t0``, ``t1``]: over a window of a few steps, the RSS at no
        particular phase of a step (one sample's is that of the phase it fell in: activations, gathered parameters
        and buffers in flight come and go within a step)."""
        return window_median([r for ts, r in self.series if t0 <= ts <= t1])

    def part_median(self, t0: float, t1: float, part: str) -> dict[str, int]:
        """As ``rss_median``, of one part of RSS (``rss_anon``, ``rss_shmem``, ``rss_file``)."""
        return window_median([{k: v[part] for k, v in r.items()} for ts, r in self.parts if t0 <= ts <= t1])

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


def window_median(samples: list[dict[str, int]]) -> dict[str, int]:
    """Pure: per label, the median of its values over ``samples`` (labels seen in any)."""
    labels = {k for r in samples for k in r}
    return {k: int(median([r[k] for r in samples if k in r])) for k in sorted(labels)}


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


def normal_step_s(records: list[dict[str, Any]], upto: int) -> float | None:
    """Median step time of steps 2..upto (step 1 is warm-up); all steps if that leaves none."""
    vals = [r["step_time_s"] for r in records if 2 <= r["step"] <= upto]
    return median(vals or [r["step_time_s"] for r in records if r["step"] <= upto])


def steady_step_s(records: list[dict[str, Any]], redone: set[int] | list[int],
                  after: list[dict[str, Any]] | None = None) -> float | None:
    """One normal step, as the recovery figures subtract it: the median step time of every step but the warm-up
    step 1 and the steps a failure made redo (``redone``: each first step completed after a kill). ``after``: the
    records of a relaunched job, whose first step is its own warm-up and is left out the same way. Steps 2..K
    alone are not enough: step 2 carries the first replication's page faults (the replica buffers), and with K = 3
    it is half the sample."""
    vals = [r["step_time_s"] for r in records if r["step"] >= 2 and r["step"] not in redone]
    if after:
        first = min(r["step"] for r in after)
        vals += [r["step_time_s"] for r in after if r["step"] > first and r["step"] not in redone]
    return median(vals) if vals else None


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
