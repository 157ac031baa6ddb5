#!/usr/bin/env python
"""The README's benchmark headlines, rendered from the current results (never typed), and their staleness check.

Every figure here is counted whole (issue "honest numbers"): overheads are window ratios whose windows end when the
last checkpoint in them is complete (``overhead_analyse.py``); recovery is measured on the default path (in-place
hot-swap) beside the rebuild path and relaunch + load (``bench_recovery.py``); the simulation is calibrated from
those two. ``run_all.py`` puts the same block into REPORT.md.

    python benchmarks/headlines.py                  # print the block
    python benchmarks/headlines.py --write          # rewrite it in README.md, REPORT.md and every doc's quotes
    python benchmarks/headlines.py --check          # exit 1 naming what to re-run or re-render

Each figure names its commit and date and is marked **stale** when the code it measured (``deadpool_ext``'s tree
digest, recorded as ``machine.source_digest``) is not the checkout's; ``python -m benchmarks.refresh`` re-measures
them all. Other docs quote headlines only through ``<!-- headline:NAME ... -->`` markers (:data:`QUOTES`).

``tests/unit/test_headlines.py`` runs the check in the suite: the README block, REPORT.md's section and every
quote must be what this renders (so a figure that went stale shows as stale), and no headline result may have
been measured under a default of the "deadpool" section that has changed since.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, RESULTS_DIR, SIM, deadpool_defaults, tree_digest  # noqa: E402
from paired import sentence  # noqa: E402

README = os.path.join(REPO, "README.md")
BEGIN = "<!-- headlines:begin (rendered by `python benchmarks/headlines.py --write`; do not edit) -->"
END = "<!-- headlines:end -->"
OVERHEAD = ("snapshot_overhead_small_n2", "snapshot_overhead_small_n4", "snapshot_overhead_medium_n2",
            "snapshot_overhead_medium_n4")
"""The overhead results the headlines read, in this order, where present (measured under the window rule)."""
RECOMMENDED = "snapshot_overhead_recommended"
"""The overhead users meet (issue 45): deadpool-run with a spare against plain DeepSpeed, whole process tree."""
RECOVERY = "recovery"
RECOVERY_NODES = "recovery_nodes"
MEGATRON_NODES = "megatron_nodes"
"""bench_recovery --per-node: every active node killed in turn; its headline is the worst node (issue 44)."""
SIMULATE = "simulate"
PEERS = ("dlrover_flash", "dcp_async", "ds_decoupled", "ds_default")
MEASURED_CODE = "deadpool_ext"
"""The code a headline measures: its tree digest (``common.tree_digest``, less the simulator, recorded by
``machine_info`` as ``machine.source_digest``) against the checkout's says whether the figure is from the current
code. The simulation's headline also needs :data:`SIM_CODE`'s."""
SIM_CODE = f"deadpool_ext/{SIM}"


def _load(stem: str, results_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(results_dir, f"{stem}.json")) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _ci(ci: Any) -> str:
    return f" (90% CI {ci[0]:.3f}-{ci[1]:.3f})" if isinstance(ci, list) and len(ci) == 2 else ""


def _s(v: Any) -> str:
    return f"{v:.2f} s" if isinstance(v, (int, float)) else "n/a"


def sources(results_dir: str = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """stem -> document of every result a headline is rendered from (only those measured under today's rules:
    overhead windows counted whole, recovery with the rebuild path beside the default)."""
    out = {}
    for stem in OVERHEAD:
        doc = _load(stem, results_dir)
        if doc and any((e.get("analysis") or {}).get("rule") == "window" and e.get("rule_met")
                       for e in (doc.get("sizes") or {}).values()):
            out[stem] = doc
    for stem in (RECOVERY_NODES, MEGATRON_NODES, RECOVERY, SIMULATE):
        doc = _load(stem, results_dir)
        if doc:
            out[stem] = doc
    doc = _load(RECOMMENDED, results_dir)
    if doc and doc.get("rule_met") and (doc.get("analysis") or {}).get("modes", {}).get("recommended"):
        out[RECOMMENDED] = doc
    return out


def _recommended_lines(doc: dict[str, Any]) -> list[str]:
    an = doc["analysis"]
    rec, off, base = an["modes"]["recommended"], an["modes"].get("off"), an["modes"]["plain"]
    roles = {r: rec["cpu_s_per_step_by_role"].get(r, 0.0) - base["cpu_s_per_step_by_role"].get(r, 0.0)
             for r in ("ranks", "launcher", "spare", "other")}
    ncpu = (doc.get("machine") or {}).get("cpu_count")
    used = base["cpu_s_per_step"] / (ncpu * base["window_s_per_step"]) if ncpu and base["window_s_per_step"] else None
    t = an.get("target_step_ratio") or {}
    target = f" (target <= {t['target']}: {'met' if t.get('met') else 'not met'})" if t else ""
    step = sentence(rec["window"], x_label="deadpool-run", y_label="plain")
    cpu = sentence(rec["cpu"], x_label="deadpool-run", y_label="plain")
    return [
        f"- **Overhead as recommended, GPT {doc['size']} ({doc['params'] / 1e6:.0f}M), 2 ranks, ZeRO-3: `deadpool-run` "
        f"with one spare built ahead, a snapshot every step, replica on the other node, against plain DeepSpeed "
        f"(no extension)** (`{RECOMMENDED}.md`, {doc['rounds']} rounds of one job per mode, {doc['steps']}-step "
        f"windows; {stamp(doc, stem=RECOMMENDED)}): step time {step}{target}; CPU of the whole process tree "
        f"(kernel-counted: launcher, ranks, spare) {cpu}; the extra CPU per step: "
        + ", ".join(f"{r} {1e3 * v:+.0f} ms" for r, v in roles.items())
        + (f" (`plain` kept {used:.0%} of the host's {ncpu} cores busy: added work partly replaces waiting, so this "
           "CPU ratio is a lower bound)" if used and used > 0.85 else "")
        + (f". Attached but off (the hooks alone): {sentence(off['window'], x_label='off', y_label='plain')}."
           if off else ".")]


def _overhead_lines(stem: str, doc: dict[str, Any]) -> list[str]:
    lines = []
    for size, e in (doc.get("sizes") or {}).items():
        an = e.get("analysis") or {}
        if an.get("rule") != "window" or not e.get("rule_met"):
            continue
        res, modes = e["result"], an["modes"]
        dp = modes.get("deadpool") or {}
        sch = res["schedule"]
        paired = an.get("paired") or {}
        peers = "; ".join(sentence(paired[m]["window"]) for m in PEERS if m in paired)
        cpu = an.get("cpu") or {}
        prof = cpu.get("profile_cpu_s_per_step_per_rank") or {}
        where = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.0f} ms" for k, v in prof.items() if v is not None)
        dec = (res["ranks"][0].get("decoupled") or {}).get("writer_type")
        lines.append(
            f"- **Overhead, GPT {size} ({res['params'] / 1e6:.0f}M), {res['world_size']} ranks, ZeRO-"
            f"{res['zero_stage']}, replica on** (`{stem}.md`, {sch['rounds']} rounds of {sch['steps_per_block']}-step "
            f"windows, every checkpoint complete inside its window; {stamp(doc, stem=stem)}): deadpool / `none` "
            f"**{dp.get('window_ratio', 0):.3f}**{_ci(dp.get('window_ratio_ci90'))}, process CPU "
            f"x{dp.get('cpu_ratio') or 0:.3f}. "
            + (f"Against the peers in the same job (better: the paired interval below 1.0; worse: above): {peers}"
               f"{f' (decoupled writer: {dec})' if dec and 'ds_decoupled' in paired else ''}. deadpool also keeps a "
               "replica on the other node and checksums every tensor; the peers keep neither. "
               if peers else "No peer in this job (the other runs have them). ")
            + f"Extra CPU {1e3 * (cpu.get('extra_cpu_s_per_step_per_rank') or 0):.0f} ms per step per rank against a "
            f"floor of {1e3 * (cpu.get('floor_cpu_s') or 0):.0f} ms (one copy, one checksum pass, one replica "
            f"exchange measured in the same job); where it goes: {where or 'n/a'}.")
    return lines


def _recovery_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for size, e in (doc.get("sizes") or {}).items():
        an = e.get("analysis") or {}
        if not an.get("hotswap", {}).get("n"):
            continue
        rd, rb, un = an.get("ready") or {}, an.get("rebuild") or {}, an.get("unready") or {}
        ph = an["hotswap"]["phases_median"]
        un_text = (f"; a node no spare built for (the spare starts its script again) "
                   f"{_s((un.get('ready') or {}).get('hotswap_s'))} and {_s(un['hotswap']['raw_s']['median'])}"
                   if un.get("hotswap", {}).get("n") else "")
        rb_text = (f"; the rebuild path (`hot_swap.in_place: false`) {_s((rb.get('ready') or {}).get('hotswap_s'))} "
                   f"and {_s(rb['hotswap']['raw_s']['median'])}" if rb.get("hotswap", {}).get("n") else "")
        lines.append(
            f"- **Recovery, GPT {size}, default path (in-place hot-swap, the spare built ahead for the killed node), "
            f"SIGKILL of one of 3 ranks** "
            f"(`{RECOVERY}.md`, {an['hotswap']['n']} run(s); {stamp(doc, stem=RECOVERY)}): kill to every rank restored "
            f"{_s(rd.get('hotswap_s'))}, to the next "
            f"completed step {_s(an['hotswap']['raw_s']['median'])} (one normal step "
            f"{_s(an['hotswap']['normal_step_s'])}); relaunch + load {_s(rd.get('baseline_s'))} and "
            f"{_s(an['baseline']['raw_s']['median'])}: "
            f"{rd.get('speedup') or 0:.1f}x to restored{un_text}{rb_text}. Phases: "
            + ", ".join(f"{k[:-2]} {_s(ph.get(k))}" for k in ("detect_s", "assign_s", "spare_s", "communicators_s",
                                                              "rebuild_s", "restore_s"))
            + f". Losses bit-identical to the relaunched run: {an.get('losses_identical')}.")
    return lines


def _recovery_nodes_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for size, e in (doc.get("sizes") or {}).items():
        pn = (e.get("analysis") or {}).get("per_node") or {}
        if "worst" not in pn:
            continue
        nodes = pn["nodes"]
        per = ", ".join(f"{n} {_s(r['restored_s']['median'])} ({_s(r['restored_s']['min'])}-"
                        f"{_s(r['restored_s']['max'])}, {'/'.join(sorted(set(r['takeover'])))})"
                        for n, r in nodes.items())
        ok = all(r["losses_identical"] for r in nodes.values())
        lines.append(
            f"- **Recovery, GPT {size}, every node killed in turn** (default path, 3 nodes + 1 spare that built its "
            f"engine for node1; `{RECOVERY_NODES}.md`, {min(r['runs'] for r in nodes.values())} run(s) per node; "
            f"{stamp(doc, stem=RECOVERY_NODES)}): kill to every rank restored, **worst node {pn['worst']} "
            f"{_s(pn['worst_s'])}, {pn.get('speedup_worst') or 0:.1f}x** relaunch + load's "
            f"{_s(pn['baseline_restored_s'])} in the same run; expected under a uniformly drawn failure "
            f"{_s(pn['expected_s'])} ({pn.get('speedup_expected') or 0:.1f}x); best node {pn['best']} "
            f"{_s(pn['best_s'])} ({pn.get('speedup_best') or 0:.1f}x)."
            + (f" Against the relaunch's floor, one rank's start-up alone loading nothing "
               f"({_s(pn['floor_s']['median'])}), the worst node is {pn['speedup_worst_floor']:.1f}x."
               if pn.get("speedup_worst_floor") else "")
            + f" Per node, median (min-max, how the spare took over): {per}. Losses bit-identical on every run: {ok}.")
    return lines


def _megatron_nodes_lines(doc: dict[str, Any]) -> list[str]:
    an = doc.get("analysis") or {}
    worst = an.get("worst")
    if worst not in ("node0", "node1"):
        return []
    best = "node1" if worst == "node0" else "node0"
    rl, rb, fb = an["relaunch"]["restored"], an["rebuild"]["restored"], an.get("fallback_vs_rebuild") or {}

    def node(k: str) -> str:
        r = an[k]["restored"]
        return (f"{_s(r['median'])} ({_s(r['min'])}-{_s(r['max'])}, {'/'.join(an[k]['how']) or '?'}, "
                f"{an[k].get('speedup_restored') or 0:.1f}x)")

    ok = all(an[k]["losses_identical"] for k in ("node1", "node0", "rebuild", "relaunch"))
    return [f"- **Recovery, Megatron-Core (GPT {doc.get('size')}, TP2 x DP2), every node killed in turn** (2 nodes of "
            f"2 ranks + 1 spare that built its model for node1; `{MEGATRON_NODES}.md`, {doc.get('repeats')} run(s) "
            f"per node; {stamp(doc, stem=MEGATRON_NODES)}): kill to every rank restored, **worst node {worst} "
            f"{node(worst)}** relaunch + `--load`'s {_s(rl['median'])} in the same run; expected under a uniformly "
            f"drawn failure {_s(an.get('expected_s'))}; best node {best} {node(best)}. node0, which the spare did not "
            f"build for, {'not slower than' if fb.get('met') else 'slower than'} the rebuild path's "
            f"{_s(rb['median'])} (`hot_swap.in_place: false`). Losses bit-identical on every run: {ok}."]


def _simulate_lines(doc: dict[str, Any]) -> list[str]:
    lines = [f"- **Simulated** (`{SIMULATE}.md`; {stamp(doc)}; not measured, see `docs/simulator.md`):"]
    for scen, s in (doc.get("scenarios") or {}).items():
        sizes = s.get("sizes") or {}
        if not sizes:
            continue
        gpus = max(sizes, key=int)
        rep = sizes[gpus]
        r = rep["recommended"]
        lines.append(f"  {scen}, {int(gpus):,} GPUs: recommended {r['policy']}, goodput {r['goodput_mean']:.4f}.")
    rep = next((sc["sizes"][max(sc["sizes"], key=int)] for sc in (doc.get("scenarios") or {}).values()
                if sc.get("sizes")), None)
    if rep:
        k, d = rep["params"]["costs"], rep["derived"]
        swap = d.get("hotswap_s")
        if swap is None and d.get("nodes"):  # a result written before the simulator recorded its charge
            f = min(d["spares"], d["nodes"]) / d["nodes"]
            swap = f * d["hotswap_fixed_s"] + (1 - f) * d["hotswap_unready_s"]
        lines.append(f"  Its fixed costs are floors measured on a 24M-parameter GPT on 2 CPU cores (a large job's are "
                     f"larger){f'; a hot-swap is charged {swap:.2f} s' if swap is not None else ''}. Typed in, not "
                     f"measured: `costs.scheduler_s` = {k['scheduler_s']:g} s of the {d['restart_s']:.0f} s a "
                     "relaunch is charged, on which most of the hot-swap's gain rests, and `costs.detect_s` = "
                     f"{k['detect_s']:g} s.")
    cal = doc.get("calibration") or {}
    if cal.get("sources"):
        lines.append("  Calibrated from: " + "; ".join(f"`{k}` = {v:.4f} from {cal['sources'][k]}"
                                                      for k, v in cal.get("overrides", {}).items()) + ".")
    return lines


def checkout_digest() -> str:
    """The digest of the code the headlines measure, in this checkout (uncommitted changes included)."""
    return tree_digest(os.path.join(REPO, MEASURED_CODE), exclude=(SIM,))


def sim_changed(stem: str | None, doc: dict[str, Any]) -> bool:
    """The simulation's result, run by other simulator code than the checkout's."""
    if stem != SIMULATE:
        return False
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    return (m.get("source_digest") or {}).get(SIM_CODE) != tree_digest(os.path.join(REPO, SIM_CODE))


def defaults_changed(stem: str, doc: dict[str, Any]) -> list[str]:
    """The keys of the "deadpool" section whose default differs from when ``doc`` was measured (``["all"]`` when it
    recorded none); the overhead results' jobs start no spare, so :data:`SPARE_ONLY` keys do not count for them."""
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    then = m.get("deadpool_defaults")
    if then is None:
        return ["all (none recorded)"]
    diff = [d.split(" ", 1)[0] for d in _diff_keys(then, deadpool_defaults())]
    return [d for d in diff if not (stem in OVERHEAD and d in SPARE_ONLY)]


