#!/usr/bin/env python
"""In-place communicator swap vs. rebuilding the engine: hot-swap phases side by side, and survivor memory over five
consecutive hot-swaps (issue "Existing jobs", item 6).

Two parts, one run, GPT small (HF GPT-2 architecture, DeepSpeed ZeRO-3 fp32, 3 ranks, one per simulated node):

* **phases** (``--repeats`` pairs, the order alternating per pair): the same job as ``bench_recovery``'s hot-swap
  (``deadpool-run --nnodes 3 --spare-nodes 1``, rank 1 SIGKILLed mid step K+1) with ``hot_swap.in_place: false``
  (every rank rebuilds its engine through the script's factory) and ``true`` (survivors keep their engine; only
  the communicators beneath its process groups are replaced; the spare builds its engine locally, then joins).
  Reported per mode: the timeline's phases (agree = every survivor has its new communicators, rebuild = engine
  ready, restore), "kill -> every rank restored", the job's losses compared bit for bit across modes.
* **memory** (one job per mode): ``--spare-nodes 5`` and five kills, each of the worker that holds rank 1 at that
  moment (node1.0, then the spare that replaced it, ...), two steps apart. The survivors (node0.0, node2.0) are
  sampled once a second (RSS from /proc; it includes the /dev/shm snapshot pages they touched); reported: RSS just
  before the first kill, after each swap (the last sample before the next kill, or the end of training) and the
  ratio last / first. Target: within 5% (ratio <= 1.05) with the in-place swap.

    python benchmarks/bench_inplace_swap.py                      # small: 3 pairs + memory, about 12 minutes
    python benchmarks/bench_inplace_swap.py --size tiny --repeats 1 --name inplace_swap_quick

Writes ``benchmarks/results/<name>.json`` and ``.md`` (default name ``inplace_swap``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, machine_info, write_text  # noqa: E402
from recovery_procs import append_event, read_records, run_logged, wait_and_kill  # noqa: E402
from recovery_run import (  # noqa: E402
    DEFAULTS,
    NNODES,
    NPROC_PER_NODE,
    SCRIPT,
    _monitor,
    run_hotswap,
    script_args,
    write_config,
)

MODES = {"rebuild": False, "in_place": True}


def _mode_settings(size: str, in_place: bool, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job settings of one mode; ``overrides`` (``--deadpool-overrides``) are sections of the deadpool config
    merged in, e.g. ``{"hot_swap": {"release_memory": false}}`` (the mode's ``hot_swap.in_place`` wins)."""
    d = dict(DEFAULTS[size])
    sections = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (overrides or {}).items()}
    sections["hot_swap"] = {**sections.get("hot_swap", {}), "in_place": in_place}
    d["deadpool"] = sections
    return d


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in records if "loss" in r}


def phases_part(size: str, repeats: int, args: argparse.Namespace, scratch: str, logs: str) -> list[dict[str, Any]]:
    runs = []
    for r in range(repeats):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            settings = _mode_settings(size, MODES[mode], args.deadpool_overrides)
            rec = run_hotswap(size, settings, scratch, f"{mode}_r{r}", args, logs)
            ev = rec.get("events") or {}
            ready = [v for v in (ev.get("survivor_restored_last"), ev.get("spare_restored")) if v is not None]
            runs.append({"mode": mode, "repeat": r, "failed": rec.get("failed"), "phases": rec.get("phases"),
                         "events": ev, "every_rank_restored_s": max(ready) if ready else None,
                         "raw_s": rec.get("raw_s"), "losses": _losses(rec.get("records", [])),
                         "rss_before_kill": rec.get("rss_before_kill"), "rss_end": rec.get("rss_end"),
                         "log": rec.get("log")})
            print(f"[bench] {mode} r{r}: phases {rec.get('phases')}, every rank restored "
                  f"{runs[-1]['every_rank_restored_s']}", flush=True)
    return runs


SURVIVORS = ("node0.0", "node2.0")


