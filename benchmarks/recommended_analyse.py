"""bench_recommended, the analysis and the markdown: per-round jobs -> paired figures. Pure: no torch, no processes.

Each round runs one job per mode, in an order that rotates from round to round; a job's figures are those of its
measured window (after its warm-up steps): the window's wall time per step on rank 0 between two barriers (the
last snapshot committed inside it), and the CPU of the job's whole process tree over the same window, from the
kernel (the cgroup made for the job: every process and thread of it, exited ones included), split by process
(launcher, ranks, spare, others) from /proc. A mode's figure is its window (or CPU) per step over the baseline's
(``plain``: DeepSpeed with no extension) in the same round, the median over rounds with the bootstrap 90% CI of
``paired.py`` and its verdict.
"""
from __future__ import annotations

from typing import Any

from common import fmt_pct, md_table, median
from paired import compare_blocks, sentence

BASE = "plain"
MODES = ("plain", "off", "recommended")
DESCRIBE = {
    "plain": "DeepSpeed with no extension: `torchrun`, a script calling `deepspeed.initialize` (no deadpool import)",
    "off": "attached and switched off: the same script under `torchrun -m deadpool_ext.run`, the section on, "
           "snapshots inactive (the cost of the hooks)",
    "on_torchrun": "the same script under `torchrun -m deadpool_ext.run`, a snapshot every step, replica on "
                   "(2 simulated nodes): today's overhead jobs' launcher",
    "recommended": "`deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1`, the spare built ahead, a snapshot "
                   "every step, replica on the other node: what the README recommends",
}
TARGET_STEP_RATIO = 1.05
ROLES = ("ranks", "launcher", "spare", "other")


