"""bench_recovery, the markdown: renders a results document (the JSON as saved) into the ``.md`` summary.

Reads only the document, so ``bench_recovery.py --render-only JSON`` rewrites a summary from a saved result
without running or re-analysing anything. Results written before a field existed ("ready", the raw ceiling) get
it computed here from the runs. Split out of the single-file ``bench_recovery.py`` without changing the output.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from outside benchmarks/: common.py and the recovery_* modules live here
    sys.path.insert(0, HERE)
from common import fmt_bytes, fmt_s, md_table, median  # noqa: E402
from recovery_analyse import TARGET_SPEEDUP, raw_speedup_ceiling, ready_to_redo  # noqa: E402
from recovery_nodes import render_nodes  # noqa: E402
from recovery_run import KILL_WORKER  # noqa: E402


def _old_step(doc: dict[str, Any]) -> bool:
    """A result measured when one normal step was the median of steps 2..K alone (its ``definitions`` say so)."""
    return "steps 2..K of the same job" in (doc.get("definitions") or {}).get("minus_step_s", "")


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
             f"{str((m.get('git') or {}).get('commit'))[:10]}{' (dirty)' if (m.get('git') or {}).get('dirty') else ''}"
             f", deadpool_ext source digest {(m.get('source_digest') or {}).get('deadpool_ext')}; {m.get('time_utc')}; "
             f"total wall {_f(doc.get('wall_s'), 0)} s.")
    L.append("")
    L.append("Setup: GPT-2 (HF architecture), DeepSpeed ZeRO-3 fp32, torch Adam, 3 ranks, one per simulated node, on "
             "one 2-core host (`OMP_NUM_THREADS=1`). Hot-swap: `deadpool-run --nnodes 3 --nproc-per-node 1 "
             "--spare-nodes 1`, snapshots every step, replication factor 1; the worker `node1.0` (rank 1) is SIGKILLed "
             "and its node's memory is dropped by the launcher, so rank 1's state comes from a peer replica; the "
             "spare shadows node1 (it built its engine for rank 1 before the kill). The `unready` runs kill "
             "`node2.0` instead (the spare starts its script again for rank 2). Baseline: "
             "`torchrun` with a DeepSpeed checkpoint to local disk every step, rank 1 SIGKILLed once checkpoint K is "
             "committed, relaunched at once (no scheduler delay) with `--load`. Kill point in both: "
             f"{doc['settings']['kill_delay_frac']} of a normal step after rank 0 logged step K (mid step K+1).")
    L.append("")
    normal = ("median of steps 2..K of the same job" if _old_step(doc) else "median of every step of the same job "
              "but step 1 and the redone one; the relaunch: steps 2..K and the relaunched job's after its first")
    L.append("**Definitions.** *raw* = wall time from the SIGKILL to the completion of the first step after the last "
             "step completed before the kill (\"SIGKILL to next completed step\", end to end; includes redoing the "
             f"interrupted step). *minus step* = raw minus one normal step ({normal}): what "
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
        L += render_nodes(an.get("per_node"))
        hs, bl = an["hotswap"], an["baseline"]
        rd = an.get("ready") or ready_to_redo(
            [r for r in entry["runs"]["hotswap"] if not r.get("failed")],
            [r for r in entry["runs"]["baseline"] if not r.get("failed")])
        rows = [
            ["end to end, raw (kill -> next completed step)",
             fmt_s(hs["raw_s"]["median"]), fmt_s(bl["raw_s"]["median"]),
             _f(an["speedup_raw"], 1) + "x" if an["speedup_raw"] else None],
            ["end to end minus one normal step",
             fmt_s(hs["minus_step_s"]["median"]), fmt_s(bl["minus_step_s"]["median"]),
             _f(an["speedup_minus_step"], 1) + "x" if an["speedup_minus_step"] else None],
            ["kill -> every rank ready to redo the step (measured, no step subtracted)",
             fmt_s(rd.get("hotswap_s")), fmt_s(rd.get("baseline_s")),
             _f(rd.get("speedup"), 1) + "x" if rd.get("speedup") else None],
            ["raw, each repeat", ", ".join(f"{x:.2f}" for x in _vals(entry, "hotswap", "raw_s")),
             ", ".join(f"{x:.2f}" for x in _vals(entry, "baseline", "raw_s")), None],
            ["normal step time (steps 2..K)" if _old_step(doc) else "normal step time (every step but 1 and the redone "
             "one)", fmt_s(hs["normal_step_s"]),
             fmt_s(bl["normal_step_s"]), None],
            ["first step after recovery (its own step time)", fmt_s(hs["first_step_time_after_s"]),
             fmt_s(bl["first_step_time_after_s"]), None],
            ["later steps after recovery (median)",
             fmt_s(hs["step_time_after_s"]), fmt_s(bl["step_time_after_s"]), None],
            ["last step before kill / state resumed from", f"{hs['last_step_before_kill']} / {hs['restored_version']}",
             f"{bl['last_step_before_kill']} / {bl['loaded_step']}", None],
            ["machine busy during recovery",
             _pct(hs["busy_fraction_recovery"]), _pct(bl["busy_fraction_recovery"]), None],
        ]
        L.append(md_table(["", "hot-swap", "baseline (relaunch + load)", "speedup"], rows))
        L.append("")
        others = [(name, an[key]) for key, name in (("unready", "in place, spare built for another node"),
                                                    ("rebuild", "rebuild")) if an.get(key)]
        if others:
            L.append("Hot-swap on the default path (`hot_swap.in_place: true`: survivors keep their engines; the "
                     "spare built its engine ahead for the killed node's ranks, `hot_swap.spare_build_ahead`)"
                     + (", the same path killing a node the spare did not build for (it starts again from the "
                        "script's first line)" if an.get("unready") else "")
                     + (", `hot_swap.in_place: false` (every rank rebuilds its engine)" if an.get("rebuild") else "")
                     + " and relaunch + load, same job settings, phases from each job's timeline (medians; agree "
                     "= assign + spare + communicators):")
            L.append("")
            prow = []
            for key in ("detect_s", "assign_s", "spare_s", "communicators_s", "agree_s", "rebuild_s", "restore_s",
                        "recompute_s"):
                prow.append([f"phase {key[:-2]}", fmt_s(hs["phases_median"].get(key))]
                            + [fmt_s(o["hotswap"]["phases_median"].get(key)) for _, o in others] + [None])
            prow += [["kill -> every rank restored", fmt_s(rd.get("hotswap_s"))]
                     + [fmt_s((o.get("ready") or {}).get("hotswap_s")) for _, o in others]
                     + [fmt_s(rd.get("baseline_s"))],
                     ["kill -> next completed step", fmt_s(hs["raw_s"]["median"])]
                     + [fmt_s(o["hotswap"]["raw_s"]["median"]) for _, o in others] + [fmt_s(bl["raw_s"]["median"])],
                     ["speedup against relaunch + load (restored / next step)",
                      f"{_f(rd.get('speedup'), 1)}x / {_f(an['speedup_raw'], 1)}x"]
                     + [f"{_f((o.get('ready') or {}).get('speedup'), 1)}x / {_f(o['speedup_raw'], 1)}x"
                        for _, o in others] + [None],
                     ["losses bit-identical", str(an.get("losses_identical"))]
                     + [str(o.get("losses_identical")) for _, o in others] + [None]]
            L.append(md_table(["", "in place (default)", *(n for n, _ in others), "relaunch + load"], prow))
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
        ph = an["hotswap"]["phases_median"]
        un = (an.get("unready") or {}).get("hotswap", {}).get("phases_median") or {}
        out.append(
            "Where the hot-swap time goes (medians, seconds after the kill): the launcher sees the exit at "
            f"{_f(ev('launcher_detected'))} and publishes the new assignment at {_f(ev('assignment_published'))}; "
            f"the survivors leave generation 0 at {_f(ev('survivor_noticed_first'))}-{_f(ev('survivor_noticed_last'))} "
            "(their step stopped by the launcher's notice, or a collective with the dead peer failing, whichever comes "
            "first) and keep their engines (in place: only the communicators beneath their process groups are "
            f"replaced). The spare had run the script up to `deepspeed.initialize` before the kill (its engine built "
            f"for rank 1), so after its assignment it is ready to join in {_f(ph.get('spare_s'))} s; the new "
            f"communicators take {_f(ph.get('communicators_s'))} s; state is restored at "
            f"{_f(ev('survivor_restored_last'))} on the survivors and {_f(ev('spare_restored'))} on the spare "
            f"(restore phase {_f(ph.get('restore_s'))} s: scan + checksums of every held buffer, fetch of rank 1's "
            f"replica, restore); the redone step completes at {_f(an['hotswap']['raw_s']['median'])}."
            + (f" Killing a node the spare did not build for, the spare starts its script again after the assignment:"
               f" {_f(un.get('spare_s'))} s before it can join (its prologue and `deepspeed.initialize`), the rest "
               "alike." if un else ""))
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
