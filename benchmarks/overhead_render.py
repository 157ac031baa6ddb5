"""bench_snapshot_overhead, the markdown: a results document -> one table per job, every figure counted whole."""
from __future__ import annotations

import json
from typing import Any

from common import fmt_bytes, fmt_pct, fmt_ratio, fmt_s, md_table
from overhead_analyse import PHASES, PROTECTS
from paired import sentence


def _ci(ci: Any) -> str | None:
    return "[{:.3f}, {:.3f}]".format(*ci) if ci else None


def _paired_lines(paired: dict[str, Any]) -> list[str]:
    """deadpool against each peer, paired round by round (``paired.py``): the only comparison with a verdict."""
    if not paired:
        return []
    rows = []
    for peer, pc in paired.items():
        w, c = pc["window"], pc["cpu"]
        rows.append([peer, fmt_ratio(w["median"]), _ci(w["ci90"]), f"{w['x_faster_rounds']} of {w['rounds']}",
                     w["verdict"], fmt_ratio(c["median"]), _ci(c["ci90"]), c["verdict"]])
    return ["deadpool against each peer, paired round by round (per round: (deadpool / `none`) / (peer / `none`), "
            "median over rounds, 90% CI by bootstrap over rounds; *better* needs the CI's upper end below 1.0, "
            "*worse* its lower end above 1.0, anything else is *no difference measured*; comparing the two modes' "
            "window ratios above column by column is not a verdict):", "",
            md_table(["peer", "window deadpool / peer", "90% CI", "rounds deadpool faster", "window verdict",
                      "CPU deadpool / peer", "CPU 90% CI", "CPU verdict"], rows), ""]


def _machine_wide_sync(doc: dict[str, Any]) -> bool:
    """Results measured before issue 45 ended a file-writing peer's window with a machine-wide ``os.sync`` (they
    record no ``file_sync``)."""
    return doc.get("file_sync") is None


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# Snapshot overhead: a checkpoint every iteration, counted whole", ""]
    lines.append(f"Command: `{doc['command']}`  ")
    m = doc.get("machine", {})
    v = m.get("versions", {})
    git = m.get("git") or {}
    lines.append(f"Machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model')}), {fmt_bytes(m.get('mem_total_bytes'))} "
                 f"RAM, load at start {m.get('loadavg')}; torch {v.get('torch')}, deepspeed {v.get('deepspeed')}; "
                 f"git {str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}; code digest "
                 f"`{str((doc.get('provenance') or {}).get('code_digest'))[:12]}`; {m.get('time_utc')}.")
    if doc.get("note"):
        lines += ["", f"Note: {doc['note']}"]
    lines += ["", "**The rule.** Each round runs a window of consecutive steps of every mode (the order rotates from "
              "round to round), each step with its checkpoint. Every rank starts a window at a barrier; the window "
              "ends when the last checkpoint in it is complete (deadpool: committed on every rank; DCP: the future "
              "resolved; DeepSpeed's decoupled writer: flushed and committed; files: `fsync` of the mode's own files "
              f"{'(`os.sync`, machine-wide, in this run)' if _machine_wide_sync(doc) else ''}; DLRover flash: its "
              "copy into shared memory, which is synchronous). The job's window is the slowest rank's. *Window "
              "ratio* = the window of a mode / the window of `none` in the same round, median over rounds, 90% CI "
              "by percentile bootstrap over the rounds. *CPU ratio*: the job's process CPU (every thread of every "
              "rank) over the same windows, paired the same way. *Tail*: the part of a window after its last "
              "step (checkpoint work still outstanding then; it is inside the window). *Blocking*: what the "
              "training thread waits per checkpoint, as a fraction of the `none` median step.", ""]
    for size, entry in doc["sizes"].items():
        if "error" in entry:
            lines += [f"## {size}: FAILED", "", f"```\n{entry['error']}\n```", ""]
            continue
        lines += _render_size(size, entry)
    return "\n".join(lines)


