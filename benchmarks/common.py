"""Helpers shared by the benchmarks in this folder: statistics, machine description, process memory, and
writing results as JSON plus a markdown summary.

Import from a benchmark script that lives beside this file::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import machine_info, summarize, write_json, write_text, md_table

Nothing here imports torch or DeepSpeed at module level, so the helpers are cheap to import from a launcher.
"""
from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")


# -- statistics ---------------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method), ``q`` in [0, 100]; None for no values."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 50.0)


def p90(values: Iterable[float]) -> float | None:
    return percentile(values, 90.0)


def summarize(values: Iterable[float]) -> dict[str, Any]:
    """n, median, p90, mean, min, max of a list of numbers (None entries when empty)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "p90": None, "mean": None, "min": None, "max": None}
    return {"n": len(vals), "median": median(vals), "p90": p90(vals), "mean": sum(vals) / len(vals),
            "min": min(vals), "max": max(vals)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def bootstrap_ratio_ci(a: Sequence[float], b: Sequence[float], *, level: float = 0.90, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap confidence interval of median(a) / median(b), resampling each list independently
    (deterministic: fixed seed). A rough guide to how well a ratio is resolved by so few steps, not a test."""
    import random

    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(seed)
    out = []
    for _ in range(resamples):
        ma = median(rng.choice(a) for _ in a)
        mb = median(rng.choice(b) for _ in b)
        if mb:
            out.append(ma / mb)
    tail = (1 - level) / 2 * 100
    return percentile(out, tail), percentile(out, 100 - tail)