def blocks_of(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per job that measured its window: ``paired.round_pairs``'s block (round, mode, steps, window_s, cpu_s)."""
    out = []
    for job in rounds:
        res = job.get("result")
        if not res:
            continue
        out.append({"round": job["round"], "mode": job["mode"], "warmup": False, "steps": res["steps"],
                    "window_s": res["window_s"], "cpu_s": res["cpu_s"]})
    return out


def analyze(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``rounds``: one entry per job {round, mode, result | error}; ``result``: {steps, window_s, cpu_s,
    cpu_by_role_s, step_s}."""
    blocks = blocks_of(rounds)
    modes = [m for m in MODES + ("on_torchrun",) if any(b["mode"] == m for b in blocks)]
    out: dict[str, Any] = {"base": BASE, "modes": {}, "failed_jobs": [
        {"round": j["round"], "mode": j["mode"], "error": str(j.get("error"))[:500]} for j in rounds
        if not j.get("result")]}
    for mode in modes:
        mine = [j["result"] for j in rounds if j["mode"] == mode and j.get("result")]
        m: dict[str, Any] = {
            "jobs": len(mine),
            "window_s_per_step": median([r["window_s"] / r["steps"] for r in mine]),
            "cpu_s_per_step": median([r["cpu_s"] / r["steps"] for r in mine]),
            "cpu_s_per_step_by_role": {role: median([r["cpu_by_role_s"].get(role, 0.0) / r["steps"] for r in mine])
                                       for role in ROLES},
        }
        if mode != BASE:
            m["window"] = compare_blocks(blocks, mode, BASE, base=BASE, key="window_s").to_dict()
            m["cpu"] = compare_blocks(blocks, mode, BASE, base=BASE, key="cpu_s").to_dict()
        out["modes"][mode] = m
    recs = [j["result"] for j in rounds if j["mode"] == "recommended" and j.get("result")]
    floors = [r["cpu_floor_rank0"]["total_cpu_s"] for r in recs if r.get("cpu_floor_rank0")]
    base = out["modes"].get(BASE)
    if floors and base and "recommended" in out["modes"]:
        world = recs[0].get("world_size") or 2
        floor = median(floors)
        floor_ratio = (base["cpu_s_per_step"] + world * floor) / base["cpu_s_per_step"]
        cpu = out["modes"]["recommended"]["cpu"]
        out["cpu_floor"] = {
            "floor_cpu_s_per_rank": floor, "world_size": world,
            "parts_s": {k: median([r["cpu_floor_rank0"][k] for r in recs if r.get("cpu_floor_rank0")])
                        for k in ("copy_cpu_s", "checksum_cpu_s", "exchange_cpu_s")},
            "floor_ratio": floor_ratio, "target": floor_ratio + 0.02,
            "met": bool(cpu["ci90"]) and cpu["ci90"][1] <= floor_ratio + 0.02,
            "phases_rank0_s": {k: median([r["snapshot_phases_rank0"][k] for r in recs
                                          if (r.get("snapshot_phases_rank0") or {}).get(k) is not None])
                               for k in ("copy_cpu_s", "seal_cpu_s", "replicate_cpu_s", "commit_cpu_s",
                                         "blocking_s")}}
    rec = out["modes"].get("recommended", {}).get("window")
    if rec:
        ci = rec["ci90"]
        out["target_step_ratio"] = {"target": TARGET_STEP_RATIO, "value": rec["median"], "ci90": ci,
                                    "met": bool(ci) and ci[1] <= TARGET_STEP_RATIO}
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    an = doc["analysis"]
    m = doc.get("machine") or {}
    git = m.get("git") or {}
    lines = ["# The overhead of the recommended setup: deadpool-run with a spare against plain DeepSpeed", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model')}), load at start {m.get('loadavg')}; git "
             f"{str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}, deadpool_ext digest "
             f"`{(m.get('source_digest') or {}).get('deadpool_ext')}`; {m.get('time_utc')}.", "",
             f"GPT {doc['size']} ({doc['params'] / 1e6:.0f}M parameters), ZeRO-3 fp32, 2 ranks on this host, "
             f"micro-batch {doc['micro_batch']}; {doc['rounds']} rounds, each one job per mode in a rotating order; a "
             f"job's window: {doc['steps']} steps after {doc['warmup_steps']} warm-up steps, between two barriers, "
             "the last snapshot committed inside it.", "",
             "**CPU** is the job's whole process tree, counted by the kernel: a cgroup made for the job "
             f"(`{doc['cpu_source']}`) holds the launcher, every rank, the spare and any helper process, exited ones "
             "included; the split by process comes from /proc over the same window. **Ratios** are paired within a "
             "round (mode / `plain` of the same round), median over rounds, 90% CI by bootstrap over rounds; "
             "*better* / *worse* need the whole CI below / above 1.0, otherwise *no difference measured*.", "",
             "Modes:", ""]
    lines += [f"- `{mode}`: {DESCRIBE[mode]}" for mode in an["modes"]]
    rows = []
    for mode, mm in an["modes"].items():
        w, c = mm.get("window"), mm.get("cpu")
        roles = mm["cpu_s_per_step_by_role"]
        rows.append([mode, mm["jobs"], f"{mm['window_s_per_step']:.3f} s", _pair(w), f"{mm['cpu_s_per_step']:.3f} s",
                     _pair(c), ", ".join(f"{r} {roles[r]:.3f} s" for r in ROLES if roles.get(r))])
    lines += ["", md_table(["mode", "jobs", "window / step", "window / plain (90% CI): verdict", "CPU / step (tree)",
                            "CPU / plain (90% CI): verdict", "CPU / step by process"], rows), ""]
    for mode, mm in an["modes"].items():
        if mode != BASE:
            lines.append(f"- {sentence(mm['window'], x_label=mode, y_label='plain')}; CPU: "
                         f"{sentence(mm['cpu'], x_label=mode, y_label='plain')}.")
    t = an.get("target_step_ratio")
    if t:
        lines.append(f"- target: step ratio <= {t['target']} (the CI's upper end): **{'met' if t['met'] else 'not met'}"
                     f"** ({t['value']:.3f}, 90% CI {_ci(t['ci90'])}).")
    rec, off = an["modes"].get("recommended"), an["modes"].get("off")
    if rec and an["modes"].get(BASE):
        base_roles = an["modes"][BASE]["cpu_s_per_step_by_role"]
        extra = {r: rec["cpu_s_per_step_by_role"].get(r, 0.0) - base_roles.get(r, 0.0) for r in ROLES}
        total = rec["cpu_s_per_step"] - an["modes"][BASE]["cpu_s_per_step"]
        lines.append("- where the recommended setup's extra CPU per step goes (medians, against `plain`): "
                     + ", ".join(f"{r} {v:+.3f} s" for r, v in extra.items()) + f"; in all {total:+.3f} s "
                     f"({fmt_pct(total / an['modes'][BASE]['cpu_s_per_step'], 1)} of plain's).")
    fl = an.get("cpu_floor")
    if fl:
        ph, parts = fl["phases_rank0_s"], fl["parts_s"]
        lines.append(f"- target: tree CPU at most 2 points above `plain` plus the floor (one copy, one checksum pass, "
                     f"one replica exchange per rank per step, measured in the same jobs: x{fl['floor_ratio']:.3f}, "
                     f"so <= x{fl['target']:.3f} on the CI's upper end): **{'met' if fl['met'] else 'not met'}**. "
                     f"Floor per rank: copy {1e3 * (parts['copy_cpu_s'] or 0):.0f} ms, checksum "
                     f"{1e3 * (parts['checksum_cpu_s'] or 0):.0f} ms, exchange "
                     f"{1e3 * (parts['exchange_cpu_s'] or 0):.0f} ms. Rank 0's snapshot worker per snapshot (CPU): "
                     + ", ".join(f"{k.removesuffix('_cpu_s')} {1e3 * v:.1f} ms" for k, v in ph.items()
                                 if v is not None and k != "blocking_s")
                     + f"; the training thread blocked {1e3 * (ph.get('blocking_s') or 0):.1f} ms per snapshot; "
                     "heartbeats and the store are the launcher's share above, the spare's polling the spare's.")
    ncpu = (doc.get("machine") or {}).get("cpu_count")
    base = an["modes"].get(BASE)
    if ncpu and base and base["window_s_per_step"]:
        used = base["cpu_s_per_step"] / (ncpu * base["window_s_per_step"])
        lines.append(f"- `plain`'s process tree used {fmt_pct(used, 0)} of the host's {ncpu} cores over its windows"
                     + (": the cores are nearly saturated, so work a mode adds partly takes the place of time the "
                        "ranks would otherwise spend waiting, and the CPU ratio is a lower bound of the work added "
                        "(on a host with idle cores it would show whole)" if used > 0.85 else "") + ".")
    if off:
        lines.append(f"- the hooks alone (`off`): window {off['window']['median']:.3f}, CPU {off['cpu']['median']:.3f} "
                     "of plain's.")
    if an["failed_jobs"]:
        lines.append("- failed jobs (their rounds have no pair for that mode): " + "; ".join(
            f"round {j['round']} {j['mode']}: {j['error'][:200]}" for j in an["failed_jobs"]))
    lines.append("")
    return "\n".join(lines)


def _ci(ci: Any) -> str:
    return f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "none"


def _pair(c: dict[str, Any] | None) -> str:
    if not c:
        return "(baseline)"
    return f"{c['median']:.3f} ({_ci(c['ci90'])}): {c['verdict']}" if c["median"] is not None else c["verdict"]
