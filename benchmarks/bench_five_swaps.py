#!/usr/bin/env python
"""Five consecutive hot-swaps, each spare replaced by a machine that joins: every swap as fast as the first.

Issue "The spare ready before the failure", part 4. GPT small (ZeRO-3, 3 ranks, one per node) under
``deadpool-run --nnodes 3 --spare-nodes 1``, today's defaults (in place, the spare built ahead). Five times: once
the waiting spare has built its engine (its ``spare_ready`` timeline event) and a step that began after it is
logged (a quiet step: no swap under way and no machine building on the training's cores), the worker that holds
rank 1 is SIGKILLed mid-step; the spare, which shadows the node holding rank 1, takes it; then a new machine joins
(``deadpool-run --join joinN`` with the job's store, job id and token), becomes the spare and builds ahead for
rank 1 in its turn. ``--kill-ranks`` (default ``1,2,1,2,1``, issue 44) picks the rank whose holder each swap kills,
in turn: a different node each time (each holder is a process that took its rank at an earlier swap or at the
start), so two swaps in five the spare takes ranks it did not build for (relabelled in place,
``integrations/deepspeed/takeover.py``), and the holder of rank 0 survives all five: the survivor whose memory the
target judges. ``1,2,0`` kills rank 0's node too (no worker then survives five swaps: the workers alive at the end
joined at swap 3 or 4, and their growth mixes a fresh rank's first steps with the swaps); ``1`` is the earlier run
(always the shadowed node).

Per swap, from the job's timeline: kill -> every rank restored (detect + agree + rebuild + restore), whether the
spare had built for the killed node (the ``assignment`` event), how it took the ranks (``spare_assigned``: as built,
relabelled, started again), and kill -> the next completed step. Survivors keep their processes: each worker alive
at the end, its median RSS over the ``--rss-window-s`` before the first kill it survived while training and over as
long before the last step completed (a single sample's RSS is that of the phase of a step it fell in), and how many
swaps it survived; the memory target is judged on the workers that survived every
swap, against a control: the same job under ``deadpool-run`` with its spare and no kills, sampled over the same windows
by step (``--no-control`` skips it). The judged figure is glibc's bytes in use (``mallinfo2``, written once a second by
``heap_probe/sitecustomize.py`` in the active nodes' workers), not RSS: RSS also counts the free memory the allocator
keeps in its heap (700-850 MB of a GPT small worker's 2 GB here), which comes and goes with the order of allocations,
within a run and between two runs of the same job; RSS is reported beside it. A machine joins once the previous swap
is over (its redone step completed): on this 2-core host its start would otherwise compete with a recovery it is not
part of. The losses against an
uninterrupted run of the same script, bit for bit.

    python benchmarks/bench_five_swaps.py          # ~7 min on 2 cores (the control and the reference included)

Writes ``benchmarks/results/five_swaps.json`` and ``.md``, the jobs' logs under ``five_swaps_logs/``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, add_output_args, machine_info, median, render_only, save_result  # noqa: E402
from recovery_procs import Monitor, append_event, read_records, run_logged, steady_step_s, wait_and_kill  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

SCRIPT = os.path.join(REPO, "scripts", "pretrain_gpt.py")
BASE = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")
TARGET_RESTORED_S, TARGET_MEMORY = 1.0, 1.05


def _config(path: str, shm: str | None) -> str:
    import json

    with open(BASE) as fh:
        cfg = json.load(fh)
    cfg["train_micro_batch_size_per_gpu"] = 2
    if shm is None:
        cfg.pop("deadpool", None)
    else:
        cfg["deadpool"] = {"snapshot": {"interval": 1}, "replication": {"factor": 1}, "local": {"shm_root": shm}}
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def _args(cfg: str, iters: int, metrics: str, size: str) -> tuple[str, ...]:
    return ("--deepspeed_config", cfg, "--model-size", size, "--train-iters", str(iters), "--metrics-out", metrics,
            "--seed", "1234", "--log-interval", "1")


def _events(path: str, kind: str) -> list[dict[str, Any]]:
    from deadpool_ext.recovery.timeline import read_events

    return [e for e in (read_events(path) if os.path.exists(path) else []) if e.get("event") == kind]


def quiet_steps(recs: list[dict[str, Any]], ready: list[float], kills: list[float],
                redone: set[int]) -> list[dict[str, Any]]:
    """Pure: the steps that ran with a spare already built and no swap under way: step 2 on, not redone, begun
    (``time - step_time_s``) after a ``spare_ready`` that came after the last kill before it, with no kill while it
    ran. On this 2-core host a joining machine builds its engine on the training's cores (a joining machine is
    another host), so the steps while it builds are not normal steps."""
    out = []
    for r in recs:
        start = r["time"] - r["step_time_s"]
        last_kill = max((t for t in kills if t <= start), default=float("-inf"))
        if r["step"] >= 2 and r["step"] not in redone and not any(start < t <= r["time"] for t in kills) \
                and any(last_kill < t <= start for t in ready):
            out.append(r)
    return out


class Monitors:
    """The job's monitor and each joining machine's, as one (what ``wait_and_kill`` samples and searches): every
    worker is sampled while a kill waits, not only the holder's, so each has samples in the window before it."""

    def __init__(self) -> None:
        self.all: list[Monitor] = []
        self.label_env = "DEADPOOL_WORKER_ID"

    def sample(self, force: bool = False) -> None:
        for m in self.all:
            m.sample(force)

    def find(self, label: str) -> int | None:
        return next((pid for m in self.all if (pid := m.find(label)) is not None), None)

    def rss_median(self, t0: float, t1: float) -> dict[str, int]:
        return {k: v for m in self.all for k, v in m.rss_median(t0, t1).items()}

    def parts_median(self, t0: float, t1: float) -> dict[str, dict[str, int]]:
        """Per part of RSS (anonymous, /dev/shm), each worker's median over [``t0``, ``t1``]."""
        return {part: {k: v for m in self.all for k, v in m.part_median(t0, t1, part).items()} for part in PARTS}