def _render_size(size: str, entry: dict[str, Any]) -> list[str]:
    res, an = entry["result"], entry["analysis"]
    sch = res["schedule"]
    lines = [f"## {size}: {res['params'] / 1e6:.1f}M params, seq {res['seq_len']}, micro-batch {res['micro_batch']}"
             f"/rank, {res['world_size']} ranks ZeRO-{res['zero_stage']} {res['dtype']}, "
             f"{res['layout']['simulated_nodes']} simulated nodes, replication factor "
             f"{res['layout']['replication_factor']}", ""]
    zero = {k: v for k, v in res["deepspeed_config"]["zero_optimization"].items() if k != "stage"}
    lines.append(f"ZeRO overrides: {zero or 'none'}; activation checkpointing: "
                 f"{'on' if res.get('activation_checkpointing') else 'off'}; deadpool section: "
                 f"`{json.dumps({k: v for k, v in res['deadpool_config'].items() if k != 'job_id'})}` (the "
                 "effective config, defaults resolved, is in the JSON).")
    lines += ["", f"{sch['rounds']} measured rounds x a window of {sch['steps_per_block']} steps per mode "
              f"(+ {sch['warmup_rounds']} warm-up round x {sch['warmup_steps']} steps); job wall time "
              f"{entry.get('job_wall_s', 0):.0f} s.", ""]
    lines += ["What each mode protects:", "",
              md_table(["mode", "tensors", "where", "replica on another node", "checksums"],
                       [[mode, *(PROTECTS.get(mode, {}).get(k) for k in ("tensors", "where", "replica", "checksums"))]
                        for mode in an["modes"]]), ""]
    rows = []
    for mode, mm in an["modes"].items():
        b = mm.get("blocking_s") or {}
        rows.append([mode, fmt_s(mm["window_s_per_step"]["median"]), fmt_ratio(mm["window_ratio"]),
                     _ci(mm.get("window_ratio_ci90")), fmt_ratio(mm["cpu_ratio"]), _ci(mm.get("cpu_ratio_ci90")),
                     f"{mm['cpu_s_per_step_per_rank']:.3f} s", fmt_s(mm["tail_s"]["median"]),
                     f"{fmt_s(b.get('median'))} / {fmt_s(b.get('max'))}" if b else None,
                     fmt_pct(mm.get("blocking_fraction_of_step"), 2), fmt_bytes(mm["rank_rss_bytes_max"])])
    lines.append(md_table(["mode", "window / step", "window ratio", "90% CI", "CPU ratio", "CPU 90% CI",
                           "CPU/step/rank", "tail", "blocking med / max", "blocking % step", "rank RSS max"], rows))
    lines.append("")
    lines += _paired_lines(an.get("paired") or {})
    for mode, note in res.get("notes", {}).items():
        lines.append(f"- `{mode}`: {note}")
    dec = res["ranks"][0].get("decoupled") or {}
    if dec.get("writer_type"):
        lines.append(f"- `ds_decoupled` writer type: {dec['writer_type']}"
                     f"{'; ' + dec['writer_note'] if dec.get('writer_note') else ''}.")
    cpu = an.get("cpu")
    if cpu:
        fp = cpu["floor_parts_s"]
        prof = cpu["profile_cpu_s_per_step_per_rank"]
        lines.append(f"- CPU (deadpool): {fmt_s(cpu['extra_cpu_s_per_step_per_rank'])} extra per step per rank "
                     f"(x{fmt_ratio(cpu['cpu_ratio_to_none'])} of `none`); the floor measured in this job "
                     f"{fmt_s(cpu['floor_cpu_s'])} = copy {fmt_s(fp['copy_cpu_s'])} + checksum "
                     f"{fmt_s(fp['checksum_cpu_s'])} + exchange with the replica peer(s) {fmt_s(fp['exchange_cpu_s'])}"
                     f" (`none` plus the floor: x{fmt_ratio(cpu['floor_ratio_to_none'])}); extra / floor = "
                     f"{fmt_ratio(cpu['extra_over_floor'], 2)}.")
        lines.append("- where the extra CPU goes, per step per rank: "
                     + ", ".join(f"{k.replace('_', ' ')} {fmt_s(v)}" for k, v in prof.items())
                     + " (worker phases: that thread's CPU; other threads: gloo's sending and receiving the "
                       "replica, and the kernel's socket work; the training thread does no snapshot work beyond "
                       "its ~1.5 ms hook: on CPU its extra is DeepSpeed's shared-memory allreduce spinning "
                       "(`deepspeed_shm_comm`, `wait_buffer_state_until_2` is a busy loop) while the peer rank "
                       "is slowed by its own snapshot work, a cost of these CPU-only hosts).")
        lines.append(f"- memory traffic per snapshot per rank: {fmt_bytes(cpu['bytes_touched_per_snapshot'])} "
                     f"against the floor's {fmt_bytes(cpu['bytes_floor_per_snapshot'])} "
                     f"(x{fmt_ratio(cpu['bytes_over_floor'], 2)}"
                     f"; checksums {'in the copy pass' if cpu['checksum_fused'] else 'in a pass of their own'}).")
    for name in ("deadpool", "deadpool_t1", "deadpool_normal"):
        mm = an["modes"].get(name)
        if mm and mm.get("background_s"):
            lines.append(f"- `{name}` per snapshot (medians, wall / worker CPU): " + ", ".join(
                f"{p} {fmt_s(mm['background_s'][p]['median'])} / {fmt_s(mm['background_cpu_s'][p]['median'])}"
                for p in PHASES) + f"; machine busy {fmt_pct(mm['machine_busy_fraction'], 0)} (`none`: "
                f"{fmt_pct(an['modes']['none']['machine_busy_fraction'], 0)}).")
    mem = an["memory"]
    r0 = mem["per_rank"][0]
    lines.append(f"- memory per rank: state {fmt_bytes(r0['state_bytes'])}; /dev/shm {fmt_bytes(r0['shm_bytes'])} "
                 f"({mem['max_ratio']:.4f} x state with headers, {mem['max_data_ratio']:.4f} x in tensor data; bound "
                 f"{mem['bound_ratio']} x).")
    lines += ["", "Targets (deadpool, counted whole):", ""]
    t = an["targets"]
    if "ratio" in t:
        tr = t["ratio"]
        verdict = "met" if tr["met"] else "not met"
        if not tr.get("resolved"):
            verdict += " (the 90% CI straddles the target: this run does not resolve it)"
        lines.append(f"- window ratio <= {fmt_ratio(tr['target'])} ({tr['target_is']}): **{verdict}** "
                     f"({fmt_ratio(tr['value'])}, 90% CI {_ci(tr.get('ci90'))})")
    if "peer" in t:
        tp = t["peer"]
        lines.append(f"- against `{tp['against']}` in the same job ({tp['target_is']}): "
                     f"**{'met' if tp['met'] else 'not met'}** ({sentence(tp['comparison'])})")
    if "ratio_ci_upper" in t:
        lines.append(f"- upper bound of that CI <= {t['ratio_ci_upper']['target']}: "
                     f"**{'met' if t['ratio_ci_upper']['met'] else 'not met'}** "
                     f"({fmt_ratio(t['ratio_ci_upper']['value'])})")
    if "cpu_ratio" in t:
        tc = t["cpu_ratio"]
        lines.append(f"- process CPU per step <= x{tc['target']}: **{'met' if tc['met'] else 'not met'}** "
                     f"(x{fmt_ratio(tc['value'])}; `none` plus one copy, one checksum pass and one replica exchange "
                     f"per step, measured in this job: x{fmt_ratio(tc.get('floor_ratio'))})")
    lines.append(f"- memory <= {t['memory']['target']} x state: **{'met' if t['memory']['met'] else 'not met'}** "
                 f"({t['memory']['value']:.4f} x)")
    lines.append("")
    return lines