def _sample_status(mon: Any, out: dict[str, Any], every_s: float = 0.5) -> None:
    """Anonymous and shared-memory RSS of the survivors (``/proc/<pid>/status``: RssAnon, RssShmem), so growth of the
    process's own memory is told apart from shared snapshot pages mapped once more."""
    now = time.time()
    series = out.setdefault("status_series", [])
    if series and now - series[-1][0] < every_s:
        return
    row: dict[str, dict[str, int]] = {}
    for wid, pid in mon.workers().items():
        if wid not in SURVIVORS:
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            row[wid] = {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem", "VmRSS") if k in fields}
        except (OSError, ValueError):
            continue
    if row:
        series.append([now, row])


def memory_part(size: str, mode: str, swaps: int, args: argparse.Namespace, scratch: str,
                logs: str) -> dict[str, Any]:
    """One job with ``swaps`` spares and as many kills of rank 1's current holder, two steps apart."""
    from deadpool_ext.recovery.timeline import read_events
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env

    d = _mode_settings(size, mode != "rebuild", args.deadpool_overrides)
    if args.worker_env:
        d["env"] = {**d.get("env", {}), **dict(kv.split("=", 1) for kv in args.worker_env)}
    k0 = d["kill_step"]
    marks_at = [k0 + 2 * i for i in range(swaps)]  # a kill after each of these steps (none for no_failure)
    kills = [] if mode == "no_failure" else marks_at
    n = marks_at[-1] + 2 + args.tail_steps  # the redone step, one step, then the steady tail that is measured
    tag = f"memory_{mode}"
    shm_root = os.path.join("/dev/shm", f"bench_inplace.{os.getpid()}.{tag}")
    os.makedirs(shm_root, exist_ok=True)
    cfg = os.path.join(scratch, f"{tag}.ds.json")
    write_config(cfg, size, d, shm_root)
    metrics, timeline = os.path.join(scratch, f"{tag}.metrics.jsonl"), os.path.join(scratch, f"{tag}.timeline.jsonl")
    cmd = Job(script=SCRIPT, nnodes=NNODES, nproc_per_node=NPROC_PER_NODE, spare_nodes=len(kills), shm_root=shm_root,
              timeline=timeline, args=tuple(script_args(size, cfg, n, metrics, args.seed))).argv()
    out: dict[str, Any] = {"mode": mode, "kills_after_steps": kills, "marks_after_steps": marks_at, "train_iters": n,
                           "killed": []}
    box: dict[str, Any] = {}

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mon = box["m"] = _monitor(proc.pid, "DEADPOOL_WORKER_ID", args, shm_root)

        def sample_status() -> None:
            while proc.poll() is None and time.time() < deadline:
                _sample_status(mon, out, every_s=0.2)
                time.sleep(0.2)

        threading.Thread(target=sample_status, daemon=True).start()
        target = "node1.0"
        for i, step in enumerate(kills):
            kill = wait_and_kill(proc, deadline, mon, metrics, step, args.kill_delay_frac, target)
            append_event(timeline, {"event": "fault", "time": kill["t_kill"], "generation": i, "source": "injector",
                                    "pid": kill["killed_pid"], "worker": target})
            out["killed"].append({"worker": target, "t_kill": kill["t_kill"], "after_step": step})
            print(f"[bench]   {tag}: kill {i + 1}/{len(kills)}: {target} after step {step}", flush=True)
            # the next target: the spare that takes this node's place (the launcher's assignment event)
            node = target.split(".")[0]
            while time.time() < deadline and proc.poll() is None:
                ev = [e for e in read_events(timeline) if e.get("event") == "assignment"
                      and e.get("generation") == i + 1]
                if ev and node in ev[0].get("replaced", {}):
                    target = f"{ev[0]['replaced'][node]}.0"
                    break
                time.sleep(0.05)
        while proc.poll() is None and time.time() < deadline:
            mon.sample()
            time.sleep(mon.interval_s)

    try:
        job = run_logged(cmd, env=base_env(d.get("env")), timeout_s=d["timeout_s"] * 2, hook=hook,
                         log_path=os.path.join(logs, f"{size}_{tag}.log"))
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    mon = box.get("m")
    out.update(returncode=job["returncode"], timed_out=job["timed_out"], log=job["log"], env=d.get("env"))
    recs = read_records(metrics)
    out["losses"] = _losses(recs)
    if mon is None or len(out["killed"]) != len(kills):
        out["failed"] = f"only {len(out['killed'])} of {len(kills)} kills happened (rc {job['returncode']})"
        return out
    series = [(t, dict(r)) for t, r in mon.series]
    first_log: dict[int, float] = {}
    for r in sorted(recs, key=lambda r: r["time"]):
        first_log.setdefault(int(r["step"]), r["time"])
    out["step_times"] = {str(k): v for k, v in sorted(first_log.items())}
    # the same points in every mode: just after step s was first logged (a kill follows there), and the end
    t_kills = [first_log.get(s, time.time()) for s in marks_at]
    t_end = max((r["time"] for r in recs), default=time.time())

    def last_before(t: float, worker: str) -> int | None:  # the last sample before t
        vals = [r.get(worker, 0) for ts, r in series if ts < t and r.get(worker, 0) > 0]
        return vals[-1] if vals else None

    survivors = list(SURVIVORS)
    marks = t_kills[1:] + [t_end]
    out["rss"] = {w: {"before_first_kill": last_before(t_kills[0], w),
                      "after_each_swap": [last_before(t, w) for t in marks]} for w in survivors}
    for v in out["rss"].values():
        first, last = v["before_first_kill"], (v["after_each_swap"] or [None])[-1]
        v["ratio_last_to_first"] = last / first if first and last else None
    status = out.get("status_series", [])

    def status_before(t: float, worker: str, key: str) -> int | None:
        vals = [r[worker][key] for ts, r in status if ts < t and worker in r and key in r[worker]]
        return vals[-1] if vals else None

    for w in survivors:
        for key in ("RssAnon", "RssShmem"):
            first = status_before(t_kills[0], w, key)
            each = [status_before(t, w, key) for t in marks]
            out["rss"][w][key] = {"before_first_kill": first, "after_each_swap": each,
                                  "ratio_last_to_first": each[-1] / first if first and each and each[-1] else None}
    out["peaks"] = memory_peaks(out)
    out["steady"] = steady_peaks(out, args.tail_steps)
    if job["returncode"] != 0:
        out["failed"] = f"job exited rc={job['returncode']}"
    return out


def memory_peaks(m: dict[str, Any]) -> dict[str, Any]:
    """Per survivor and kind (RssAnon, RssShmem, VmRSS): the peak over one steady step, the last one before the
    first kill (between the logs of steps k-1 and k) and the last one before each later mark (steps s-1..s), and
    the ratio of the last such peak to the first. A point sample depends on where in its step it falls (the control
    without failures moves by +-10% between samples); a step's peak does not."""
    status = m.get("status_series") or []
    times = m.get("step_times") or {}
    marks = m.get("marks_after_steps") or []
    last = max((int(k) for k in times), default=0)
    windows = [(times.get(str(s - 1)), times.get(str(s))) for s in [*marks, last]]
    out: dict[str, Any] = {}
    for w in SURVIVORS:
        for key in ("RssAnon", "RssShmem", "VmRSS"):
            peaks = []
            for lo, hi in windows:
                vals = [r[w][key] for ts, r in status if lo is not None and hi is not None and lo < ts <= hi
                        and w in r and key in r[w]]
                peaks.append(max(vals) if vals else None)
            first, rest = (peaks[0], peaks[1:]) if peaks else (None, [])
            ratio = rest[-1] / first if first and rest and rest[-1] else None
            out.setdefault(w, {})[key] = {"before_first_kill": first, "after_each_swap": rest,
                                          "ratio_last_to_first": ratio}
    return out


def steady_peaks(m: dict[str, Any], tail: int) -> dict[str, Any]:
    """Per survivor and kind: the median of the per-step peaks of the steady steps before the first kill (every
    step from the second up to the kill's) and of the last ``tail`` steps of the job (after the last swap, from two
    steps after its redone step), and their ratio: a steady level at either end, where a single step's peak moves
    with what that step happened to do (the control's single-step peaks move by up to ~3%)."""
    status = m.get("status_series") or []
    times = m.get("step_times") or {}
    marks = m.get("marks_after_steps") or []
    last = max((int(k) for k in times), default=0)
    if not marks or not last:
        return {}
    before = list(range(2, marks[0] + 1))
    after = list(range(last - tail + 1, last + 1))
    out: dict[str, Any] = {"steps_before": before, "steps_after": after}
    def peak(s: int, w: str, key: str) -> int | None:
        lo, hi = times.get(str(s - 1)), times.get(str(s))
        vals = [r[w][key] for ts, r in status if lo is not None and hi is not None and lo < ts <= hi
                and w in r and key in r[w]]
        return max(vals) if vals else None

    for w in SURVIVORS:
        for key in ("RssAnon", "VmRSS"):
            b = _median([peak(s, w, key) for s in before])
            a = _median([peak(s, w, key) for s in after])
            out.setdefault(w, {})[key] = {"before": b, "after_last_swap": a,
                                          "ratio": a / b if a and b else None}
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(runs: list[dict[str, Any]], memory: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"phases": {}, "memory": {}}
    for mode in MODES:
        ok = [r for r in runs if r["mode"] == mode and not r["failed"] and r["phases"]]
        summary["phases"][mode] = {
            "n": len(ok),
            **{k: _median([r["phases"].get(k) for r in ok]) for k in ("detect_s", "agree_s", "rebuild_s",
                                                                       "restore_s", "total_s")},
            "rebuild_s_each": [r["phases"].get("rebuild_s") for r in ok],
            "every_rank_restored_s": _median([r["every_rank_restored_s"] for r in ok]),
            "every_rank_restored_s_each": [r["every_rank_restored_s"] for r in ok],
            "survivor_rss_end_gib": _median([v / 2**30 for r in ok for w, v in (r["rss_end"] or {}).items()
                                             if w in ("node0.0", "node2.0")]),
        }
    losses = [r["losses"] for r in runs if not r["failed"]] + [m["losses"] for m in memory if not m.get("failed")]
    common = set.intersection(*(set(x) for x in losses)) if losses else set()
    summary["losses_bit_identical_across_all_runs"] = bool(losses) and all(
        all(x[s] == losses[0][s] for s in common) for x in losses)
    summary["losses_compared_steps"] = sorted(common)
    for m in memory:
        peaks = m.get("peaks") or {}
        summary["memory"][m["mode"]] = {
            w: {k: (peaks.get(w, {}).get(key) or {}).get("ratio_last_to_first")
                for k, key in (("rss_peak", "VmRSS"), ("anon_peak", "RssAnon"), ("shmem_peak", "RssShmem"))}
            for w in SURVIVORS}
    return summary


def _machine(m: Any) -> str:
    if not isinstance(m, dict):
        return str(m)
    return ", ".join(f"{k} {v}" for k, v in m.items() if not isinstance(v, (dict, list)))


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    ph = s["phases"]
    f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        "# In-place communicator swap vs. engine rebuild (hot-swap, GPT " + doc["size"] + ")", "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {_machine(doc['machine'])}; {doc['date']}; total wall {doc['wall_s']:.0f} s.", "",
        "Same job as `bench_recovery`'s hot-swap (DeepSpeed ZeRO-3 fp32, 3 ranks on 3 simulated nodes + spares, "
        "snapshots every step, one peer replica; rank 1 SIGKILLed mid step), run with `hot_swap.in_place: false` "
        "(*rebuild*: every rank calls the script's factory, `deepspeed.initialize` on the new world) and `true` "
        "(*in_place*: survivors keep engine, optimizer and scheduler; only the communicators beneath their process "
        "groups are replaced; the spare builds its engine locally while the survivors wait for it in the new "
        "communicators' rendezvous, then everyone restores in place). Pairs interleaved, order alternating.", "",
        "## Phases (medians, seconds; timeline `phases()`)", "",
        "| mode | runs | detect | agree (new communicators) | rebuild (engine) | restore | kill -> every rank "
        "restored | total (kill -> caught up) | rebuild, each run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, v in ph.items():
        lines.append(f"| {mode} | {v['n']} | {f(v['detect_s'])} | {f(v['agree_s'])} | {f(v['rebuild_s'], 3)} | "
                     f"{f(v['restore_s'])} | {f(v['every_rank_restored_s'])} | {f(v['total_s'])} | "
                     f"{', '.join(f(x, 3) for x in v['rebuild_s_each'])} |")
    lines += ["", "With the in-place swap the survivors' *rebuild* phase is only the snapshot manager's rewire (no "
              "engine is built); the spare's local engine build now falls inside *agree* (the survivors wait for it "
              "in the rendezvous of the new communicators), so compare the end-to-end column too.", "",
              f"Losses: {'**bit-identical**' if s['losses_bit_identical_across_all_runs'] else '**DIFFER**'} across "
              f"every run of both modes (steps {s['losses_compared_steps']}).", "",
              "## Survivor memory over five consecutive hot-swaps", "",
              "Peak of one steady step (the step before the first kill; the step before each later mark, i.e. two "
              "steps after each swap; the last step), per survivor; `no_failure` is the same job without kills, "
              "measured at the same steps:", "",
              "| mode | worker, memory | before the first kill | after swaps 1..5 | last / first |",
              "|---|---|---|---|---|"]
    for m in doc["memory"]:
        if m.get("failed"):
            continue
        for w, kinds in (m.get("peaks") or {}).items():
            for label, key in (("RSS", "VmRSS"), ("anonymous", "RssAnon"), ("shared (shm)", "RssShmem")):
                row = kinds.get(key)
                if not row or row["before_first_kill"] is None:
                    continue
                each = ", ".join("—" if x is None else f"{x / 2**30:.2f}" for x in row["after_each_swap"])
                lines.append(f"| {m['mode']} | {w} {label} | {f(row['before_first_kill'] / 2**30)} GiB | {each} GiB | "
                             f"{f(row['ratio_last_to_first'], 3)} |")
    steady = [m for m in doc["memory"] if not m.get("failed") and m.get("steady")]
    if steady:
        st0 = steady[0]["steady"]
        lines += ["", f"Steady level, the measure of record: the median of the per-step peaks of steps "
                  f"{st0['steps_before'][0]}..{st0['steps_before'][-1]} (before the first kill) and of the last "
                  f"{len(st0['steps_after'])} steps (steps {st0['steps_after'][0]}..{st0['steps_after'][-1]}, after "
                  "the fifth swap's redone step and one more), per survivor:", "",
                  "| mode | worker, memory | steady before the first kill | steady after the fifth swap | "
                  "after / before |",
                  "|---|---|---|---|---|"]
        for m in steady:
            for w, kinds in m["steady"].items():
                if not isinstance(kinds, dict) or w.startswith("steps"):
                    continue
                for label, key in (("RSS", "VmRSS"), ("anonymous", "RssAnon")):
                    row = kinds.get(key)
                    if not row or not row["before"] or not row["after_last_swap"]:
                        continue
                    lines.append(f"| {m['mode']} | {w} {label} | {f(row['before'] / 2**30)} GiB | "
                                 f"{f(row['after_last_swap'] / 2**30)} GiB | {f(row['ratio'], 3)} |")
    lines += ["", "Point samples (the last sample before each mark; they move with where in its step the sample "
              "falls):", "", "| mode | worker, memory | before the first kill | after swaps 1..5 | last / first |",
              "|---|---|---|---|---|"]
    for m in doc["memory"]:
        if m.get("failed"):
            lines.append(f"| {m['mode']} | — | failed: {m['failed']} | | |")
            continue
        for w, v in m["rss"].items():
            for label, row in (("RSS", v), ("anonymous", v.get("RssAnon")), ("shared (shm)", v.get("RssShmem"))):
                if not row:
                    continue
                each = ", ".join("—" if x is None else f"{x / 2**30:.2f}" for x in row["after_each_swap"])
                lines.append(f"| {m['mode']} | {w} {label} | {f((row['before_first_kill'] or 0) / 2**30)} GiB | "
                             f"{each} GiB | {f(row['ratio_last_to_first'], 3)} |")
    lines += ["", "RSS from /proc (VmRSS; includes the /dev/shm snapshot pages a process has mapped, once per "
              "mapping), split into anonymous (the process's own memory: RssAnon) and shared (RssShmem); the last "
              "sample (1 s, 0.5 s for the split) before the next kill or the end of training. Target (in_place): "
              "last / first <= 1.05.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=sorted(DEFAULTS))
    p.add_argument("--repeats", type=int, default=3, help="pairs of hot-swap jobs (one per mode each)")
    p.add_argument("--swaps", type=int, default=5, help="consecutive hot-swaps in the memory part (0: skip it)")
    p.add_argument("--kill-delay-frac", type=float, default=0.5)
    p.add_argument("--tail-steps", type=int, default=4,
                   help="memory part: steady steps measured after the last swap (from two steps after its redone step)")
    p.add_argument("--recovery-timeout-s", type=float, default=120.0)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--settle-busy", type=float, default=0.35)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--min-available-gib", type=float, default=1.5)
    p.add_argument("--memory-modes", default="no_failure,rebuild,in_place",
                   help="memory part: comma-separated of no_failure (the same job without kills: the control), "
                        "rebuild, in_place")
    p.add_argument("--worker-env", action="append", default=[], metavar="K=V",
                   help="environment of the memory part's jobs (e.g. MALLOC_ARENA_MAX=2); repeatable")
    p.add_argument("--deadpool-overrides", type=json.loads, default=None, metavar="JSON",
                   help='sections of the deadpool config for every job, e.g. '
                        '\'{"hot_swap": {"release_memory": false}}\'')
    p.add_argument("--name", default="inplace_swap")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--rerender", metavar="JSON", default=None,
                   help="recompute the memory peaks and the summary from a saved result, rewrite its JSON and .md")
    args = p.parse_args()
    if args.rerender:
        with open(args.rerender) as fh:
            doc = json.load(fh)
        for m in doc["memory"]:
            if not m.get("failed"):
                m["peaks"] = memory_peaks(m)
                if "steady" in m:
                    m["steady"] = steady_peaks(m, len(m["steady"].get("steps_after") or []) or args.tail_steps)
        doc["summary"] = summarise(doc["runs"], doc["memory"])
        write_text(args.rerender, json.dumps(doc, indent=1, default=str))
        write_text(args.rerender[:-len(".json")] + ".md", render(doc))
        print(json.dumps(doc["summary"], indent=1))
        return 0
    t0 = time.time()
    scratch = tempfile.mkdtemp(prefix="bench_inplace.")
    logs = os.path.join(args.out, f"{args.name}_logs")
    os.makedirs(logs, exist_ok=True)
    try:
        runs = phases_part(args.size, args.repeats, args, scratch, logs)
        memory = [memory_part(args.size, mode, args.swaps, args, scratch, logs)
                  for mode in args.memory_modes.split(",") if mode] if args.swaps else []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc = {"size": args.size, "command": "python benchmarks/bench_inplace_swap.py " + " ".join(sys.argv[1:]),
           "machine": machine_info(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "wall_s": time.time() - t0, "runs": runs, "memory": memory}
    doc["summary"] = summarise(runs, memory)
    write_text(os.path.join(args.out, f"{args.name}.json"), json.dumps(doc, indent=1, default=str))
    write_text(os.path.join(args.out, f"{args.name}.md"), render(doc))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