def is_stale(doc: dict[str, Any], digest: str | None = None, stem: str | None = None) -> bool:
    """True when the result recorded no digest of the code it measured, or another one than the checkout's, or
    (given its ``stem``) was measured under other defaults of the "deadpool" section."""
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    then = (m.get("source_digest") or {}).get(MEASURED_CODE)
    if then is None or then != (digest or checkout_digest()) or sim_changed(stem, doc):
        return True
    return bool(stem and stem != SIMULATE and defaults_changed(stem, doc))


def stamp(doc: dict[str, Any], digest: str | None = None, stem: str | None = None) -> str:
    """Where a figure comes from, for the reader: its commit and date, and **stale** when the code it measured is
    not the checkout's (the recorded ``source_digest`` differs) or, given its ``stem``, the section's defaults
    changed since. Never the checkout's own digest: the block would change at every commit, not only when a figure
    goes stale."""
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    git = m.get("git") or {}
    commit = str(git.get("commit") or "?")[:10] + (" + uncommitted changes" if git.get("dirty") else "")
    when = str(m.get("time_utc") or "?")[:10]
    then = (m.get("source_digest") or {}).get(MEASURED_CODE)
    why = []
    if then is None:
        why.append("no digest of the code it measured was recorded")
    elif then != (digest or checkout_digest()):
        why.append(f"`{MEASURED_CODE}` has changed since (digest `{then}` then)")
    if sim_changed(stem, doc):
        why.append(f"`{SIM_CODE}` has changed since")
    # which keys is for `--check` to say (`stale()`): the block would otherwise change with every new default
    if stem and stem != SIMULATE and defaults_changed(stem, doc):
        why.append("measured under other defaults of the `deadpool` section")
    text = f"commit {commit}, {when}"
    return f"{text}, **stale**: {'; '.join(why)}" if why else f"{text}, from the current code"


