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
* ``node0``, ``node2`` (``--per-node``, the default; issue 44) the ``hotswap`` job killing each other active node in
                turn: the spare built its engine for node1's rank, so here it takes another rank (relabelled in
                place, ``integrations/deepspeed/takeover.py``). Per node min / median / max, the worst node as the
                headline, the expected value (uniform failures) and the best beside it (``recovery_nodes.py``).
* ``reference`` (``--reference-sizes``) the baseline command without checkpointing and without a fault: the
                loss trajectory of an uninterrupted run.

The kill lands at the same point of the step cycle in both jobs: ``--kill-delay-frac`` (default 0.5) of a
normal step after rank 0 logged step K, i.e. in the middle of step K+1, whose work is lost in both jobs.

Definitions (all wall clock, ``time.time()`` of this host; rank 0's metrics record ``time`` is written right
after a step completes):

* ``raw_s``       = time of the first metrics record whose step is > the last step completed before the kill,
                    minus ``t_kill``. This is "SIGKILL to the next completed step", end to end; it contains the
                    redo of the step that was in flight (and any older step the restored state predates).
* ``minus_step_s`` = ``raw_s`` - one normal step (median ``step_time_s`` of every step of the same job but the
                    warm-up step 1 and the redone step; for the relaunch, steps 2..K and the relaunched job's steps
                    after its first): the time recovery costs on top of redoing the interrupted step.
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

Writes ``benchmarks/results/recovery.json`` and ``.md`` (``recovery_quick.*`` for --quick, ``--name`` to choose)
and the jobs' logs under ``benchmarks/results/recovery_logs/`` (``<name>_logs/``). Without running anything:

    python benchmarks/bench_recovery.py --rerender RESULTS.json      # recompute the analysis, rewrite JSON + .md
    python benchmarks/bench_recovery.py --render-only RESULTS.json   # rewrite only the .md, from the JSON as saved

This file is the command line and the loop over sizes and repeats. The work is in four modules beside it:
``recovery_procs.py`` (a job's processes: sampling, logs, fault injection, hang detection), ``recovery_run.py``
(settings per size; the hot-swap, baseline and reference jobs), ``recovery_analyse.py`` (runs -> medians,
speedups, targets, loss checks) and ``recovery_render.py`` (results document -> markdown).
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
from common import REPO, machine_info, write_json, write_text  # noqa: E402
from recovery_analyse import TARGET_E2E_S, TARGET_SPEEDUP, analyze_size  # noqa: E402
from recovery_nodes import analyze_nodes  # noqa: E402
from recovery_render import _f, render_markdown  # noqa: E402
from recovery_run import (  # noqa: E402
    DEFAULTS,
    KILL_RANK,
    KILL_WORKER,
    NNODES,
    NPROC_PER_NODE,
    SPARE_NODES,
    UNREADY_WORKER,
    params_from_logs,
    rss_end,
    run_baseline,
    run_hotswap,
    run_reference,
    run_solo,
)

OTHER_NODES = [f"node{i}" for i in range(NNODES) if f"node{i}.0" != KILL_WORKER]
"""The active nodes the ``--per-node`` runs kill besides the ``hotswap`` runs' node1 (issue 44)."""


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
        entry["analysis"] = analyse_entry(size, entry)
    write_json(path, doc)
    md_path = os.path.splitext(path)[0] + ".md"
    write_text(md_path, render_markdown(doc))
    print(f"[bench] rewrote {path} and {md_path}")
    return 0


def render_only(path: str) -> int:
    """Rewrite the markdown of an existing results JSON from the document as saved: no jobs, no re-analysis, the
    JSON is left as it is (``--rerender`` also recomputes the analysis and rewrites the JSON)."""
    with open(path) as fh:
        doc = json.load(fh)
    md_path = os.path.splitext(path)[0] + ".md"
    write_text(md_path, render_markdown(doc))
    print(f"[bench] wrote {md_path} from {path}")
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
    p.add_argument("--unready", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the default path killing a node the spare did not build its engine for (node2: "
                        "the spare starts again from the script's first line)")
    p.add_argument("--per-node", action=argparse.BooleanOptionalAction, default=True,
                   help="kill each active node in turn (the hotswap runs kill node1, the node the spare shadows; "
                        "node0 and node2 runs beside them, issue 44); replaces --unready")
    p.add_argument("--rebuild", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the hot-swap with hot_swap.in_place false (every rank rebuilds its engine)")
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
    p.add_argument("--render-only", metavar="JSON", default=None,
                   help="rewrite the markdown beside an existing results file from the JSON as saved (the JSON "
                        "itself is not touched), run nothing")
    args = p.parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)
    if args.render_only:
        return render_only(args.render_only)

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
                     "killed": {"hotswap": KILL_WORKER, "unready": UNREADY_WORKER,
                                "per_node": [f"{n}.0" for n in OTHER_NODES] if args.per_node else [],
                                "baseline": f"RANK={KILL_RANK}"},
                     "kill_delay_frac": args.kill_delay_frac, "seed": args.seed,
                     "settle_s": args.settle_s, "settle_busy": args.settle_busy},
        "definitions": {
            "raw_s": "time of the first metrics record with step > last step completed before the kill, minus t_kill",
            "minus_step_s": "raw_s minus the median step_time_s of every step but step 1 and the redone step (the "
                            "relaunch: steps 2..K and the relaunched job's steps after its first)",
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
                                     "runs": {"hotswap": [], "unready": [], "rebuild": [], "baseline": [],
                                              "per_node": {}, "solo": [], "reference": None}}
            doc["sizes"][size] = entry
            size_scratch = os.path.join(scratch, size)  # metrics files are appended to: never share them across sizes
            os.makedirs(size_scratch, exist_ok=True)
            try:
                others = OTHER_NODES if args.per_node else []
                kinds = ["hotswap", *others, *(["unready"] if args.unready and not args.per_node else []),
                         *(["rebuild"] if args.rebuild else []), "baseline", *(["solo"] if args.per_node else [])]
                for i in range(d["repeats"]):
                    # Rotate the order so slow drift of the shared machine does not favour one side.
                    order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]
                    for kind in order:
                        if kind not in ("baseline", "solo") and d.get("hotswap_skip") and not args.force_hotswap:
                            if i == 0:
                                print(f"[bench] {size}: {kind} not run: {d['hotswap_skip']}", flush=True)
                            continue
                        if kind == "baseline":
                            res = run_baseline(size, d, size_scratch, f"{kind}_r{i}", args, logs)
                        elif kind == "solo":  # the relaunch's floor: one rank's start-up alone (recovery_run.py)
                            res = run_solo(size, d, size_scratch, f"{kind}_r{i}", args, logs)
                        else:
                            # hotswap: today's default (hot_swap.in_place true; the spare built ahead for the killed
                            # node); unready: the same, another node killed; rebuild: every rank rebuilds
                            mode = {"hot_swap": {"in_place": kind != "rebuild"}}
                            victim = (UNREADY_WORKER if kind == "unready" else f"{kind}.0" if kind in others
                                      else None)
                            dk = {**d, "deadpool": {**d.get("deadpool", {}), **mode},
                                  **({"kill_worker": victim} if victim else {})}
                            res = run_hotswap(size, dk, size_scratch, f"{kind}_r{i}", args, logs)
                            res["kind"] = kind
                        if kind in others:
                            entry["runs"]["per_node"].setdefault(kind, []).append(slim(res))
                        else:
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
            entry["params"] = params_from_logs(entry)
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


