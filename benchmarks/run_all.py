#!/usr/bin/env python
"""Run every benchmark, then write ``benchmarks/results/REPORT.md`` with plots.

    python benchmarks/run_all.py --quick           # laptop smoke run (~10-15 min on 2 cores), outputs in results/quick/
    python benchmarks/run_all.py                   # the full runs (an hour or more on 2 cores), outputs in results/
    python benchmarks/run_all.py --report-only     # re-render REPORT.md and its figures from the JSON present

Convention for benchmarks (how a new one joins): a file ``benchmarks/bench_<name>.py`` that accepts ``--quick`` (a
small, fast run) and ``--out DIR`` (where to write ``<name>.json`` / ``<name>_quick.json`` and markdown). It is
discovered by name and run as ``python bench_<name>.py [--quick] --out DIR`` under ``nice``, one at a time (they
are sized for the whole machine), with a deadline. A script without ``--out`` is not run (it would overwrite the
committed results of a full run); the report still reads the results it wrote itself.

The report reads, per benchmark, the newest applicable file: this run's output first, then the current results
in ``benchmarks/results`` (the files ``results/INDEX.md`` names, ``CURRENT`` in ``results_index.py``; recovery has
two, small and medium), then a ``<name>.json`` / ``<name>_quick.json`` there; every figure names the file, machine,
model, layout and command it came from, and says "not measured yet" where nothing is there. Paths in the report
are relative to the repository (commands recorded with absolute paths are shown relative), so it names no machine
path.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, RESULTS_DIR, machine_info, write_json, write_text  # noqa: E402
from headlines import render as render_headlines  # noqa: E402
from results_index import current_stems  # noqa: E402

ORDER = ("simulate", "snapshot_overhead", "peers", "recovery", "persist", "megatron")
"""Benchmarks run first to last in this order; others discovered later run after them, alphabetically."""
QUICK_DEADLINE_S, FULL_DEADLINE_S = 900, 7200
PEER_MODES = ("deadpool", "ds_default", "ds_decoupled", "dcp_async", "dlrover_flash")


@dataclass(frozen=True, slots=True)
class Bench:
    name: str
    path: str
    quick: bool
    """Accepts ``--quick``."""
    out: bool
    """Accepts ``--out DIR``."""


def discover(directory: str = HERE) -> list[Bench]:
    """``bench_*.py`` files in ``directory`` and whether they follow the convention (read from their argparse
    calls, without importing them: importing a benchmark may import torch)."""
    found = []
    for path in glob.glob(os.path.join(directory, "bench_*.py")):
        with open(path) as fh:
            src = fh.read()
        name = os.path.basename(path)[len("bench_"):-len(".py")]
        found.append(Bench(name, path, bool(re.search(r"add_argument\(\s*['\"]--quick['\"]", src)),
                           bool(re.search(r"add_argument\(\s*['\"]--out['\"]", src))))
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(found, key=lambda b: (rank.get(b.name, len(ORDER)), b.name))


def command(b: Bench, quick: bool, out_dir: str) -> list[str] | str:
    """The command line for one benchmark, or the reason it is not run."""
    if not b.out:
        return "does not accept --out (running it would overwrite committed results); run it by hand"
    if quick and not b.quick:
        return "has no --quick mode"
    return ["nice", "-n", "10", sys.executable, b.path, *(["--quick"] if quick else []), "--out", out_dir]


def run_benchmarks(benches: list[Bench], quick: bool, out_dir: str, deadline_s: float) -> list[dict[str, Any]]:
    runs = []
    for b in benches:
        cmd = command(b, quick, out_dir)
        if isinstance(cmd, str):
            print(f"[run_all] skip {b.name}: {cmd}", flush=True)
            runs.append({"benchmark": b.name, "skipped": cmd})
            continue
        print(f"[run_all] {b.name}: {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        log_path = os.path.join(out_dir, f"run_all_{b.name}.log")
        # A new session, so a deadline kills the benchmark's whole process tree (torchrun and its workers).
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
                print(f"[run_all] {b.name}: deadline of {deadline_s:.0f} s passed, stopped", flush=True)
        runs.append({"benchmark": b.name, "command": shlex.join(cmd), "returncode": rc, "wall_s": time.time() - t0,
                     "log": os.path.relpath(log_path, os.path.dirname(HERE))})
        print(f"[run_all] {b.name}: rc={rc} in {time.time() - t0:.0f} s", flush=True)
    return runs


# -- results -------------------------------------------------------------------------------------------
class Found(tuple):
    """``(path, document)`` of a benchmark's preferred results file, so figures unpack it as before; ``files``
    holds every file the report uses for that benchmark, preferred first (the current recovery results are two
    files: small and medium)."""

    files: list[tuple[str, dict]]

    def __new__(cls, files: list[tuple[str, dict]]) -> Found:
        self = super().__new__(cls, files[0])
        self.files = list(files)
        return self


def _read(path: str) -> tuple[str, dict] | None:
    try:
        with open(path) as fh:
            return path, json.load(fh)
    except (OSError, ValueError):
        return None


def find_results(name: str, out_dir: str, quick: bool, results_dir: str = RESULTS_DIR) -> Found | None:
    """The results files of one benchmark the report reads, or None: this run's output (``<out>/<name>.json``,
    ``<name>_quick.json`` with --quick) unless that is itself a current file; else the current files named in
    results_index.CURRENT; else ``<name>.json`` or ``<name>_quick.json`` in ``results_dir``."""
    current = [os.path.join(results_dir, f"{stem}.json") for stem in current_stems(name)]
    fresh = os.path.join(out_dir, f"{name}_quick.json" if quick else f"{name}.json")
    if os.path.abspath(fresh) not in {os.path.abspath(c) for c in current} and (r := _read(fresh)):
        return Found([r])
    docs = [r for c in current if (r := _read(c))]
    if docs:
        return Found(docs)
    for path in (os.path.join(results_dir, f"{name}.json"), os.path.join(results_dir, f"{name}_quick.json")):
        if r := _read(path):
            return Found([r])
    return None


def find_result(name: str, out_dir: str, quick: bool, results_dir: str = RESULTS_DIR) -> Found | None:
    """The preferred results file of a benchmark, ``(path, document)`` (``.files``: all of them), or None."""
    return find_results(name, out_dir, quick, results_dir)


_REPO_PARTS = ("benchmarks", "configs", "scripts", "deadpool_ext", "tests", "docs")


def clean(text: str) -> str:
    """A recorded command or path without machine paths: an absolute path into a checkout (this one or another
    engineer's) becomes repository-relative, the interpreter becomes ``python``, a scratch path under /tmp becomes
    ``$TMPDIR/...``. The report is committed, and read on other machines."""
    def one(tok: str) -> str:
        if not tok.startswith("/"):
            return tok
        parts = tok.split("/")
        for i, part in enumerate(parts):
            if part in _REPO_PARTS and i > 1:
                return "/".join(parts[i:])
        if os.path.basename(tok).startswith("python"):
            return "python"
        if tok.startswith("/tmp/"):
            return "$TMPDIR/" + tok[len("/tmp/"):]
        return tok

    return re.sub(r"(?<![\w.$])/[^\s`'\"]+", lambda m: one(m.group(0)), text)


def _rel(path: str) -> str:
    """A path as the report shows it: relative to the repository when inside it, never a machine path."""
    rel = os.path.relpath(path, REPO)
    return clean(path if rel.startswith("..") else rel)


def _get(obj: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(obj, dict) or p not in obj:
            return None
        obj = obj[p]
    return obj


def _walk(obj: Any, keys: tuple[str, ...]) -> list[dict]:
    """Every dict inside ``obj`` holding all of ``keys`` (how the report finds fields in other benchmarks' JSON
    without depending on their nesting)."""
    out = []
    if isinstance(obj, dict):
        if all(k in obj for k in keys):
            out.append(obj)
        for v in obj.values():
            out += _walk(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            out += _walk(v, keys)
    return out


def _machine(doc: dict) -> str:
    m = doc.get("machine") or {}
    if isinstance(m, str):  # a hand-written description
        return m
    load = m.get("loadavg")
    load_text = ", ".join(f"{x:.1f}" for x in load) if isinstance(load, list) else "?"
    return f"{m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores, load {load_text}"


# -- figures (each returns (png path or None, caption lines)) ---------------------------------------------
def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _save(fig, path: str, source: str, doc: dict, model: str, more: list[tuple[str, dict]] = ()) -> None:
    """Save a figure with a footer naming its data: file, machine, model, command (``more``: further files)."""
    import textwrap

    # Long machine/model/command lines wrap instead of running off the figure's edge.
    width = int(fig.get_figwidth() * 21)
    parts = [f"{os.path.basename(source)}: {_machine(doc)}; {model}", f"command: {clean(doc.get('command', '?'))}"]
    for src, d in more:
        parts += [f"{os.path.basename(src)}: {_machine(d)}", f"command: {clean(d.get('command', '?'))}"]
    text = "\n".join(textwrap.fill(part, width) for part in parts)
    fig.text(0.01, 0.01, text, fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.04 + 0.035 * text.count("\n"), 1, 1))
    fig.savefig(path, dpi=120)


def _peers_model(doc: dict) -> str:
    r = doc.get("result") or {}
    lay = r.get("layout") or {}
    return (f"GPT {r.get('size')} ({(r.get('params') or 0) / 1e6:.1f}M), ZeRO-3 fp32, {lay.get('nproc')} CPU ranks "
            f"as {lay.get('simulated_nodes')} simulated nodes")


def fig_overhead(found: dict, out: str, stem: str) -> tuple[str | None, str]:
    src = found.get("peers")
    plt = _plt()
    if not src or not _get(src[1], "analysis") or plt is None:
        return None, "peers benchmark: not measured yet" if plt else "matplotlib not installed"
    path, doc = src
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in PEER_MODES:
        pts = sorted((a["interval"], a["ratio_to_none"]) for a in doc["analysis"].values()
                     if a["mode"] == mode and a["ratio_to_none"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("checkpoint interval (iterations)")
    ax.set_ylabel("step-time ratio to no checkpointing")
    ax.set_title("Failure-free overhead vs checkpoint interval (A/B interleaved, one job)", fontsize=10)
    ax.legend(fontsize=8)
    png = os.path.join(out, f"{stem}_overhead_vs_interval.png")
    _save(fig, png, path, doc, _peers_model(doc))
    plt.close(fig)
    return png, f"from `{os.path.relpath(path, os.path.dirname(HERE))}`"


def fig_blocking(found: dict, out: str, stem: str) -> tuple[str | None, str]:
    plt = _plt()
    rows = []  # (label, seconds)
    src = found.get("peers")
    if src and _get(src[1], "analysis"):
        for a in src[1]["analysis"].values():
            if a["mode"] != "none" and a["interval"] == 1 and a["blocking_s"]["median"] is not None:
                rows.append((f"{a['mode']} (peers)", a["blocking_s"]["median"]))
    snap = found.get("snapshot_overhead")
    for size, e in (_get(snap[1], "sizes") or {}).items() if snap else []:
        for mode, a in (_get(e, "analysis", "modes") or {}).items():
            med = _get(a, "blocking_s", "median")
            if med is not None:
                rows.append((f"{mode} ({size})", med))
    if not rows or plt is None:
        return None, "not measured yet" if plt else "matplotlib not installed"
    doc, path = (src or snap)[1], (src or snap)[0]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.28 * len(rows)))
    ax.barh([r[0] for r in rows], [max(r[1], 1e-5) for r in rows], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("training thread blocked per checkpoint (s, median, log scale)")
    ax.invert_yaxis()
    _save(fig, os.path.join(out, f"{stem}_blocking.png"), path, doc,
          "peers and snapshot_overhead runs (see their JSON for model and layout)", more=[snap] if src and snap else [])
    plt.close(fig)
    files = [_rel(s[0]) for s in (src, snap) if s]
    return os.path.join(out, f"{stem}_blocking.png"), "from " + ", ".join(f"`{f}`" for f in files)


def fig_recovery(found: dict, out: str, stem: str) -> tuple[str | None, str]:
    plt = _plt()
    src = found.get("recovery")
    bars: list[tuple[str, dict[str, float]]] = []
    for size, e in [(s_, e_) for _, d in (src.files if src else []) for s_, e_ in (_get(d, "sizes") or {}).items()]:
        for job in ("hotswap", "baseline"):
            ph = {k: v for k, v in (_get(e, "analysis", job, "phases_median") or {}).items()
                  if k != "total_s" and isinstance(v, (int, float))}
            if ph:
                bars.append((f"{job} ({size})", ph))
    meg = found.get("megatron")
    meg_rows = (_get(meg[1], "recovery", "phases") or [])[:1] if meg else []
    for row in meg_rows:
        bars.append(("hotswap (megatron)", {k: v for k, v in row.items() if k.endswith("_s") and k != "total_s"
                                            and isinstance(v, (int, float))}))
    if not bars or plt is None:
        return None, "recovery benchmark: not measured yet" if plt else "matplotlib not installed"
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.45 * len(bars)))
    phases = list(dict.fromkeys(k for _, ph in bars for k in ph))
    cmap = plt.get_cmap("tab10")
    left = [0.0] * len(bars)
    for i, phase in enumerate(phases):
        vals = [ph.get(phase, 0.0) for _, ph in bars]
        ax.barh([b[0] for b in bars], vals, left=left, label=phase.removesuffix("_s"), color=cmap(i % 10))
        left = [a + v for a, v in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds from SIGKILL (median per phase)")
    ax.legend(fontsize=7, ncol=4)
    path, doc = src or meg
    used = (src.files if src else []) + ([meg] if meg_rows else [])
    _save(fig, os.path.join(out, f"{stem}_recovery.png"), path, doc, "GPT small/medium, ZeRO-3, 3 nodes + 1 spare",
          more=used[1:])
    plt.close(fig)
    return os.path.join(out, f"{stem}_recovery.png"), "from " + ", ".join(f"`{_rel(p_)}`" for p_, _ in used)


def fig_persist(found: dict, out: str, stem: str) -> tuple[str | None, str]:
    plt = _plt()
    src, dif = found.get("persist"), found.get("differential")
    tp = _walk(src[1], ("disk_bw_MB_s", "persist_idle_MB_s")) if src else []
    # Differential vs base sizes: bench_differential's blobs (one per ZeRO stage), else any pair in persist.json.
    sizes = [{"base_bytes": r["base_blob_bytes"], "diff_bytes": r["diff_blob_bytes"],
              "label": f"ZeRO-{r.get('zero_stage', '?')}"
                       + (f", {r['adam_kernel']} Adam" if "adam_kernel" in r else "")}
             for r in _walk(dif[1], ("base_blob_bytes", "diff_blob_bytes"))
             ] if dif else []
    sizes = sizes or (_walk(src[1], ("base_bytes", "diff_bytes")) if src else [])
    if (not tp and not sizes) or plt is None:
        return None, "persist and differential benchmarks: not measured yet" if plt else "matplotlib not installed"
    path, doc = src or dif
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    if tp:
        a = tp[0]
        labels = ["disk (same run)", "persist, idle", "persist, training"]
        vals = [a.get("disk_bw_MB_s"), a.get("persist_idle_MB_s"), a.get("persist_training_MB_s")]
        axes[0].bar(labels, [v or 0 for v in vals], color=["gray", "tab:green", "tab:olive"])
        axes[0].set_ylabel("MB/s")
        axes[0].set_title("Persist throughput vs disk bandwidth", fontsize=9)
        axes[0].tick_params(axis="x", labelsize=7)
    if sizes:
        import numpy as np

        x = np.arange(len(sizes))
        axes[1].bar(x - 0.2, [s["base_bytes"] / 1e6 for s in sizes], 0.4, label="base", color="tab:blue")
        axes[1].bar(x + 0.2, [s["diff_bytes"] / 1e6 for s in sizes], 0.4, label="differential", color="tab:orange")
        axes[1].set_xticks(x, [s.get("label", "") for s in sizes])
        axes[1].set_ylabel("MB per version (largest rank)")
        axes[1].set_title("Differential vs base size", fontsize=9)
        axes[1].legend(fontsize=7)
    else:
        axes[1].text(0.5, 0.5, "differential sizes:\nnot measured yet", ha="center", va="center")
        axes[1].set_axis_off()
    if not tp:
        axes[0].text(0.5, 0.5, "persist throughput:\nnot measured yet", ha="center", va="center")
        axes[0].set_axis_off()
    model = "tier 3 on local disk (persist.md)" + (f"; differentials: {dif[1].get('model')}, {dif[1].get('layout')}"
                                                   if dif else "")
    _save(fig, os.path.join(out, f"{stem}_persist.png"), path, doc, model)
    plt.close(fig)
    files = [_rel(s_[0]) for s_ in (src, dif) if s_]
    return os.path.join(out, f"{stem}_persist.png"), "from " + ", ".join(f"`{f}`" for f in files)


def fig_memory(found: dict, out: str, stem: str) -> tuple[str | None, str]:
    plt = _plt()
    src = found.get("snapshot_overhead")
    rows = []
    for size, e in (_get(src[1], "sizes") or {}).items() if src else []:
        for r in (_get(e, "analysis", "memory", "per_rank") or [])[:1]:
            rows.append((size, r.get("state_bytes", 0), r.get("slot_bytes") or [], r.get("replica_bytes", 0)))
    if not rows or plt is None:
        return None, "snapshot_overhead benchmark: not measured yet" if plt else "matplotlib not installed"
    path, doc = src
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r[0] for r in rows]
    ax.bar(xs, [r[1] / 2**20 for r in rows], label="rank state", color="tab:gray")
    ax.bar(xs, [sum(r[2]) / 2**20 for r in rows], bottom=[r[1] / 2**20 for r in rows], label="tier 1 slots (2)",
           color="tab:blue")
    ax.bar(xs, [r[3] / 2**20 for r in rows], bottom=[(r[1] + sum(r[2])) / 2**20 for r in rows],
           label="tier 2 replicas held", color="tab:green")
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title("Memory: state vs snapshot memory per rank", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, os.path.join(out, f"{stem}_memory.png"), path, doc, "GPT small/medium, ZeRO-3, 4 ranks, 2 sim. nodes")
    plt.close(fig)
    return os.path.join(out, f"{stem}_memory.png"), f"from `{_rel(path)}`"


FIGURES = (("Failure-free overhead vs checkpoint interval", fig_overhead),
           ("Blocking time per checkpoint", fig_blocking),
           ("Recovery-time breakdown", fig_recovery),
           ("Persist throughput vs disk bandwidth, differential vs base size", fig_persist),
           ("Memory", fig_memory))


def _simulation_staleness(sim_doc: dict, results_dir: str) -> list[str]:
    """Lines saying whether a simulation was calibrated from the costs the current results give: bench_simulate
    is not rerun by --report-only, so its figures can lag behind the measurements."""
    try:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        from deadpool_ext.sim.calibration import calibrate
    except ImportError:
        return []
    used = _get(sim_doc, "calibration", "overrides") or {}
    now = calibrate(results_dir)
    def fmt(key: str, v: float) -> str:
        return f"{v:.4f}" if key.endswith("_ratio") else f"{v:.2f} s"

    diff = [f"`{k}` {fmt(k, used[k])} (now {fmt(k, v)}, from `{clean(now.files[k])}`)"
            for k, v in now.overrides.items() if k in used and abs(used[k] - v) > 1e-3 * max(1.0, abs(v))]
    if not diff:
        return []
    return ["**Stale:** this simulation was calibrated with " + "; ".join(diff) + ". Rerun "
            "`python benchmarks/bench_simulate.py` to refresh it (`deadpool simulate` always calibrates from the "
            "current results).", ""]


def write_report(out_dir: str, quick: bool, runs: list[dict[str, Any]], report_path: str, command_line: str,
                 results_dir: str = RESULTS_DIR, run_command: str | None = None) -> str:
    """Render REPORT.md (and its PNGs beside it) from whatever results exist."""
    fig_dir = os.path.dirname(os.path.abspath(report_path))
    os.makedirs(fig_dir, exist_ok=True)
    names = sorted({b.name for b in discover()} | set(ORDER))
    found = {n: r for n in names if (r := find_results(n, out_dir, quick, results_dir)) is not None}
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    if runs:
        intro = (f"Written by `{clean(command_line)}` on {when}. "
                 f"Machine: {_machine({'machine': machine_info(())})}. This "
                 "machine is shared with other engineers running tests at the same time (loaded): absolute times "
                 "are noisy; ratios come from A/B-interleaved runs within one job.")
    else:
        # Nothing ran: the machine rendering the report says nothing about the numbers, each file's machine does.
        intro = (f"Written by `{clean(command_line)}` on {when} from the results already there; "
                 "no benchmark was run by "
                 "this command. What each file measured, when, with which command and on which machine: "
                 "`benchmarks/results/INDEX.md`; every figure's footer names its files and machine. They were "
                 "measured on a 2-core CPU host shared with other engineers' test runs: absolute times are noisy; "
                 "ratios come from A/B-interleaved runs within one job.")
    lines = ["# Benchmark report", "", intro + " How to run and read this: `docs/benchmarks.md`.", ""]
    if runs:
        lines += ["## Runs", "", f"`{clean(run_command or command_line)}`, one benchmark at a time:", "",
                  "| benchmark | result |", "|---|---|"]
        lines += [f"| {r['benchmark']} | " + (f"skipped: {r['skipped']}" if "skipped" in r else
                                               f"rc={r['returncode']} in {r['wall_s']:.0f} s, log `{r['log']}`") + " |"
                  for r in runs]
        lines.append("")
    lines += ["## Sources", "", "| benchmark | file used | measured (UTC) | command |", "|---|---|---|---|"]
    for n in names:
        for path, doc in found[n].files if n in found else []:
            m = doc.get("machine")
            t = m.get("time_utc", "?") if isinstance(m, dict) else "?"
            lines.append(f"| {n} | `{_rel(path)}` | {t} | `{clean(doc.get('command', '?'))}` |")
        if n not in found:
            lines.append(f"| {n} | not measured yet | | |")
    # the README's block, rendered by the same code (every figure counted whole)
    lines += ["", "## Headlines", "", render_headlines(out_dir if quick else results_dir), ""]
    # A quick run's figures come from small models; the committed full runs, where present, say more.
    full = {n: r for n in names if (r := find_results(n, results_dir, False, results_dir)) is not None
            and n in found and os.path.abspath(r[0]) != os.path.abspath(found[n][0])
            and not r[0].endswith("_quick.json")}
    if full and quick:
        lines += ["## Headlines of the committed full runs", "", render_headlines(results_dir), ""]
    for title, fn in FIGURES:
        png, caption = fn(found, fig_dir, "report")
        lines += [f"## {title}", ""]
        lines += [f"![{title}]({os.path.relpath(png, fig_dir)})", "", caption, ""] if png else [caption, ""]
    lines += ["## Large-cluster simulation", ""]
    sims = [r for r in (found.get("simulate"), full.get("simulate")) if r]
    for sim in sims:
        sim_dir = os.path.dirname(sim[0])
        stem = os.path.basename(sim[0])[:-5]
        for suffix in ("goodput", "breakdown", "young_daly"):
            png = os.path.join(sim_dir, f"{stem}_{suffix}.png")
            if os.path.exists(png):
                lines += [f"![{stem} {suffix}]({os.path.relpath(png, fig_dir)})", ""]
        lines += [f"Simulated (not measured): `{_rel(sim[0])}`, details in `{_rel(sim[0][:-5] + '.md')}` and "
                  "`docs/simulator.md`.", ""]
        lines += _simulation_staleness(sim[1], results_dir)
    if not sims:
        lines += ["not simulated yet (`python benchmarks/bench_simulate.py`)", ""]
    write_text(report_path, "\n".join(lines))
    return report_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every benchmark's --quick mode")
    p.add_argument("--out", default=None, help="where benchmarks write (default: results/quick with --quick, "
                                               "else results)")
    p.add_argument("--report", default=os.path.join(RESULTS_DIR, "REPORT.md"), help="report path")
    p.add_argument("--only", default=None, help="comma-separated benchmark names to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated benchmark names not to run")
    p.add_argument("--deadline-s", type=float, default=None,
                   help=f"per benchmark (default {QUICK_DEADLINE_S} quick, {FULL_DEADLINE_S} full)")
    p.add_argument("--report-only", action="store_true", help="only re-render the report")
    p.add_argument("--list", action="store_true", help="list discovered benchmarks and exit")
    args = p.parse_args(argv)
    out_dir = os.path.abspath(args.out or (os.path.join(RESULTS_DIR, "quick") if args.quick else RESULTS_DIR))
    os.makedirs(out_dir, exist_ok=True)
    benches = discover()
    if args.list:
        for b in benches:
            c = command(b, args.quick, out_dir)
            print(f"{b.name:20s} {'runs: ' + shlex.join(c) if isinstance(c, list) else 'skipped: ' + c}")
        return 0
    only = {s for s in (args.only or "").split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    unknown = (only | skip) - {b.name for b in benches}
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; found: {', '.join(b.name for b in benches)}")
    benches = [b for b in benches if (not only or b.name in only) and b.name not in skip]
    cmd_line = ("python benchmarks/run_all.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                      else sys.argv[1:]))).strip()
    runs: list[dict[str, Any]] = []
    run_command = None
    if not args.report_only:
        deadline = args.deadline_s or (QUICK_DEADLINE_S if args.quick else FULL_DEADLINE_S)
        runs = run_benchmarks(benches, args.quick, out_dir, deadline)
        write_json(os.path.join(out_dir, "run_all.json"), {"quick": args.quick, "command": cmd_line, "runs": runs,
                                                          "machine": machine_info(())})
    elif os.path.exists(os.path.join(out_dir, "run_all.json")):
        with open(os.path.join(out_dir, "run_all.json")) as fh:
            prev = json.load(fh)
        runs, run_command = prev.get("runs", []), prev.get("command")
    path = write_report(out_dir, args.quick, runs, os.path.abspath(args.report), cmd_line, run_command=run_command)
    print(f"[run_all] wrote {os.path.relpath(path)}", flush=True)
    return 0 if all(r.get("returncode", 0) == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
