#!/usr/bin/env python
"""The README's benchmark headlines, rendered from the current results (never typed), and their staleness check.

Every figure here is counted whole (issue "honest numbers"): overheads are window ratios whose windows end when the
last checkpoint in them is complete (``overhead_analyse.py``); recovery is measured on the default path (in-place
hot-swap) beside the rebuild path and relaunch + load (``bench_recovery.py``); the simulation is calibrated from
those two. ``run_all.py`` puts the same block into REPORT.md.

    python benchmarks/headlines.py                  # print the block
    python benchmarks/headlines.py --write-readme   # rewrite it in README.md between the markers
    python benchmarks/headlines.py --check          # exit 1 naming what to re-run or re-render

``tests/unit/test_headlines.py`` runs the check in the suite: the README block must be what this renders, and no
headline result may have been measured under a default of the "deadpool" section that has changed since.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, RESULTS_DIR, deadpool_defaults  # noqa: E402

README = os.path.join(REPO, "README.md")
BEGIN = "<!-- headlines:begin (rendered by `python benchmarks/headlines.py --write-readme`; do not edit) -->"
END = "<!-- headlines:end -->"
OVERHEAD = ("snapshot_overhead_small_n2", "snapshot_overhead_small_n4", "snapshot_overhead_medium_n2",
            "snapshot_overhead_medium_n4")
"""The overhead results the headlines read, in this order, where present (measured under the window rule)."""
RECOVERY = "recovery"
SIMULATE = "simulate"
PEERS = ("dlrover_flash", "dcp_async", "ds_decoupled", "ds_default")


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
    for stem in (RECOVERY, SIMULATE):
        doc = _load(stem, results_dir)
        if doc:
            out[stem] = doc
    return out


def _overhead_lines(stem: str, doc: dict[str, Any]) -> list[str]:
    lines = []
    for size, e in (doc.get("sizes") or {}).items():
        an = e.get("analysis") or {}
        if an.get("rule") != "window" or not e.get("rule_met"):
            continue
        res, modes = e["result"], an["modes"]
        dp = modes.get("deadpool") or {}
        sch = res["schedule"]
        peers = "; ".join(f"{m} {modes[m]['window_ratio']:.3f}{_ci(modes[m].get('window_ratio_ci90'))}"
                          for m in PEERS if m in modes and modes[m].get("window_ratio") is not None)
        cpu = an.get("cpu") or {}
        prof = cpu.get("profile_cpu_s_per_step_per_rank") or {}
        where = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.0f} ms" for k, v in prof.items() if v is not None)
        dec = (res["ranks"][0].get("decoupled") or {}).get("writer_type")
        lines.append(
            f"- **Overhead, GPT {size} ({res['params'] / 1e6:.0f}M), {res['world_size']} ranks, ZeRO-"
            f"{res['zero_stage']}, replica on** (`{stem}.md`, {sch['rounds']} rounds of {sch['steps_per_block']}-step "
            f"windows, every checkpoint complete inside its window): deadpool **{dp.get('window_ratio', 0):.3f}**"
            f"{_ci(dp.get('window_ratio_ci90'))}, process CPU x{dp.get('cpu_ratio') or 0:.3f}; "
            + (f"in the same job {peers}{f' (decoupled writer: {dec})' if dec and 'ds_decoupled' in modes else ''}. "
               "deadpool also keeps a replica on the other node and checksums every tensor; the peers keep neither. "
               if peers else "no peer in this job (the other runs have them). ")
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
            f"(`{RECOVERY}.md`, {an['hotswap']['n']} run(s)): kill to every rank restored "
            f"{_s(rd.get('hotswap_s'))}, to the next "
            f"completed step {_s(an['hotswap']['raw_s']['median'])} (one normal step "
            f"{_s(an['hotswap']['normal_step_s'])}); relaunch + load {_s(rd.get('baseline_s'))} and "
            f"{_s(an['baseline']['raw_s']['median'])}: "
            f"{rd.get('speedup') or 0:.1f}x to restored{un_text}{rb_text}. Phases: "
            + ", ".join(f"{k[:-2]} {_s(ph.get(k))}" for k in ("detect_s", "assign_s", "spare_s", "communicators_s",
                                                              "rebuild_s", "restore_s"))
            + f". Losses bit-identical to the relaunched run: {an.get('losses_identical')}.")
    return lines


def _simulate_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for scen, s in (doc.get("scenarios") or {}).items():
        sizes = s.get("sizes") or {}
        if not sizes:
            continue
        gpus = max(sizes, key=int)
        rep = sizes[gpus]
        r = rep["recommended"]
        lines.append(f"- **Simulated** (`{SIMULATE}.md`, {scen}, {int(gpus):,} GPUs): recommended {r['policy']}, "
                     f"goodput {r['goodput_mean']:.4f}.")
    cal = doc.get("calibration") or {}
    if cal.get("sources"):
        lines.append("  Calibrated from: " + "; ".join(f"`{k}` = {v:.4f} from {cal['sources'][k]}"
                                                      for k, v in cal.get("overrides", {}).items()) + ".")
    return lines


def render(results_dir: str = RESULTS_DIR) -> str:
    src = sources(results_dir)
    lines = ["Rendered from the current results by `python benchmarks/headlines.py` (the same block is in "
             "`benchmarks/results/REPORT.md`); a 2-core CPU host shared with other work, so absolute times are "
             "noisy and every ratio comes from runs interleaved in one job."]
    for stem in OVERHEAD:
        if stem in src:
            lines += _overhead_lines(stem, src[stem])
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


def readme_block(path: str = README) -> str | None:
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_readme(path: str = README, results_dir: str = RESULTS_DIR) -> None:
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: the markers {BEGIN!r} and {END!r} are missing; put them where the block goes")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{render(results_dir)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-readme", action="store_true", help="rewrite the block in README.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the README block or a headline result is stale")
    args = p.parse_args(argv)
    if args.write_readme:
        write_readme()
        print(f"[headlines] rewrote the block in {os.path.relpath(README)}")
        return 0
    if args.check:
        problems = stale()
        if readme_block() != render():
            problems.append("README.md: the benchmark block differs from what the results render; run "
                            "`python benchmarks/headlines.py --write-readme`")
        for line in problems:
            print(f"[headlines] {line}")
        return 1 if problems else 0
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
