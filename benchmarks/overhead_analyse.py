"""bench_snapshot_overhead, the analysis: rank 0's result file -> figures, every one counted whole.

The measuring rule (issue "honest numbers"): each round runs a *window* of consecutive steps per mode, each step
with its checkpoint. Every rank starts the window at a barrier; a rank's window ends when the last checkpoint of
the window is complete on it (deadpool: committed, ``wait_idle``; DCP: the future resolved; the decoupled writer:
flushed and committed; DeepSpeed's default engine and DCP and the decoupled writer: ``fsync`` of their own files
(``os.sync`` before issue 45); DLRover flash:
its copy into shared memory, synchronous). The job's window is the slowest rank's. A mode's figure is the ratio of
its window to the window without checkpoints (``none``) of the same round, the median over rounds, with a
percentile-bootstrap 90% CI over the rounds. Process CPU (every thread) is taken over the same window.

Nothing here imports torch. Split out of ``bench_snapshot_overhead.py``; ``render`` is in ``overhead_render.py``.
"""
from __future__ import annotations

from typing import Any

from common import bootstrap_median_ci, median, ratio, summarize
from paired import compare_blocks

SNAPSHOT_MODES = ("deadpool", "deadpool_t1", "deadpool_normal")
PEERS = ("dlrover_flash", "dcp_async", "ds_decoupled", "ds_default")
"""The peers deadpool is compared with, paired round by round (``paired.py``), where the job ran them."""
PEER_TARGET = "dlrover_flash"
"""Where a size has no fixed ratio target, deadpool must be no worse than this peer in the same job."""
PHASES = ("copy", "seal", "replicate", "commit")

# What each mode's checkpoint protects, stated beside its figures: the same work must not be compared with less.
PROTECTS: dict[str, dict[str, str]] = {
    "none": {"tensors": "nothing", "where": "-", "replica": "-", "checksums": "-"},
    "deadpool": {"tensors": "the captured state (fp32 masters, optimizer state, partitions; parameters re-derived "
                            "at restore) + counters, scheduler, RNG",
                 "where": "tier 1: /dev/shm slot on the rank's node", "replica": "yes: one copy in the other "
                 "node's memory (gloo side group)", "checksums": "yes: xxh3 per tensor, globally committed"},
    "deadpool_t1": {"tensors": "as deadpool", "where": "tier 1 only", "replica": "no", "checksums": "yes"},
    "deadpool_normal": {"tensors": "as deadpool", "where": "as deadpool (worker at normal priority)",
                        "replica": "yes", "checksums": "yes"},
    "ds_default": {"tensors": "DeepSpeed's checkpoint: model states (parameters) + optimizer states",
                   "where": "local disk, torch.save", "replica": "no", "checksums": "no"},
    "ds_decoupled": {"tensors": "as ds_default", "where": "local disk, a writer process per rank",
                     "replica": "no", "checksums": "no"},
    "dcp_async": {"tensors": "the tensors deadpool captures (the same bytes)", "where": "local disk, "
                  "torch.distributed.checkpoint.async_save", "replica": "no", "checksums": "no"},
    "dlrover_flash": {"tensors": "DeepSpeed's checkpoint state dicts", "where": "/dev/shm on the rank's node "
                      "(DLRover's agent persists from there when asked)", "replica": "no", "checksums": "no"},
}


def job_blocks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per block, the job's view: the window is the slowest rank's; step times the slowest rank's per step."""
    out = []
    for i in range(len(ranks[0]["blocks"])):
        per_rank = [rk["blocks"][i] for rk in ranks]
        b0 = per_rank[0]
        n = len(b0["step_s"])
        out.append({
            "round": b0["round"], "mode": b0["mode"], "warmup": b0["warmup"], "steps": n,
            "window_s": max(b["block_wall_s"] for b in per_rank),
            "step_s": [max(vals) for vals in zip(*(b["step_s"] for b in per_rank))],
            "drain_s": max(b["drain_s"] for b in per_rank),
            "cpu_s": sum(b["cpu_s"] for b in per_rank),
            "blocking_s": [max(v) for v in zip(*([s + w for s, w in zip(b["save_s"], b["wait_s"])]
                                                 for b in per_rank))],
            "per_rank": per_rank,
        })
    return out


def _paired(measured: list[dict[str, Any]], mode: str, key: Any) -> list[float]:
    """Per round, ``key(block of mode) / key(block of none)``."""
    vals = []
    for r in sorted({b["round"] for b in measured}):
        mb = [b for b in measured if b["round"] == r and b["mode"] == mode]
        nb = [b for b in measured if b["round"] == r and b["mode"] == "none"]
        if mb and nb and key(nb[0]):
            vals.append(key(mb[0]) / key(nb[0]))
    return vals