def bootstrap_median_ci(values: Sequence[float], *, level: float = 0.90, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap confidence interval of the median of ``values`` (e.g. per-round paired ratios:
    each round's mode / baseline, measured side by side, so the machine's drift cancels within a pair)."""
    import random

    if len(values) < 2:
        return None
    rng = random.Random(seed)
    meds = sorted(median(rng.choice(values) for _ in values) or 0.0 for _ in range(resamples))
    tail = (1 - level) / 2 * 100
    return percentile(meds, tail), percentile(meds, 100 - tail)


def make_dlrover_checkpointer(engine: Any, directory: str) -> tuple[Any, str]:
    """DLRover's flash checkpoint for a DeepSpeed engine (``DeepSpeedCheckpointer``), with the one shim DLRover
    0.6.1 needs under DeepSpeed 0.19; returns (checkpointer, note on the shim). Raises ImportError without DLRover
    (``pip install dlrover==0.6.1``)."""
    from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer

    ckpt = DeepSpeedCheckpointer(engine, directory)
    # DLRover 0.6.1 swaps torch.save for its agent's save(state_dict, path) while the engine saves; DeepSpeed
    # 0.19's TorchCheckpointEngine also passes _use_new_zipfile_serialization, which that signature rejects
    # (TypeError). Drop the keyword: the agent copies tensors to shared memory and never serializes.
    agent = ckpt._ckpt_agent
    agent_save = agent.save
    agent.save = lambda state_dict, path, **_ignored: agent_save(state_dict, path)
    return ckpt, ("DLRover 0.6.1's torch.save replacement rejects DeepSpeed 0.19's _use_new_zipfile_serialization "
                  "keyword; the benchmark drops it")


def dlrover_save_memory(ckpt: Any, directory: str, tag: str) -> None:
    """One DLRover flash checkpoint into shared memory (``StorageType.MEMORY``: its saver persists on request)."""
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

    ckpt.save_checkpoint(directory, tag=tag, storage_type=StorageType.MEMORY)


# -- machine and process ------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "?"))
    except Exception:  # noqa: BLE001 - a missing optional package is reported as None
        return None


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except Exception:  # noqa: BLE001
            return None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def tree_digest(path: str, suffixes: tuple[str, ...] = (".py",), exclude: tuple[str, ...] = ()) -> str:
    """sha256 (16 hex digits) over the relative paths and contents of the files under ``path``, less the folders
    ``exclude`` names (relative to ``path``): ties a result to the exact code it measured, including uncommitted
    changes."""
    import hashlib

    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        rel = os.path.relpath(root, path)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__"
                         and os.path.normpath(os.path.join(rel, d)) not in exclude)
        for f in sorted(files):
            if f.endswith(suffixes):
                full = os.path.join(root, f)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                with open(full, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


SIM = "sim"
"""The simulator (``deadpool_ext/sim``): calibrated from the measured results, it is not code they measure, so its
own digest is apart (a re-calibration would otherwise mark every measured figure stale)."""


def source_digests() -> dict[str, str]:
    """``deadpool_ext`` (the measured code, less the simulator) and ``deadpool_ext/sim`` (what a simulation ran)."""
    root = os.path.join(REPO, "deadpool_ext")
    return {"deadpool_ext": tree_digest(root, exclude=(SIM,)),
            f"deadpool_ext/{SIM}": tree_digest(os.path.join(root, SIM))}


def deadpool_defaults() -> dict[str, Any] | None:
    """Every key of the "deadpool" config section at its default, resolved by the code in this checkout."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    try:
        from deadpool_ext.config import DeadpoolConfig
    except ImportError:
        return None
    return DeadpoolConfig().to_dict()


def machine_info(packages: Sequence[str] = ("torch", "deepspeed", "transformers", "numpy")) -> dict[str, Any]:
    """Where and with what a benchmark ran: CPU count (and the cores this process may use), memory, load,
    package versions, git commit."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "mem_total_bytes": _meminfo().get("MemTotal"),
        "mem_available_bytes": _meminfo().get("MemAvailable"),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {p: _version(p) for p in packages},
        "git": git_info(),
        "source_digest": source_digests(),
        # today's defaults of every key of the "deadpool" section: a headline measured under a default that has
        # changed since is stale (tests/unit/test_headlines.py names it)
        "deadpool_defaults": deadpool_defaults(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of one process from /proc/<pid>/status, in bytes: rss (= anon + file + shmem), the three
    parts, and the peak (hwm). Pages of mapped /dev/shm files this process touched count in ``rss_shmem``."""
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem", "VmHWM": "hwm"}
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[keys[key]] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def system_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat; the busy fraction of an interval
    is d(busy) / d(total) between two calls."""
    try:
        with open("/proc/stat") as fh:
            vals = [float(v) for v in fh.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def busy_fraction(start: tuple[float, float], end: tuple[float, float]) -> float | None:
    """Fraction of the machine's CPU time that was busy between two :func:`system_cpu` readings."""
    total = end[1] - start[1]
    return None if total <= 0 else (end[0] - start[0]) / total


def mapped_files(pid: int, prefix: str) -> set[str]:
    """Paths starting with ``prefix`` that process ``pid`` has mapped (from /proc/<pid>/maps; empty if gone)."""
    out: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                idx = line.find(prefix)
                if idx >= 0:
                    out.add(line[idx:].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:
        pass
    return out


def dir_bytes(path: str) -> int:
    """Bytes actually allocated by the files under ``path`` (st_blocks, so sparse files count what they hold)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


# -- output -------------------------------------------------------------------------------------------
def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (temp file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False, default=_json_default)
        fh.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are str()-ed, None shows as an em dash."""
    def cell(v: Any) -> str:
        return "—" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_s(seconds: float | None, digits: int = 3) -> str | None:
    if seconds is None:
        return None
    if seconds < 1:
        return f"{seconds * 1000:.{max(0, digits - 2)}f} ms" if seconds >= 0.01 else f"{seconds * 1000:.2f} ms"
    return f"{seconds:.{digits - 1}f} s"


def fmt_bytes(n: float | None) -> str | None:
    if n is None:
        return None
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_ratio(r: float | None, digits: int = 3) -> str | None:
    return None if r is None else f"{r:.{digits}f}"


def fmt_pct(x: float | None, digits: int = 1) -> str | None:
    return None if x is None else f"{100 * x:.{digits}f}%"


def add_output_args(p: Any, name: str) -> None:
    """``--name``, ``--out`` and ``--render-only JSON``: a benchmark that writes ``<out>/<name>.json`` and ``.md``."""
    p.add_argument("--name", default=name, help=f"results file stem (default {name})")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--render-only", metavar="JSON", help="rewrite the markdown beside a results file, run nothing")


def render_only(path: str, render: Callable[[dict[str, Any]], str]) -> int:
    """Rewrite the markdown beside a results JSON from the document as saved (the JSON is left as it is)."""
    with open(path) as fh:
        doc = json.load(fh)
    write_text(os.path.splitext(path)[0] + ".md", render(doc))
    return 0


def save_result(out: str, name: str, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """Write ``<out>/<name>.json`` and its markdown; returns the markdown."""
    md = render(doc)
    write_json(os.path.join(out, f"{name}.json"), doc)
    write_text(os.path.join(out, f"{name}.md"), md)
    return md

