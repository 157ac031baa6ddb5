#!/usr/bin/env python
"""A Megatron-Core job, every node killed in turn: hot-swap against relaunch + ``--load`` (issue 44, parts 3 and 4).

The job is ``scripts/pretrain_gpt_megatron.py`` (GPT ``--size``, TP2 x DP2: 2 nodes of 2 ranks, one tensor-parallel
pair per node), on today's defaults of the ``deadpool`` section (snapshots every iteration, a replica on the other
node, the in-place swap, the spare built ahead). Per repeat, four jobs:

* ``node1``    ``deadpool-run --nnodes 2 --nproc-per-node 2 --spare-nodes 1``: the spare built its model ahead for
               node1's ranks (2 and 3); after iteration K node1.1 is SIGKILLed, the launcher fences the node;
* ``node0``    the same, node0.1 killed: the spare built for node1 takes ranks 0 and 1, another data-parallel replica
               of the same tensor-parallel shards (its groups renamed after the exchange of the two nodes' ranks,
               ``rebuild/regroup.py``; where that cannot be, it starts its script again);
* ``rebuild``  node0.1 killed with ``hot_swap.in_place: false``: every rank rebuilds, the spare builds after its
               assignment (the path the fallback must not be slower than);
* ``relaunch`` what a Megatron user has without the extension: ``torchrun --nproc-per-node 4`` with a tier-3 base
               every iteration (``--save DIR --save-interval 1``, the section off); rank 1 SIGKILLed once base K is
               written; torchrun fails; the same command is relaunched at once with ``--load DIR``.

Measured (wall clock of this host, rank 0's metrics records): ``restored_s`` kill -> every rank restored (hot-swap:
detect + agree + rebuild + restore from the job's timeline; relaunch: the start of the relaunched job's first iteration,
its record's time minus its own step time, i.e. after the base loaded); ``raw_s`` kill -> the next completed iteration;
``minus_step_s`` = raw minus one normal iteration (the median of every iteration but the first and the redone one).
Losses after the kill against an uninterrupted run of the same script and layout (plain torchrun, the section off) bit
for bit. How the spare took the ranks is read from its ``spare_assigned`` events.

    python benchmarks/bench_megatron_nodes.py                # 3 repeats, ~8 min on 2 cores (GPT tiny)

Writes ``benchmarks/results/megatron_nodes.json`` and ``.md``, the jobs' logs under ``megatron_nodes_logs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, add_output_args, machine_info, median, render_only, save_result  # noqa: E402
from recovery_procs import Monitor, append_event, read_records, run_logged, steady_step_s, wait_and_kill  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

SCRIPT = os.path.join(REPO, "scripts", "pretrain_gpt_megatron.py")
KILL = {"node1": "node1.1", "node0": "node0.1", "rebuild": "node0.1", "relaunch": "1"}
KINDS = ("node1", "node0", "rebuild", "relaunch")
SWAPS = ("node1", "node0", "rebuild")
TARGET_RESTORED_S, TARGET_SPEEDUP = 1.0, 10.0


def _config(path: str, shm_root: str | None, in_place: bool = True) -> str:
    section: dict[str, Any] = ({"enabled": False} if shm_root is None else {"local": {"shm_root": shm_root}})
    if not in_place:
        section["hot_swap"] = {"in_place": False}
    with open(path, "w") as fh:
        json.dump({"deadpool": section}, fh)
    return path


LAYOUTS = {"tp2": ("--tensor-model-parallel-size", "2"), "pp2": ("--pipeline-model-parallel-size", "2")}
"""``tp2``: TP2 x DP2, each node one tensor-parallel pair, so node0 is another data-parallel replica of node1's
shards (the spare relabels); ``pp2``: PP2 x DP2, node0 stage 0 and node1 stage 1, so a spare built for node1 cannot
take node0's stage in place and starts again from its script's first line (the fallback, from its warm parent:
``rebuild/warm.py``)."""


LAYOUTS_SAID = {"pp2": """PP2 x DP2 instead of TP2 x DP2 (`--pipeline-model-parallel-size 2`): node0 holds pipeline
stage 0 (ranks 0 and 1, data-parallel replicas of it), node1 stage 1. The spare built ahead for node1's stage cannot
take stage 0 in place, so killing node0 measures the fallback: the spare starts again from its script's first line,
as a fresh child of its warm parent, the imports done (`rebuild/warm.py`)."""}


def _args(a: argparse.Namespace, cfg: str, metrics: str, *extra: str) -> tuple[str, ...]:
    return (*LAYOUTS[a.layout], "--model-size", a.size, "--train-iters", str(a.steps),
            "--deadpool-config", cfg, "--metrics-out", metrics, *extra)


def _after(recs: list[dict[str, Any]], t_kill: float, last_pre: int) -> dict[str, Any] | None:
    return next((r for r in recs if r["time"] > t_kill and r["step"] > last_pre), None)


def next_step_s(run: dict[str, Any]) -> float | None:
    """Pure: kill -> the first iteration completed after every rank was restored. An iteration's steps take 0.06 s
    here, so the kill (half a step after an iteration was logged) can land after the next one's collectives were
    done on every rank and before rank 0 logged it: that record, milliseconds after the kill, is not the recovery's
    next step. Relaunch: as measured (its records are the relaunched job's)."""
    if run.get("kind") == "relaunch" or run.get("restored_s") is None or "t_kill" not in run:
        return run.get("raw_s")
    first = _after(run.get("records") or [], run["t_kill"] + run["restored_s"], run.get("last_step_before_kill", 0))
    return first["time"] - run["t_kill"] if first else None


def run_swap(kind: str, scratch: str, logs: str, a: argparse.Namespace, tag: str) -> dict[str, Any]:
    from deadpool_ext.recovery.timeline import phases, read_events
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env

    shm = os.path.join("/dev/shm", f"bench_megatron_nodes.{os.getpid()}.{tag}")
    os.makedirs(shm, exist_ok=True)
    metrics, timeline = os.path.join(scratch, f"{tag}.jsonl"), os.path.join(scratch, f"{tag}.timeline.jsonl")
    cfg = _config(os.path.join(scratch, f"{tag}.deadpool.json"), shm, in_place=kind != "rebuild")
    job = Job(script=SCRIPT, nnodes=2, nproc_per_node=2, spare_nodes=1, shm_root=shm, timeline=timeline,
              args=_args(a, cfg, metrics))
    out: dict[str, Any] = {"kind": kind, "tag": tag, "cmd": shlex.join(job.argv())}

    def hook(proc: Any, deadline: float) -> None:
        mon = Monitor(proc.pid, "DEADPOOL_WORKER_ID", shm, script=SCRIPT)
        # the spare has built its model (its two spare_ready events) before the kill
        while (kind != "rebuild" and (not os.path.exists(timeline)
                or sum(1 for e in read_events(timeline) if e.get("event") == "spare_ready") < 2)
               and time.time() < deadline and proc.poll() is None):
            time.sleep(0.1)
        kill = wait_and_kill(proc, deadline, mon, metrics, a.kill_step, 0.5, KILL[kind])
        append_event(timeline, {"event": "fault", "time": kill["t_kill"], "generation": 0, "source": "injector",
                                "pid": kill["killed_pid"], "worker": KILL[kind]})
        out["t_kill"] = kill["t_kill"]

    try:
        res = run_logged(job.argv(), env=base_env(), timeout_s=a.timeout_s, hook=hook,
                         log_path=os.path.join(logs, f"{tag}.log"))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    recs = read_records(metrics)
    out.update(returncode=res["returncode"], log=res["log"], records=recs)
    if "t_kill" not in out or res["returncode"] != 0:
        out["failed"] = res["error"] or f"rc {res['returncode']}"
        return out
    t_kill = out["t_kill"]
    last_pre = max((r["step"] for r in recs if r["time"] <= t_kill), default=0)
    events = read_events(timeline)
    row = next((p for p in phases(events) if p["generation"] == 1), None)
    parts = [row.get(k) for k in ("detect_s", "agree_s", "rebuild_s", "restore_s")] if row else [None]
    first = _after(recs, t_kill + (sum(parts) if None not in parts else 0.0), last_pre)  # see next_step_s
    ready = [e for e in events if e.get("event") == "spare_ready"]
    out["how"] = sorted({str(e.get("how")) for e in events if e.get("event") == "spare_assigned"})
    out["spare_ready"] = [{k: e.get(k) for k in ("worker", "rank", "prologue_s", "engine_s", "any_rank", "why_not")}
                          for e in ready]
    out.update(phases=row, last_step_before_kill=last_pre,
               normal_step_s=steady_step_s(recs, {first["step"]} if first else set()),
               raw_s=first["time"] - t_kill if first else None,
               first_step_time_after_s=first["step_time_s"] if first else None,
               restored_s=sum(parts) if None not in parts else None)
    return out


def run_relaunch(scratch: str, logs: str, a: argparse.Namespace, tag: str) -> dict[str, Any]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    cfg = _config(os.path.join(scratch, f"{tag}.deadpool.json"), None)
    save = os.path.join(scratch, f"{tag}.save")
    m1, m2 = os.path.join(scratch, f"{tag}.1.jsonl"), os.path.join(scratch, f"{tag}.2.jsonl")
    tier3 = ("--save", save, "--save-interval", "1")
    first = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=4, port=free_port(), args=_args(a, cfg, m1, *tier3))
    out: dict[str, Any] = {"kind": "relaunch", "tag": tag, "cmd": shlex.join(first.argv())}
    ready = os.path.join(save, f"iter_{a.kill_step:07d}")  # the base's name (integrations/megatron/checkpoint.py)

    def hook(proc: Any, deadline: float) -> None:
        mon = Monitor(proc.pid, "RANK", None, script=SCRIPT)
        kill = wait_and_kill(proc, deadline, mon, m1, a.kill_step, 0.5, KILL["relaunch"],
                             ready=lambda: os.path.isdir(ready))
        out["t_kill"] = kill["t_kill"]
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        out["t_exit"] = time.time()

    run_logged(first.argv(), env=base_env(), timeout_s=a.timeout_s, hook=hook,
               log_path=os.path.join(logs, f"{tag}_1.log"))
    if "t_kill" not in out:
        out["failed"] = "no fault injected"
        return out
    again = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=4, port=free_port(),
                args=_args(a, cfg, m2, *tier3, "--load", save))
    out["relaunch_cmd"] = shlex.join(again.argv())
    res = run_logged(again.argv(), env=base_env(), timeout_s=a.timeout_s, log_path=os.path.join(logs, f"{tag}_2.log"))
    r1, r2 = read_records(m1), read_records(m2)
    t_kill = out["t_kill"]
    last_pre = max((r["step"] for r in r1 if r["time"] <= t_kill), default=0)
    nxt = _after(r2, t_kill, last_pre)
    resumed = r2[0] if r2 else None
    out.update(returncode=res["returncode"], log=res["log"], records=[r for r in r1 if r["step"] <= last_pre] + r2,
               last_step_before_kill=last_pre,
               normal_step_s=steady_step_s([r for r in r1 if r["step"] <= a.kill_step], set(), after=r2),
               resumed_at_step=resumed["step"] - 1 if resumed else None,
               raw_s=nxt["time"] - t_kill if nxt else None,
               first_step_time_after_s=nxt["step_time_s"] if nxt else None,
               restored_s=resumed["time"] - resumed["step_time_s"] - t_kill if resumed else None,
               detect_s=out["t_exit"] - t_kill)
    if res["returncode"] != 0 or nxt is None:
        out["failed"] = res["error"] or f"relaunch rc {res['returncode']}"
    return out