def analyze(res: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    ranks = res["ranks"]
    modes = res["schedule"]["modes"]
    blocks = job_blocks(ranks)
    measured = [b for b in blocks if not b["warmup"]]
    base_steps = [s for b in measured if b["mode"] == "none" for s in b["step_s"]]
    base_step = median(base_steps)
    out: dict[str, Any] = {"rule": "window", "modes": {}}
    for mode in modes:
        mine = [b for b in measured if b["mode"] == mode]
        per_rank_blocks = [pb for b in mine for pb in b["per_rank"]]
        win = _paired(measured, mode, lambda b: b["window_s"] / b["steps"])
        cpu = _paired(measured, mode, lambda b: b["cpu_s"] / b["steps"])
        m: dict[str, Any] = {
            "protects": PROTECTS.get(mode, {}),
            "window_s_per_step": summarize([b["window_s"] / b["steps"] for b in mine]),
            "window_ratios": win,
            "window_ratio": median(win),
            "window_ratio_ci90": bootstrap_median_ci(win) if mode != "none" else None,
            "cpu_ratios": cpu,
            "cpu_ratio": median(cpu),
            "cpu_ratio_ci90": bootstrap_median_ci(cpu) if mode != "none" else None,
            "cpu_s_per_step_per_rank": median([pb["cpu_s"] / len(pb["step_s"]) for pb in per_rank_blocks]),
            "main_thread_cpu_s_per_step_per_rank": median(
                [pb["main_thread_cpu_s"] / len(pb["step_s"]) for pb in per_rank_blocks if "main_thread_cpu_s" in pb]),
            "cpu_s_per_step_by_rank": [median([b["per_rank"][i]["cpu_s"] / b["steps"] for b in mine])
                                       for i in range(len(ranks))],
            # inside the window, after its last step: the checkpoint work still outstanding then
            "tail_s": summarize([b["drain_s"] for b in mine]),
            "step_s": summarize([s for b in mine for s in b["step_s"]]),
            "machine_busy_fraction": median([pb["machine_busy_fraction"] for pb in per_rank_blocks]),
            "rank_rss_bytes_max": max((pb["memory"]["rss"] for pb in per_rank_blocks), default=None),
            "children_rss_bytes_max": max((pb["memory"]["children_rss"] for pb in per_rank_blocks), default=None),
            "windows_measured": len(mine),
            "steps_per_window": mine[0]["steps"] if mine else None,
        }
        if mode in SNAPSHOT_MODES:
            snap = {k: [v for pb in per_rank_blocks for v in pb["snapshots"].get(k, [])]
                    for k in per_rank_blocks[0]["snapshots"]} if per_rank_blocks else {}
            m["blocking_s"] = summarize(snap.get("blocking_s", []))
            m["background_s"] = {p: summarize(snap.get(f"{p}_s", [])) for p in PHASES}
            m["background_cpu_s"] = {p: summarize(snap.get(f"{p}_cpu_s", [])) for p in PHASES}
            m["snapshot_thread_cpu_s_per_snapshot"] = median(
                [pb["snapshot_thread_cpu_s"] / max(1, len(pb["snapshots"]["copy_s"])) for pb in per_rank_blocks])
        elif mode != "none":
            m["blocking_s"] = summarize([v for pb in per_rank_blocks
                                         for v in (s_ + w for s_, w in zip(pb["save_s"], pb["wait_s"]))])
        if "blocking_s" in m:
            m["blocking_fraction_of_step"] = ratio(m["blocking_s"]["median"], base_step)
        out["modes"][mode] = m
    out["paired"] = paired_against_peers(blocks, modes)
    out["memory"] = _memory(res)
    out["cpu"] = _cpu_analysis(ranks, out["modes"])
    out["targets"] = _targets(res, out, targets)
    out["blocks"] = [{k: v for k, v in b.items() if k != "per_rank"} for b in blocks]
    return out


def paired_against_peers(blocks: list[dict[str, Any]], modes: list[str], x: str = "deadpool") -> dict[str, Any]:
    """``x`` against each peer the job ran, paired round by round: the window and the job's process CPU per step,
    each ``paired.Comparison.to_dict()`` (median ratio of ratios, its 90% CI, the verdict)."""
    if x not in modes:
        return {}
    return {peer: {"window": compare_blocks(blocks, x, peer, key="window_s").to_dict(),
                   "cpu": compare_blocks(blocks, x, peer, key="cpu_s").to_dict()}
            for peer in PEERS if peer in modes}


def _memory(res: dict[str, Any]) -> dict[str, Any]:
    mem = []
    for rk in res["ranks"]:
        slot = rk["slot_bytes"][0] if rk["slot_bytes"] else 0
        captured = rk.get("captured_bytes", rk["state_bytes"])
        mem.append({"rank": rk["rank"], "node": rk["node"], "state_bytes": rk["state_bytes"],
                    "shm_bytes": rk["shm_bytes"], "slot_bytes": rk["slot_bytes"], "replica_bytes": rk["replica_bytes"],
                    "replica_sources": rk["replica_sources"], "holders": rk["holders"],
                    "replica_buffers_per_source": rk.get("replica_buffers_per_source", 1),
                    "ratio": rk["shm_bytes"] / rk["state_bytes"], "captured_bytes": captured,
                    "data_ratio": ((len(rk["slot_bytes"]) + rk["replica_bytes"] // max(slot, 1)) * captured
                                   / rk["state_bytes"]) if slot else 0,
                    "rss_end": rk["memory_end"].get("rss"), "hwm": rk["memory_end"].get("hwm")})
    return {"per_rank": mem, "bound_ratio": 2 + res["layout"]["replication_factor"],
            "max_ratio": max(x["ratio"] for x in mem), "max_data_ratio": max(x["data_ratio"] for x in mem),
            "shm_job_bytes_end": res.get("shm_job_bytes_end")}


def _cpu_analysis(ranks: list[dict[str, Any]], modes: dict[str, Any]) -> dict[str, Any] | None:
    """deadpool's extra CPU per step per rank (its windows' process CPU minus ``none``'s, rank by rank, median over
    ranks) beside the floor measured in the same job, and the profile of where it goes."""
    if "deadpool" not in modes or not all("cpu_floor" in rk for rk in ranks):
        return None
    dpm = modes["deadpool"]
    dp, base = dpm["cpu_s_per_step_by_rank"], modes["none"]["cpu_s_per_step_by_rank"]
    extra = median([a - b for a, b in zip(dp, base) if a is not None and b is not None])
    floors = [rk["cpu_floor"] for rk in ranks]
    floor = median([f["total_cpu_s"] for f in floors])
    captured = median([f["captured_bytes"] for f in floors]) or 0
    replicas = median([len(f["holders"]) for f in floors]) or 0
    fused = all(rk.get("checksum_fused") for rk in ranks)
    touched = captured * (2 + (0 if fused else 1) + replicas)
    floor_bytes = captured * (2 + replicas)
    main_extra = (dpm["main_thread_cpu_s_per_step_per_rank"] or 0) - (
        modes["none"]["main_thread_cpu_s_per_step_per_rank"] or 0)
    # Where the extra CPU goes, per step per rank (a snapshot every step): the worker thread's phases, the training
    # thread's hook, and the rest (gloo's threads sending and receiving the replica, the kernel's socket work).
    phases = {p: (dpm.get("background_cpu_s", {}).get(p) or {}).get("median") for p in PHASES}
    worker = sum(v for v in phases.values() if v is not None)
    profile = {f"worker_{p}": v for p, v in phases.items()}
    profile["training_thread"] = main_extra
    profile["other_threads"] = (extra - worker - main_extra) if extra is not None else None
    return {
        "extra_cpu_s_per_step_per_rank": extra,
        "cpu_ratio_to_none": dpm.get("cpu_ratio"),
        "floor_cpu_s": floor,
        "floor_parts_s": {k: median([f[k] for f in floors]) for k in ("copy_cpu_s", "checksum_cpu_s",
                                                                       "exchange_cpu_s")},
        "extra_over_floor": ratio(extra, floor),
        "floor_ratio_to_none": ratio((modes["none"]["cpu_s_per_step_per_rank"] or 0) + (floor or 0),
                                     modes["none"]["cpu_s_per_step_per_rank"]),
        "checksum_fused": fused,
        "bytes_touched_per_snapshot": touched,
        "bytes_floor_per_snapshot": floor_bytes,
        "bytes_over_floor": ratio(touched, floor_bytes),
        "main_thread_extra_cpu_s": main_extra,
        "profile_cpu_s_per_step_per_rank": profile,
    }


def _targets(res: dict[str, Any], an: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    size = res["size"]
    dp = an["modes"].get("deadpool", {})
    out: dict[str, Any] = {}
    value, ci = dp.get("window_ratio"), dp.get("window_ratio_ci90")
    bound = targets["ratio"].get(size)
    if bound is not None:
        out["ratio"] = {"target": bound, "target_is": "fixed", "value": value, "ci90": ci,
                        "met": value is not None and value <= bound,
                        "resolved": bool(ci) and not (ci[0] <= bound < ci[1])}
    if PEER_TARGET in an.get("paired", {}):
        # against the peer: paired round by round, never deadpool's interval against the peer's point estimate
        pc = an["paired"][PEER_TARGET]["window"]
        out["peer"] = {"against": PEER_TARGET, "target_is": "no worse: the paired 90% CI's lower end <= 1.0",
                       "comparison": pc, "met": pc["no_worse"]}
    if targets["ci_upper"].get(size) is not None:
        out["ratio_ci_upper"] = {"target": targets["ci_upper"][size], "value": (ci or [None, None])[1],
                                 "met": bool(ci) and ci[1] <= targets["ci_upper"][size]}
    if targets["cpu_ratio"].get(size) is not None:
        cr = dp.get("cpu_ratio")
        out["cpu_ratio"] = {"target": targets["cpu_ratio"][size], "value": cr,
                            "floor_ratio": (an.get("cpu") or {}).get("floor_ratio_to_none"),
                            "met": cr is not None and cr <= targets["cpu_ratio"][size]}
    out["memory"] = {"target": an["memory"]["bound_ratio"], "value": an["memory"]["max_data_ratio"],
                     "with_headers": an["memory"]["max_ratio"],
                     "met": round(an["memory"]["max_data_ratio"], 4) <= an["memory"]["bound_ratio"]}
    return out