def render(results_dir: str = RESULTS_DIR) -> str:
    src = sources(results_dir)
    lines = ["Rendered from the current results by `python benchmarks/headlines.py` (the same block is in "
             "`benchmarks/results/REPORT.md`); a 2-core CPU host shared with other work, so absolute times are "
             "noisy and every ratio comes from runs interleaved in one job. Each figure names its commit and date, "
             "and says **stale** when the code it measured differs from this checkout's (`python -m "
             "benchmarks.refresh` re-measures every headline)."]
    if RECOMMENDED in src:
        lines += _recommended_lines(src[RECOMMENDED])
    for stem in OVERHEAD:
        if stem in src:
            lines += _overhead_lines(stem, src[stem])
    if RECOVERY_NODES in src:
        lines += _recovery_nodes_lines(src[RECOVERY_NODES])
    if MEGATRON_NODES in src:
        lines += _megatron_nodes_lines(src[MEGATRON_NODES])
    if RECOVERY in src:
        lines += _recovery_lines(src[RECOVERY])
    if SIMULATE in src:
        lines += _simulate_lines(src[SIMULATE])
    missing = [s for s in OVERHEAD if s not in src]
    if missing:
        lines.append("- Not measured yet under the window rule: " + ", ".join(f"`{m}`" for m in missing) + ".")
    from results_index import CURRENT

    others = [e for e in CURRENT if e.stem not in src and e.stem not in OVERHEAD and e.benchmark != "report"]
    if others:
        lines += ["", "Other current results (what each measures, when and how: `benchmarks/results/INDEX.md`; not "
                  "headlines: not re-measured under this round's rules): "
                  + "; ".join(f"`{e.stem}` ({e.title})" for e in others) + "."]
    return "\n".join(lines)


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} then, {b!r} now)"]