PARTS = ("rss_anon", "rss_shmem")
HEAP_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_probe")


def probe_env(env: dict[str, str], heap_dir: str) -> dict[str, str]:
    """``env`` with the allocator probe on (``heap_probe/sitecustomize.py``: active nodes' workers only)."""
    path = os.pathsep.join(p for p in (HEAP_PROBE, os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "DEADPOOL_BENCH_HEAP_DIR": heap_dir}


def read_heap(heap_dir: str) -> dict[str, list[tuple[float, int]]]:
    """Each worker's allocator samples (time, bytes in use), by worker id, from the probe's files."""
    import json

    out: dict[str, list[tuple[float, int]]] = {}
    for name in sorted(os.listdir(heap_dir)) if os.path.isdir(heap_dir) else []:
        label = name.rsplit(".", 2)[0]
        with open(os.path.join(heap_dir, name)) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    out.setdefault(label, []).append((float(rec["t"]), int(rec["live"])))
                except (ValueError, KeyError):
                    continue  # a line cut by the kill
    return out


def heap_window(heap: dict[str, list[tuple[float, int]]], t0: float, t1: float) -> dict[str, int]:
    """Pure: each worker's median bytes in use over [``t0``, ``t1``] (workers with a sample in it)."""
    out = {}
    for k, samples in heap.items():
        v = median([b for t, b in samples if t0 <= t <= t1])
        if v is not None:
            out[k] = int(v)
    return out


def kill_step(recs: list[dict[str, Any]], ready_at: float, earliest: int) -> int | None:
    """Pure: the step after which a swap's kill lands: the first step from ``earliest`` on that began (``time -
    step_time_s``) once the current spare was built (``ready_at``), so that every swap is preceded by a quiet step
    (one that ran with a spare built and no joining machine building on the training's cores), the normal step the
    swap's next step is judged against; None until rank 0 logged such a step."""
    return next((r["step"] for r in recs if r["step"] >= earliest and r["time"] - r["step_time_s"] >= ready_at), None)


def run(a: argparse.Namespace, scratch: str, logs: str) -> dict[str, Any]:
    from deadpool_ext.recovery.timeline import phases, read_events
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    shm = os.path.join("/dev/shm", f"bench_five.{os.getpid()}")
    os.makedirs(shm, exist_ok=True)
    token, job_id, port = "t0ken-" + os.urandom(8).hex(), "fiveswaps", free_port()
    metrics, timeline = os.path.join(scratch, "swaps.jsonl"), os.path.join(scratch, "swaps.timeline.jsonl")
    cfg = _config(os.path.join(scratch, "swaps.ds.json"), shm)
    # Each kill comes after a quiet step (kill_step): the joining machine builds for three to five steps here, so a swap
    # can come later than the planned gap, and the job runs with room for it.
    iters = a.first_kill + (a.gap + a.slack) * (a.swaps - 1) + a.gap
    kills: list[int] = []
    heap_dir = os.path.join(scratch, "heap")
    env = probe_env({"DEADPOOL_STORE_TOKEN": token}, heap_dir)
    job = Job(script=SCRIPT, nnodes=3, nproc_per_node=1, spare_nodes=1, shm_root=shm, timeline=timeline,
              launcher_flags=("--job-id", job_id, "--store-port", str(port)), env_vars=env,
              args=_args(cfg, iters, metrics, a.size))
    out: dict[str, Any] = {"cmd": shlex.join(job.argv()), "kills_after_steps": kills, "train_iters": iters,
                           "swaps": [], "rss_window_s": a.rss_window_s}
    joiners: list[subprocess.Popen] = []
    mons = Monitors()

    def join(i: int) -> None:
        j = Job(script=SCRIPT, join=f"join{i}", nnodes=None, store_url=f"dp://127.0.0.1:{port}", job_id=job_id,
                nproc_per_node=1, shm_root=shm, timeline=timeline, env_vars=env,
                args=_args(cfg, iters, metrics, a.size))
        log = open(os.path.join(logs, f"join{i}.log"), "w")
        p = subprocess.Popen(j.argv(), cwd=REPO, env=j.env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        joiners.append(p)
        mons.all.append(Monitor(p.pid, mons.label_env, shm, script=SCRIPT))

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mons.all.insert(0, Monitor(proc.pid, mons.label_env, shm, script=SCRIPT))
        holders = {r: f"node{r}.0" for r in range(3)}
        for i in range(a.swaps):
            rank = a.kill_ranks[i % len(a.kill_ranks)]
            holder = holders[rank]
            earliest = a.first_kill if not kills else kills[-1] + a.gap
            while (step := kill_step(read_records(metrics), ready[-1]["time"], earliest)
                   if len(ready := _events(timeline, "spare_ready")) >= i + 1 else None) is None:
                # the current spare has built its engine, and a step began after it
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"swap {i + 1}: no spare built ahead, or no step after it, before the deadline")
                if max((r["step"] for r in read_records(metrics)), default=0) >= iters - 2:
                    raise RuntimeError(f"swap {i + 1}: the job is about to end ({iters} steps) with no quiet step "
                                       f"since its spare was built: more --slack")
                mons.sample()
                time.sleep(0.1)
            kills.append(step)
            kill = wait_and_kill(proc, deadline, mons, metrics, step, 0.5, holder)  # type: ignore[arg-type]
            append_event(timeline, {"event": "fault", "time": kill["t_kill"], "generation": i, "source": "injector",
                                    "pid": kill["killed_pid"], "worker": holder})
            logged = next(r["time"] for r in read_records(metrics) if r["step"] == step)
            out["swaps"].append({"killed": holder, "rank": rank, "t_kill": kill["t_kill"], "after_step": step,
                                 "kill_after_logged_s": kill["t_kill"] - logged,
                                 "training": sorted(w for w in holders.values() if w != holder),
                                 "rss_before": mons.rss_median(kill["t_kill"] - a.rss_window_s, kill["t_kill"]),
                                 "parts_before": mons.parts_median(kill["t_kill"] - a.rss_window_s, kill["t_kill"])})
            print(f"[bench] swap {i + 1}: SIGKILLed {holder} after step {step}", flush=True)
            while not [e for e in _events(timeline, "assignment") if e.get("generation") == i + 1]:
                if time.time() > deadline:
                    raise RuntimeError(f"swap {i + 1}: no assignment")
                time.sleep(0.05)
            [assigned] = [e for e in _events(timeline, "assignment") if e.get("generation") == i + 1]
            holders[rank] = f"{assigned['replaced'][holder.split('.')[0]]}.0"
            if i + 1 < a.swaps:
                # The machine joins once the swap is over (the redone step completed): on this 2-core host its start
                # would otherwise compete with the recovery it is not part of (a joining machine is another host).
                while proc.poll() is None and time.time() < deadline and not any(
                        r["step"] > step and r["time"] > kill["t_kill"] for r in read_records(metrics)):
                    time.sleep(0.05)
                join(i + 1)
        while proc.poll() is None and time.time() < deadline:
            mons.sample()
            time.sleep(0.5)

    try:
        res = run_logged(job.argv(), env=base_env(env), timeout_s=a.timeout_s, hook=hook,
                         log_path=os.path.join(logs, "swaps.log"))
    finally:
        from deadpool_ext.testing.launch import kill_tree

        for p in joiners:
            kill_tree(p.pid)
        shutil.rmtree(shm, ignore_errors=True)
    out.update(returncode=res["returncode"], log=res["log"], error=res["error"])
    for path in (metrics, timeline):  # kept beside the logs: every step's time and every event, to read afterwards
        if os.path.exists(path):
            shutil.copy(path, logs)
    recs = read_records(metrics)
    out["losses"] = {r["step"]: r["loss"] for r in recs}
    events = read_events(timeline) if os.path.exists(timeline) else []
    rows = {p["generation"]: p for p in phases(events)}
    redone: set[int] = set()
    for i, sw in enumerate(out["swaps"]):
        row = rows.get(i + 1) or {}
        parts = [row.get(k) for k in ("detect_s", "agree_s", "rebuild_s", "restore_s")]
        last_pre = max((r["step"] for r in recs if r["time"] <= sw["t_kill"]), default=0)
        nxt = next((r for r in recs if r["time"] > sw["t_kill"] and r["step"] > last_pre), None)
        [assigned] = [e for e in events if e.get("event") == "assignment" and e.get("generation") == i + 1] or [{}]
        how = [e.get("how") for e in events if e.get("event") == "spare_assigned" and e.get("generation") == i + 1]
        if nxt is not None:
            redone.add(nxt["step"])
        sw.update(restored_s=sum(parts) if None not in parts else None, raw_s=nxt["time"] - sw["t_kill"] if nxt
                  else None, built_ahead=all((assigned.get("built_ahead") or {"?": False}).values()),
                  how=how[0] if how else None,
                  phases={k: row.get(k) for k in ("detect_s", "assign_s", "spare_s", "communicators_s", "rebuild_s",
                                                  "restore_s")})
    quiet = quiet_steps(recs, [e["time"] for e in events if e.get("event") == "spare_ready"],
                        [sw["t_kill"] for sw in out["swaps"]], redone)
    out["normal_steps"] = [r["step"] for r in quiet]
    out["normal_step_s"] = (median([r["step_time_s"] for r in quiet]) if quiet
                            else steady_step_s(recs, redone) or 0.0)
    t_last = max((r["time"] for r in recs), default=time.time())  # the last step, before the job winds down
    last = mons.rss_median(t_last - a.rss_window_s, t_last)
    last_parts = mons.parts_median(t_last - a.rss_window_s, t_last)
    killed = {sw["killed"] for sw in out["swaps"]}
    first: dict[str, Any] = {}
    for sw in out["swaps"]:  # each worker's RSS before the first kill it survived while training
        for k in sw["training"]:
            first.setdefault(k, sw["rss_before"].get(k))
    out["rss_end"] = {k: last.get(k) for k in first if k not in killed}
    out["rss_first"] = {k: v for k, v in first.items() if k not in killed}
    out["parts_end"] = {part: {k: v for k, v in last_parts[part].items() if k in out["rss_end"]} for part in PARTS}
    heap = read_heap(heap_dir)
    for sw in out["swaps"]:
        sw["heap_before"] = heap_window(heap, sw["t_kill"] - a.rss_window_s, sw["t_kill"])
    out["heap_end"] = {k: v for k, v in heap_window(heap, t_last - a.rss_window_s, t_last).items()
                       if k in out["rss_end"]}
    return out


def control(a: argparse.Namespace, scratch: str, logs: str, swaps: list[dict[str, Any]],
            iters: int) -> dict[str, Any]:
    """The memory's control: the same job under ``deadpool-run`` with its spare, no kills, each worker's median RSS
    over the same windows by step: before the moment each swap's kill came (as long after its step was logged as
    the kill was) and before the last step. What a survivor's RSS does over those steps without a swap (the
    process's own warm-up, the allocator) is then told apart from what the swaps leave."""
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    shm = os.path.join("/dev/shm", f"bench_five_ctl.{os.getpid()}")
    os.makedirs(shm, exist_ok=True)
    metrics = os.path.join(scratch, "control.jsonl")
    cfg = _config(os.path.join(scratch, "control.ds.json"), shm)
    heap_dir = os.path.join(scratch, "control_heap")
    env = probe_env({"DEADPOOL_STORE_TOKEN": "t0ken-" + os.urandom(8).hex()}, heap_dir)
    job = Job(script=SCRIPT, nnodes=3, nproc_per_node=1, spare_nodes=1, shm_root=shm,
              launcher_flags=("--job-id", "fiveswapsctl", "--store-port", str(free_port())), env_vars=env,
              args=_args(cfg, iters, metrics, a.size))
    mons = Monitors()

    def hook(proc: subprocess.Popen, deadline: float) -> None:
        mons.all.append(Monitor(proc.pid, mons.label_env, shm, script=SCRIPT))
        while proc.poll() is None and time.time() < deadline:
            mons.sample()
            time.sleep(0.1)

    try:
        res = run_logged(job.argv(), env=base_env(env), timeout_s=a.timeout_s, hook=hook,
                         log_path=os.path.join(logs, "control.log"))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    recs = {r["step"]: r for r in read_records(metrics)}
    heap = read_heap(heap_dir)
    out: dict[str, Any] = {"cmd": shlex.join(job.argv()), "returncode": res["returncode"], "at_kills": [],
                           "parts_at_kills": [], "heap_at_kills": []}
    for sw in swaps:
        rec = recs.get(sw["after_step"])
        t = rec["time"] + sw.get("kill_after_logged_s", 0.0) if rec else None
        out["at_kills"].append(mons.rss_median(t - a.rss_window_s, t) if t else {})
        out["parts_at_kills"].append(mons.parts_median(t - a.rss_window_s, t) if t else {})
        out["heap_at_kills"].append(heap_window(heap, t - a.rss_window_s, t) if t else {})
    t_last = max((r["time"] for r in recs.values()), default=time.time())
    out["rss_end"] = mons.rss_median(t_last - a.rss_window_s, t_last)
    out["parts_end"] = mons.parts_median(t_last - a.rss_window_s, t_last)
    out["heap_end"] = heap_window(heap, t_last - a.rss_window_s, t_last)
    return out


def reference(a: argparse.Namespace, scratch: str, logs: str, iters: int) -> dict[int, float]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    m = os.path.join(scratch, "reference.jsonl")
    job = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=3, port=free_port(),
              args=_args(_config(os.path.join(scratch, "ref.ds.json"), None), iters, m, a.size))
    run_logged(job.argv(), env=base_env(), timeout_s=a.timeout_s, log_path=os.path.join(logs, "reference.log"))
    return {r["step"]: r["loss"] for r in read_records(m)}


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    run_, ref = doc["run"], {int(k): v for k, v in doc["reference_losses"].items()}
    swaps = run_["swaps"]
    step = run_["normal_step_s"]
    growth = {k: (run_["rss_end"][k] / run_["rss_first"][k]) if run_["rss_end"].get(k) and run_["rss_first"].get(k)
              else None for k in run_["rss_first"]}
    losses = {int(k): v for k, v in run_["losses"].items()}
    each = [s.get("restored_s") for s in swaps]
    done = [x for x in each if x is not None]
    all_swaps = len(swaps) == doc["swaps_planned"] and len(done) == len(swaps)
    survived = {k: sum(1 for s in swaps if k in (s.get("training") or []) and k != s["killed"]) for k in growth}
    every = {k: g for k, g in growth.items() if survived[k] == len(swaps)}  # the target's survivors
    ctl = doc.get("control") or {}
    # With the control: each survivor's RSS at the last step over the same worker's in the run without kills, at the
    # same step (what five swaps left in it); without: its own growth since the first kill it survived.
    vs_control = {k: run_["rss_end"][k] / ctl["rss_end"][k] for k in every
                  if run_["rss_end"].get(k) and (ctl.get("rss_end") or {}).get(k)}
    first_swap = {k: next((i for i, s in enumerate(swaps) if k in (s.get("training") or [])), None) for k in growth}
    ctl_growth = {k: ctl["rss_end"][k] / ctl["at_kills"][i][k] for k, i in first_swap.items()
                  if ctl.get("rss_end", {}).get(k) and i is not None and i < len(ctl.get("at_kills") or [])
                  and ctl["at_kills"][i].get(k)}
    # The allocator's bytes in use (heap_probe/), where the run has them: RSS also counts the free memory glibc keeps
    # in its heap, which comes and goes with the order of allocations (hundreds of MB here, within a run and between
    # two runs of the same job), not with what a swap left alive.
    heap_end, ctl_heap = run_.get("heap_end"), ctl.get("heap_end") or {}
    heap_vs_control = {k: heap_end[k] / ctl_heap[k] for k in every
                       if (heap_end or {}).get(k) and ctl_heap.get(k)}
    heap_first = {k: swaps[i]["heap_before"][k] for k, i in first_swap.items()
                  if i is not None and (swaps[i].get("heap_before") or {}).get(k)}
    heap_growth = {k: heap_end[k] / v for k, v in heap_first.items() if (heap_end or {}).get(k)}
    if ctl and heap_end is not None:
        judged, against = heap_vs_control, "the same worker's allocator bytes in use in the run without kills"
    elif ctl:
        judged, against = vs_control, "the run without kills"
    else:
        judged, against = every, "its own RSS before the first swap"
    worst = max((g for g in judged.values() if g), default=None)
    return {
        "swaps": len(swaps), "restored_each_s": each, "raw_each_s": [s.get("raw_s") for s in swaps],
        "built_ahead_each": [s.get("built_ahead") for s in swaps], "how_each": [s.get("how") for s in swaps],
        "normal_step_s": step, "normal_steps": run_.get("normal_steps"),
        "survivor_rss_growth": growth, "swaps_survived": survived, "control_rss_growth": ctl_growth,
        "survivor_rss_vs_control": vs_control, "survivor_heap_vs_control": heap_vs_control,
        "survivor_heap_growth": heap_growth,
        "losses_identical": bool(losses) and set(losses) == set(ref) and all(ref[k] == v for k, v in losses.items()),
        "targets": {
            "every_restored": {"target_s": TARGET_RESTORED_S, "value_s": max(done, default=None),
                               "met": all_swaps and all(x <= TARGET_RESTORED_S for x in done)},
            "every_next_step": {"target_s": TARGET_RESTORED_S,
                                "met": all_swaps and all(s.get("raw_s") is not None
                                                         and s["raw_s"] - step <= TARGET_RESTORED_S for s in swaps)},
            "survivor_memory": {"target": TARGET_MEMORY, "value": worst, "judged_on": sorted(every),
                                "against": against,
                                "met": bool(every) and set(judged) == set(every)
                                and all(g is not None and g <= TARGET_MEMORY for g in judged.values())}}}