def reference(scratch: str, logs: str, a: argparse.Namespace) -> dict[int, float]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port

    m = os.path.join(scratch, "reference.jsonl")
    job = Job(launcher="torchrun", script=SCRIPT, nproc_per_node=4, port=free_port(),
              args=_args(a, _config(os.path.join(scratch, "ref.deadpool.json"), None), m))
    run_logged(job.argv(), env=base_env(), timeout_s=a.timeout_s, log_path=os.path.join(logs, "reference.log"))
    return {r["step"]: r["loss"] for r in read_records(m)}


def _stats(vals: list[float]) -> dict[str, float | None]:
    return {"min": min(vals) if vals else None, "median": median(vals), "max": max(vals) if vals else None}


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    """Per kind: restored (min/median/max), raw, minus one step, losses, how the spare took over; the worst node's
    median against the relaunch's median, and the issue's targets judged on the worst node (pure)."""
    ref = {int(k): v for k, v in doc["reference_losses"].items()}
    an: dict[str, Any] = {}
    for kind in KINDS:
        ok = [r for r in doc["runs"] if r["kind"] == kind and not r.get("failed")]
        same = [bool(r["records"]) and all(ref.get(x["step"]) == x["loss"] for x in r["records"]) for r in ok]
        restored = [r["restored_s"] for r in ok if r.get("restored_s") is not None]
        raw = median([x for r in ok if (x := next_step_s(r)) is not None])
        step = median([r["normal_step_s"] for r in ok if r.get("normal_step_s") is not None])
        an[kind] = {"n": len(ok), "restored": _stats(restored), "raw_s": raw, "normal_step_s": step,
                    "minus_step_s": raw - step if raw is not None and step is not None else None,
                    "restored_each_s": restored, "losses_identical": bool(ok) and all(same),
                    "how": sorted({h for r in ok for h in r.get("how") or []})}
    rl = an["relaunch"]["restored"]["median"]
    for kind in SWAPS:
        mine = an[kind]["restored"]["median"]
        an[kind]["speedup_restored"] = rl / mine if rl and mine else None
    meds = {k: an[k]["restored"]["median"] for k in ("node1", "node0")}
    worst = max(meds, key=lambda k: meds[k] or float("inf")) if all(meds.values()) else None
    an["worst"] = worst
    an["expected_s"] = sum(meds.values()) / 2 if all(meds.values()) else None  # type: ignore[arg-type]
    covered = [k for k in ("node1", "node0") if an[k]["how"] and set(an[k]["how"]) <= {"as_built", "relabel"}]
    an["covered"] = covered

    def judged(k: str) -> dict[str, Any]:
        v, s = an[k]["restored"]["median"], an[k]["speedup_restored"]
        return {"restored_s": v, "restored_met": v is not None and v <= TARGET_RESTORED_S,
                "speedup": s, "speedup_met": s is not None and s >= TARGET_SPEEDUP,
                "losses_identical": an[k]["losses_identical"]}

    an["targets"] = {k: judged(k) for k in ("node1", "node0")}
    # the rule for a node the spare cannot take in place: its fallback is never slower than the rebuild path
    # judged on the rounds, paired: the two ran back to back in each, so the host's drift between rounds cancels
    fb, rb = an["node0"]["restored"]["median"], an["rebuild"]["restored"]["median"]
    diffs = paired_diffs(doc["runs"], "node0", "rebuild")
    med = median(diffs)
    an["fallback_vs_rebuild"] = {"fallback_s": fb, "rebuild_s": rb, "ratio": fb / rb if fb and rb else None,
                                 "paired_diffs_s": diffs, "paired_median_s": med,
                                 "rounds_not_slower": sum(1 for d in diffs if d <= 0),
                                 "met": med is not None and med <= 0}
    return an