SPARE_ONLY = ("hot_swap.spare_build_ahead",)
"""Keys that act only in a deadpool-run spare's process: the overhead results' jobs start no spare, so a change of
these defaults leaves them current (the recovery results' jobs do start one)."""


def stale(results_dir: str = RESULTS_DIR) -> list[str]:
    """One line per headline result measured under defaults of the "deadpool" section that differ from today's
    (but keys of a path its jobs never take: :data:`SPARE_ONLY` for the overhead results), or that did not record
    them; and a simulation calibrated from other figures than the current results."""
    now = deadpool_defaults()
    out = []
    for stem, doc in sources(results_dir).items():
        then = (doc.get("machine") or {}).get("deadpool_defaults")
        if stem == SIMULATE:
            out += _simulate_stale(doc, results_dir)
            continue
        if then is None:
            out.append(f"{stem}: records no deadpool defaults; re-run `{doc.get('command', '?')}`")
            continue
        diff = _diff_keys(then, now)
        if stem in OVERHEAD:
            diff = [d for d in diff if d.split(" ", 1)[0] not in SPARE_ONLY]
        if diff:
            out.append(f"{stem}: measured under other defaults ({'; '.join(diff)}); re-run "
                       f"`{doc.get('command', '?')}`")
    return out


def _simulate_stale(doc: dict[str, Any], results_dir: str) -> list[str]:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from deadpool_ext.sim.calibration import calibrate

    used = (doc.get("calibration") or {}).get("overrides") or {}
    cur = calibrate(results_dir).overrides
    diff = [k for k in set(used) | set(cur) if abs(used.get(k, float("nan")) - cur.get(k, float("nan"))) > 1e-9
            or (k in used) != (k in cur)]
    return [f"simulate: calibrated with other costs than the current results give ({', '.join(sorted(diff))}); "
            "re-run `python benchmarks/bench_simulate.py`"] if diff else []