def analyse_entry(size: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The default path's analysis, with the same analysis over the rebuild and unready runs (against the same
    baseline) beside it."""
    an = analyze_size(size, entry)
    for other in ("rebuild", "unready"):
        if entry["runs"].get(other):
            an[other] = analyze_size(size, {**entry, "runs": {**entry["runs"], "hotswap": entry["runs"][other]}})
    per_node = analyze_nodes(entry, KILL_WORKER.split(".")[0])
    if per_node is not None:  # results without --per-node runs keep their analysis as it was
        an["per_node"] = per_node
    return an


def _save(doc: dict[str, Any], entry: dict[str, Any], size: str, json_path: str, md_path: str, t_start: float) -> None:
    entry["params"] = params_from_logs(entry)
    try:
        entry["analysis"] = analyse_entry(size, entry)
    except Exception as exc:  # noqa: BLE001 - a partial result still gets written
        entry["analysis"] = None
        entry["analysis_error"] = f"{type(exc).__name__}: {exc}"
    doc["wall_s"] = time.time() - t_start
    write_json(json_path, doc)
    write_text(md_path, render_markdown(doc))


def _print_run(size: str, r: dict[str, Any]) -> None:
    if r.get("failed"):
        print(f"[bench] {size} {r['tag']}: FAILED: {r['failed']} "
              f"(log {r.get('log') or (r.get('job1') or {}).get('log')})",
              flush=True)
    if r["kind"] == "solo" and r.get("startup_s") is not None:
        print(f"[bench] {size} {r['tag']}: one rank alone, launch -> ready {r['startup_s']:.2f} s", flush=True)
    if r.get("raw_s") is None:
        return
    extra = ""
    if r["kind"] in ("hotswap", "unready", "rebuild", *OTHER_NODES) and r.get("phases"):
        ph = r["phases"]
        extra = " phases " + " ".join(f"{k[:-2]} {_f(ph.get(k))}" for k in
                                      ("detect_s", "assign_s", "spare_s", "communicators_s", "rebuild_s", "restore_s",
                                       "recompute_s", "total_s"))
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