def paired_diffs(runs: list[dict[str, Any]], a: str, b: str) -> list[float]:
    """Pure: per round (the ``_r<i>`` of a run's tag) where both kinds restored, ``a``'s restored time minus ``b``'s."""
    by = {(r["kind"], r["tag"].rsplit("_r", 1)[-1]): r.get("restored_s") for r in runs if not r.get("failed")}
    rounds = sorted({i for k, i in by if k == a} & {i for k, i in by if k == b}, key=int)
    return [by[(a, i)] - by[(b, i)] for i in rounds if by[(a, i)] is not None and by[(b, i)] is not None]


def render(doc: dict[str, Any]) -> str:
    an = doc["analysis"]

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    head = ("| | node1 killed (the spare built for it) | node0 killed (another node) | node0 killed, "
            "`hot_swap.in_place: false` (the rebuild path) | relaunch + `--load` |")
    lines = [f"# {doc['title']}", "", f"Measured {doc['date']} with `{doc['command']}` ({doc['wall_s']:.0f} s), "
             f"{doc['repeats']} repeat(s) per kind, GPT {doc['size']}, on {doc['machine'].get('cpu_count', '?')} "
             "CPUs. " + " ".join((__doc__ or "").split("\n\n")[1].split()).replace(
                 "Per repeat, four jobs:", "Per repeat, four jobs (the fourth: node0 killed on the rebuild path, "
                 "`hot_swap.in_place: false`, where every rank rebuilds and the spare builds after its assignment):"),
             *(["", f"This run's layout is `--layout {doc['layout']}`: " + " ".join(
                 (LAYOUTS_SAID.get(doc["layout"]) or "").split())] if doc.get("layout", "tp2") != "tp2" else []),
             "", head, "|---|---|---|---|---|"]
    rows = [("kill -> every rank restored, median (s)", lambda k: f(an[k]["restored"]["median"])),
            ("min - max (s)", lambda k: f"{f(an[k]['restored']['min'])} - {f(an[k]['restored']['max'])}"),
            ("kill -> next completed iteration (s)", lambda k: f(an[k]["raw_s"])),
            ("that minus one normal iteration (s)", lambda k: f(an[k]["minus_step_s"])),
            ("normal iteration (s)", lambda k: f(an[k]["normal_step_s"])),
            ("losses bit-identical to the uninterrupted run", lambda k: str(an[k]["losses_identical"])),
            ("each repeat, restored (s)", lambda k: ", ".join(f(x) for x in an[k]["restored_each_s"]))]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(k) for k in KINDS) + " |")
    lines.append("| speedup against the relaunch (restored, medians) | " + " | ".join(
        f"{f(an[k]['speedup_restored'], 1)}x" for k in SWAPS) + " | |")
    lines.append("| how the spare took the ranks | " + " | ".join(
        ", ".join(an[k]["how"]) or "after its assignment" for k in SWAPS) + " | |")
    ready = next((r.get("spare_ready") for r in doc["runs"] if r.get("spare_ready")), None)
    if ready:
        e = ready[0]
        lines += ["", f"The spare, before any failure: script up to its model {f(e.get('prologue_s'))} s, model "
                  f"{f(e.get('engine_s'))} s; takes any node's ranks in place: {e.get('any_rank')}"
                  + (f" ({e.get('why_not')})" if e.get("why_not") else "") + "."]
    failed = [f"{r['tag']} ({r['failed']})" for r in doc["runs"] if r.get("failed")]
    if failed:
        lines += ["", "Runs that failed, left out of the medians: " + "; ".join(failed) + " (logs: "
                  f"`{doc['name']}_logs/`)."]
    worst = an.get("worst")
    lines += ["", f"Worst node: {worst or '?'} ({f(an[worst]['restored']['median']) if worst else '-'} s); expected "
              f"under a uniformly drawn failure {f(an.get('expected_s'))} s; taken in place by the spare built ahead: "
              f"{', '.join(an['covered']) or 'none'}."]
    for k, t in an["targets"].items():
        lines.append(f"- {k}: restored {f(t['restored_s'])} s against {TARGET_RESTORED_S} s "
                     f"({'met' if t['restored_met'] else 'NOT met'}); {f(t['speedup'], 1)}x the relaunch against "
                     f"{TARGET_SPEEDUP:.0f}x ({'met' if t['speedup_met'] else 'NOT met'}); losses identical "
                     f"{t['losses_identical']}.")
    fr = an.get("fallback_vs_rebuild") or {}
    diffs = fr.get("paired_diffs_s")
    pair = (f"; paired round by round, the fallback minus the rebuild path: median {f(fr.get('paired_median_s'))} s "
            f"({', '.join(f'{d:+.2f}' for d in diffs)}), not slower in {fr.get('rounds_not_slower')} of {len(diffs)} "
            "rounds" if diffs else "")
    lines.append(f"- node0 (a node the spare did not build for) against the rebuild path: {f(fr.get('fallback_s'))} s "
                 f"against {f(fr.get('rebuild_s'))} s{pair} ({'not slower' if fr.get('met') else 'SLOWER'}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="tiny", choices=("tiny", "small"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--layout", default="tp2", choices=sorted(LAYOUTS),
                   help="tp2: TP2 x DP2 (node0 another data-parallel replica); pp2: PP2 x DP2 (node0 another "
                        "pipeline stage: the spare's fallback)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="the kinds each round runs, in turn, rotated every round (default all four); "
                        "'node0,rebuild' pairs the fallback with the rebuild path alone")
    add_output_args(p, "megatron_nodes")
    a = p.parse_args(argv)
    if a.render_only:
        return render_only(a.render_only, render)
    if a.kill_step < 3 or a.kill_step >= a.steps:
        p.error("--kill-step must be >= 3 and < --steps")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or not set(kinds) <= set(KINDS) or len(set(kinds)) != len(kinds):
        p.error(f"--kinds: distinct kinds among {', '.join(KINDS)}, comma-separated; got {a.kinds!r}")
    t0 = time.time()
    logs = os.path.join(a.out, f"{a.name}_logs")
    os.makedirs(logs, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_megatron_nodes.")
    doc: dict[str, Any] = {"benchmark": "megatron_nodes", "name": a.name, "size": a.size,
                           "layout": a.layout,
                           "title": f"A Megatron-Core job ({a.layout.upper()} x DP2), every node killed in turn: "
                                    "hot-swap against relaunch + --load", "date": time.strftime("%Y-%m-%d"),
                           "command": shlex.join(["python", "benchmarks/bench_megatron_nodes.py", *sys.argv[1:]]),
                           "machine": machine_info(("torch", "megatron.core", "numpy")), "repeats": a.repeats,
                           "kinds": kinds,
                           "runs": []}
    try:
        doc["reference_losses"] = reference(scratch, logs, a)
        for i in range(a.repeats):
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:  # rotated: the host's drift favours none
                tag = f"{kind}_r{i}"
                run = run_relaunch(scratch, logs, a, tag) if kind == "relaunch" else run_swap(kind, scratch, logs, a,
                                                                                               tag)
                doc["runs"].append(run)
                print(f"[bench] {tag}: restored {run.get('restored_s')} raw {run.get('raw_s')} "
                      f"step {run.get('normal_step_s')} how {run.get('how')} {run.get('failed') or ''}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc["wall_s"] = time.time() - t0
    doc["analysis"] = analyse(doc)
    print(save_result(a.out, a.name, doc, render), flush=True)
    return 0 if all(not r.get("failed") for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