REPORT = os.path.join(RESULTS_DIR, "REPORT.md")
REPORT_HEAD = "## Headlines\n\n"
QUOTE_END = "<!-- /headline -->"
_QUOTE = re.compile(r"<!-- headline:(?P<name>[a-z_]+) [^>]*-->(?P<text>.*?)" + re.escape(QUOTE_END), re.S)


def quote_begin(name: str) -> str:
    return f"<!-- headline:{name} (rendered by `python benchmarks/headlines.py --write`; do not edit) -->"


def _recovery_quote(src: dict[str, dict[str, Any]]) -> str:
    """docs/hot-swap.md's sentence on recovery: small's default path against relaunch, the other paths, medium."""
    doc = src.get(RECOVERY)
    sizes = (doc or {}).get("sizes") or {}
    sm, md = (sizes.get("small") or {}).get("analysis") or {}, (sizes.get("medium") or {}).get("analysis") or {}
    if not doc or not (sm.get("hotswap") or {}).get("n"):
        return "`benchmarks/results/recovery.md`: not measured yet"
    rd, hs = sm["ready"], sm["hotswap"]
    un, rb = (sm.get("unready") or {}).get("ready") or {}, (sm.get("rebuild") or {}).get("ready") or {}
    text = (f"`benchmarks/results/recovery.md` ({stamp(doc, stem=RECOVERY)}) measures kill -> every rank restored at "
            f"{_s(rd.get('hotswap_s'))} on the default path with the spare built for the killed node "
            f"({rd.get('speedup') or 0:.1f}x faster than relaunch + load's {_s(rd.get('baseline_s'))}; kill -> next "
            f"step {_s(hs['raw_s']['median'])}, one normal step + {_s(hs['minus_step_s']['median'])}; the first step "
            f"after the swap {_s(hs.get('first_step_time_after_s'))} against a normal step's "
            f"{_s(hs.get('normal_step_s'))}), {_s(un.get('hotswap_s'))} when the spare had built for another node"
            f"{' (before it could relabel its engine)' if RECOVERY_NODES in src else ''}, "
            f"{_s(rb.get('hotswap_s'))} on the rebuild path")
    if (md.get("hotswap") or {}).get("n"):
        text += (f"; GPT medium {_s(md['ready'].get('hotswap_s'))} (restore "
                 f"{_s(md['hotswap']['phases_median'].get('restore_s'))} of it), "
                 f"{md['ready'].get('speedup') or 0:.1f}x")
    nodes = src.get(RECOVERY_NODES)
    pn = ((((nodes or {}).get("sizes") or {}).get("small") or {}).get("analysis") or {}).get("per_node") or {}
    if "worst" in pn:
        text += (f". Every node killed in turn (`benchmarks/results/{RECOVERY_NODES}.md`, "
                 f"{stamp(nodes or {}, stem=RECOVERY_NODES)}): worst node {pn['worst']} {_s(pn['worst_s'])} "
                 f"({pn.get('speedup_worst') or 0:.1f}x relaunch + load's {_s(pn['baseline_restored_s'])} in that "
                 f"run), expected {_s(pn['expected_s'])}, best node {pn['best']} {_s(pn['best_s'])}; the spare "
                 "relabels its engine for the nodes it did not build for")
    return text + "."