def render(doc: dict[str, Any]) -> str:
    an, run_ = doc["analysis"], doc["run"]

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = [f"# {doc['title']}", "", f"Measured {doc['date']} with `{doc['command']}` ({doc['wall_s']:.0f} s) on "
             f"{doc['machine'].get('cpu_count', '?')} CPUs, GPT {doc['size']}. "
             + (__doc__ or "").split("\n\n")[1].replace("\n", " "), "",
             "| swap | killed | spare built for it | spare took it by | kill -> every rank restored (s) | "
             "kill -> next step (s) | detect | assign | spare | comms | restore |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(run_["swaps"]):
        ph = s.get("phases") or {}
        lines.append(f"| {i + 1} | {s['killed']} | {s.get('built_ahead')} | {s.get('how') or '-'} | "
                     f"{f(s.get('restored_s'))} | "
                     f"{f(s.get('raw_s'))} | " + " | ".join(f(ph.get(k)) for k in ("detect_s", "assign_s", "spare_s",
                                                                                      "communicators_s", "restore_s"))
                     + " |")
    g, n = an["survivor_rss_growth"], an.get("swaps_survived") or {}
    quiet = an.get("normal_steps")
    how = (f" (the median of steps {', '.join(map(str, quiet))}: those run with a spare already built and no swap "
           "under way; while a joining machine builds its engine, on the training's 2 cores here, steps are slower)"
           if quiet else "")
    window = doc["run"].get("rss_window_s")
    rss = (f"Survivors' median RSS over the {f(window, 0)} s before the last step completed over theirs over the "
           f"{f(window, 0)} s before the first kill they survived while training" if window else
           "Survivors' RSS at the end over their RSS just before the first kill they survived while training")
    lines += ["", f"One normal step: {f(an['normal_step_s'])} s{how}. {rss} (swaps survived): "
              + ", ".join(f"{k} x{f(v, 3)} ({n.get(k, '?')})" for k, v in g.items())
              + f". Losses bit-identical to an uninterrupted run: {an['losses_identical']}.", "",
              *_control_lines(doc, f),
              "Targets: " + "; ".join(f"{k} {'met' if t['met'] else 'NOT met'}" for k, t in an["targets"].items())
              + f" (restored at most {TARGET_RESTORED_S} s and next step at most one step + {TARGET_RESTORED_S} s "
              f"for every swap; the memory of the survivors of every swap, "
              f"{', '.join(an['targets']['survivor_memory'].get('judged_on') or []) or 'none'}, within "
              f"{TARGET_MEMORY - 1:.0%} of "
              f"{an['targets']['survivor_memory'].get('against') or 'its own RSS before the first swap'})."]
    return "\n".join(lines) + "\n"


def _control_lines(doc: dict[str, Any], f: Callable[..., str]) -> list[str]:
    """The control's paragraph: the job without kills over the same windows, and each survivor's parts of RSS."""
    ctl, an = doc.get("control"), doc["analysis"]
    if not ctl:
        return []
    mb = 2 ** 20

    def parts(d: dict[str, Any], k: str) -> str:
        return ", ".join(f"{name} {f((d.get(p) or {}).get(k, 0) / mb, 0)} MB"
                         for p, name in (("rss_anon", "anonymous"), ("rss_shmem", "/dev/shm")))

    judged = an["targets"]["survivor_memory"].get("judged_on") or []
    growth = ", ".join(f"{k} x{f(v, 3)}" for k, v in (an.get("control_rss_growth") or {}).items() if k in judged)
    each = "; ".join(f"{k} x{f(v, 3)} ({f(doc['run']['rss_end'][k] / mb, 0)} MB against "
                     f"{f(ctl['rss_end'][k] / mb, 0)} MB; with kills {parts(doc['run'].get('parts_end') or {}, k)}, "
                     f"without {parts(ctl.get('parts_end') or {}, k)})"
                     for k, v in (an.get("survivor_rss_vs_control") or {}).items())
    heap = an.get("survivor_heap_vs_control") or {}
    ctl_heap = ctl.get("heap_end") or {}
    heap_line = ("" if doc["run"].get("heap_end") is None else
                 " The allocator's bytes in use (glibc's `mallinfo2`, `benchmarks/heap_probe/`) at the last step over "
                 "the same worker's without kills (the judged figure): " + ("; ".join(
                     f"{k} x{f(v, 3)} ({f(doc['run']['heap_end'][k] / mb, 0)} MB against {f(ctl_heap[k] / mb, 0)} "
                     "MB)" for k, v in heap.items()) or "-") + "; over its own before the first kill it survived: "
                 + (", ".join(f"{k} x{f(v, 3)}" for k, v in (an.get("survivor_heap_growth") or {}).items()
                              if k in judged) or "-") + ".")
    rss_judged = " (the judged figure)" if doc["run"].get("heap_end") is None else ""
    return [f"Control: the same job under `deadpool-run` with its spare and no kills, sampled over the same windows "
            f"by step. Its RSS growth over the same steps: {growth or '-'}. At the last step, each survivor's RSS over "
            f"the same worker's without kills{rss_judged}: {each or '-'}.{heap_line}", ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--first-kill", type=int, default=3)
    p.add_argument("--gap", type=int, default=3, help="steps at least between two kills")
    p.add_argument("--slack", type=int, default=4,
                   help="steps the job runs more per swap than --gap asks: a kill waits for a step begun once the "
                        "current spare was built")
    p.add_argument("--kill-ranks", default="1,2,1,2,1",
                   help="the rank whose holder each swap kills, in turn (default: a different node each time, rank "
                        "0's holder surviving all five)"),
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--rss-window-s", type=float, default=12.0,
                   help="the memory judgement's windows: each worker's median RSS over this long (a few steps) before "
                        "the first kill it survived and before the last step")
    p.add_argument("--no-control", action="store_true",
                   help="skip the memory's control run (the same job, no kills; ~2 min): the memory target is then "
                        "judged on each survivor's own growth alone")
    add_output_args(p, "five_swaps")
    a = p.parse_args(argv)
    if a.render_only:
        return render_only(a.render_only, render)
    try:
        a.kill_ranks = [int(r) for r in a.kill_ranks.split(",")]
    except ValueError:
        p.error(f"--kill-ranks: comma-separated ranks 0-2, got {a.kill_ranks!r}")
    if a.swaps < 1 or a.first_kill < 3 or a.gap < 2 or a.slack < 0 or not all(0 <= r <= 2 for r in a.kill_ranks):
        p.error("--swaps >= 1, --first-kill >= 3, --gap >= 2, --slack >= 0 and --kill-ranks within 0-2")
    t0 = time.time()
    logs = os.path.join(a.out, f"{a.name}_logs")
    os.makedirs(logs, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_five.")
    doc: dict[str, Any] = {"benchmark": "five_swaps", "title": "Five consecutive hot-swaps, each spare replaced by a "
                           "joining machine", "date": time.strftime("%Y-%m-%d"), "size": a.size,
                           "command": shlex.join(["python", "benchmarks/bench_five_swaps.py", *sys.argv[1:]]),
                           "machine": machine_info(), "swaps_planned": a.swaps}
    try:
        doc["run"] = run(a, scratch, logs)
        doc["reference_losses"] = reference(a, scratch, logs, doc["run"]["train_iters"])
        if not a.no_control:
            doc["control"] = control(a, scratch, logs, doc["run"]["swaps"], doc["run"]["train_iters"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc["wall_s"] = time.time() - t0
    doc["analysis"] = analyse(doc)
    print(save_result(a.out, a.name, doc, render), flush=True)
    return 0 if doc["run"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