QUOTES = {"recovery": _recovery_quote}
"""Headline figures quoted inside other docs: ``<!-- headline:NAME ... -->text<!-- /headline -->``, the text
rendered from the results like the README's block (``--write`` rewrites them, the test compares them)."""
QUOTING = ("README.md", "docs", os.path.join("benchmarks", "README.md"))
"""Where quotes are looked for: these files, and every markdown file under these folders."""


def quoting_docs(repo: str = REPO) -> list[str]:
    out = []
    for rel in QUOTING:
        path = os.path.join(repo, rel)
        if os.path.isdir(path):
            out += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".md"))
        elif os.path.exists(path):
            out.append(path)
    return out


def requote(text: str, results_dir: str = RESULTS_DIR) -> str:
    """``text`` with every quote rendered again; an unknown quote name is an error naming the known ones."""
    src = sources(results_dir)

    def one(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in QUOTES:
            raise ValueError(f"unknown headline quote {name!r}; known: {', '.join(sorted(QUOTES))}")
        return f"{quote_begin(name)}{QUOTES[name](src)}{QUOTE_END}"

    return _QUOTE.sub(one, text)


def quotes_in(text: str) -> list[tuple[str, str]]:
    """(name, text) of every quote in a document."""
    return [(m.group("name"), m.group("text")) for m in _QUOTE.finditer(text)]


def readme_block(path: str = README) -> str | None:
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def report_block(path: str = REPORT) -> str | None:
    """REPORT.md's headlines section (written by ``run_all.py``, rewritten by ``--write``)."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    if REPORT_HEAD not in text:
        return None
    return text.split(REPORT_HEAD, 1)[1].split("\n\n## ", 1)[0].strip("\n")


def write_readme(path: str = README, results_dir: str = RESULTS_DIR) -> None:
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: the markers {BEGIN!r} and {END!r} are missing; put them where the block goes")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{render(results_dir)}\n{END}{tail}")


def write_report(path: str = REPORT, results_dir: str = RESULTS_DIR) -> bool:
    """Rewrite REPORT.md's headlines section in place (its figures and sources are ``run_all.py --report-only``'s)."""
    old = report_block(path)
    if old is None:
        return False
    with open(path) as fh:
        text = fh.read()
    head, rest = text.split(REPORT_HEAD, 1)
    with open(path, "w") as fh:
        fh.write(head + REPORT_HEAD + render(results_dir) + rest[len(rest.split("\n\n## ", 1)[0].rstrip("\n")):])
    return True


def write_quotes(results_dir: str = RESULTS_DIR) -> list[str]:
    """Render every doc's quotes again; returns the files rewritten."""
    changed = []
    for path in quoting_docs():
        with open(path) as fh:
            text = fh.read()
        new = requote(text, results_dir)
        if new != text:
            with open(path, "w") as fh:
                fh.write(new)
            changed.append(path)
    return changed


def out_of_date(results_dir: str = RESULTS_DIR) -> list[str]:
    """One line per place a headline is shown that differs from what the results render: the README's block,
    REPORT.md's section, every quote in the docs."""
    out = []
    block = render(results_dir)
    if readme_block() != block:
        out.append("README.md: the benchmark block differs from what the results render")
    if report_block() != block:
        out.append("benchmarks/results/REPORT.md: the Headlines section differs from what the results render")
    for path in quoting_docs():
        with open(path) as fh:
            text = fh.read()
        if requote(text, results_dir) != text:
            out.append(f"{os.path.relpath(path, REPO)}: a headline quote differs from what the results render")
    return [f"{line}; run `python benchmarks/headlines.py --write`" for line in out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true",
                   help="rewrite the block in README.md, REPORT.md's Headlines section and every doc's quotes")
    p.add_argument("--write-readme", action="store_true", help="the same as --write (its older name)")
    p.add_argument("--check", action="store_true", help="exit 1 if a shown headline or a headline result is stale")
    args = p.parse_args(argv)
    if args.write or args.write_readme:
        write_readme()
        written = [README] + ([REPORT] if write_report() else []) + write_quotes()
        print("[headlines] rewrote " + ", ".join(os.path.relpath(f, REPO) for f in dict.fromkeys(written)))
        return 0
    if args.check:
        problems = stale() + out_of_date()
        digest = checkout_digest()
        problems += [f"{stem}: measured on other code than this checkout's; re-measure: `python -m benchmarks.refresh`"
                     for stem, doc in sources().items() if is_stale(doc, digest, stem)]
        for line in problems:
            print(f"[headlines] {line}")
        return 1 if problems else 0
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
