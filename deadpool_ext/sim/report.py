"""Human-readable views of a :func:`~deadpool_ext.sim.recommend.recommend` result: a text report for the
terminal and markdown for ``benchmarks/results``."""
from __future__ import annotations

from typing import Any

LOST = ("overhead", "rework", "detect", "wait", "restart", "load", "replay", "shrunk", "stopped")
NO_SPARE_COLUMN = {"wait": ("wait", "wait for node"), "shrink": ("shrunk", "shrunk (fewer replicas)"),
                   "fail": ("stopped", "stopped (no spare)")}
"""The table column of what the job lost when the pool was empty, per ``cluster.no_spare_policy``."""

DESCRIPTIONS = {
    "ckpt_sync": "persistent checkpoint, step waits for the write; restart the job",
    "ckpt_async": "persistent checkpoint written in the background; restart the job",
    "gemini": "in-memory checkpoint + peer replica; restart the job (Gemini)",
    "deadpool": "in-memory snapshot + peer replica; hot-swap a spare (DeadPool)",
    "tiercheck": "differential every iteration, base every K; restart (TierCheck)",
}


def _intervals(iv: dict[str, int], iteration_s: float) -> str:
    short = {"memory_interval": "mem", "persist_interval": "persist", "base_interval": "base"}
    return ", ".join(f"{short.get(k, k)} {v} ({_dur(v * iteration_s)})" for k, v in iv.items())


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _no_spare(rep: dict[str, Any]) -> tuple[str, str]:
    return NO_SPARE_COLUMN[rep["params"]["cluster"].get("no_spare_policy", "wait")]


def _rows(rep: dict[str, Any]) -> list[list[str]]:
    it = rep["params"]["workload"]["iteration_s"]
    lost = _no_spare(rep)[0]
    rows = []
    for name, s in rep["policies"].items():
        b = s["breakdown"]
        recovery = sum(b[k] for k in ("detect", "restart", "load", "replay"))
        r = s["restores_mean"]
        rows.append([name, _intervals(s["intervals"], it), f"{s['goodput_mean']:.4f}", f"{s['goodput_std']:.4f}",
                     f"[{s['goodput_p5']:.4f}, {s['goodput_p95']:.4f}]", f"{100 * b['overhead']:.2f}%",
                     f"{100 * b['rework']:.2f}%", f"{100 * recovery:.2f}%", f"{100 * b.get(lost, 0.0):.2f}%",
                     f"{r['local']:.0f}/{r['peer']:.0f}/{r['storage']:.1f}",
                     "" if s["fits_memory"] else "does not fit host memory"])
    return rows


HEADERS = ["policy", "best intervals (iterations)", "goodput", "sd", "[p5, p95]", "overhead", "rework",
           "recovery", "wait for node", "restores local/peer/storage", "note"]


def headers(rep: dict[str, Any]) -> list[str]:
    """:data:`HEADERS` with the no-spare column named for the report's ``cluster.no_spare_policy``."""
    return [_no_spare(rep)[1] if h == "wait for node" else h for h in HEADERS]


def swap_cost_text(d: dict[str, Any]) -> str:
    """What one hot-swap is charged (agree + rebuild; detection, restore and the recomputed iteration apart), and
    how: a spare builds its engine ahead for the node it shadows, and takes any other node's ranks at the unready
    cost (relabelled in place for data parallelism, started again otherwise), so the charge mixes the two by the
    share of nodes some spare shadows."""
    fixed, unready = d["hotswap_fixed_s"], d["hotswap_unready_s"]
    f = d.get("built_ahead_fraction")
    charged = d.get("hotswap_s")
    if charged is None or f is None:  # a report written before the charge was recorded
        f = min(d["spares"], d["nodes"]) / d["nodes"] if d["nodes"] else 0.0
        charged = f * fixed + (1.0 - f) * unready
    return (f"hot-swap charged {charged:.2f} s per swap (agree + rebuild: {fixed:.2f} s for the {100 * f:.2g}% of "
            f"nodes a spare built ahead for, {unready:.2f} s for the rest)")


def header_lines(rep: dict[str, Any]) -> list[str]:
    p, d = rep["params"], rep["derived"]
    c, w, f, sim = p["cluster"], p["workload"], p["failure"], p["sim"]
    outage = f["cluster_outage_per_day"]
    policy = c.get("no_spare_policy", "wait")
    unit = c.get("shrink_unit_nodes", 1)
    return [
        f"cluster: {c['gpus']:,} GPUs = {d['nodes']:,} nodes x {c['gpus_per_node']}, {d['spares']} spare node(s), "
        f"repair {c['node_repair_h']:g} h; no spare left: {policy}"
        + (f" ({unit} nodes per data-parallel replica)" if policy == "shrink" and unit > 1 else ""),
        f"model: {w['params_b']:g}B parameters x {w['state_bytes_per_param']:g} B = "
        f"{w['params_b'] * w['state_bytes_per_param'] / 1000:.2f} TB "
        f"of state, {d['node_bytes'] / 1e9:.2f} GB per node; iteration {w['iteration_s']:g} s",
        f"failures: one every {1 / d['failure_rate_per_s'] / 3600:.2f} h ({100 * f['node_lost_fraction']:.0f}% lose "
        f"the node)" + (f", a cluster-wide outage every {1 / outage:.0f} days" if outage > 0 else ", no outages"),
        f"phases: snapshot {d['snapshot_background_s']:.2f} s off the critical path, storage write "
        f"{d['storage_write_s']:.2f} s / read {d['storage_read_s']:.2f} s, peer fetch {d['peer_fetch_s']:.2f} s, "
        f"restart {d['restart_s']:.0f} s, detect {d['detect_s']:.0f} s, {swap_cost_text(d)}",
        f"Monte Carlo: {sim['trials']} trials x {sim['horizon_days']:g} days, seed {sim['seed']}, "
        f"{rep['evaluations']} configurations",
    ]


def recommendation_line(rep: dict[str, Any]) -> str:
    r = rep["recommended"]
    it = rep["params"]["workload"]["iteration_s"]
    gains = ", ".join(f"{100 * g:+.2f} pts vs {n}" for n, g in r["gain_vs"].items() if n != r["policy"])
    return (f"recommended: {r['policy']} ({DESCRIPTIONS.get(r['policy'], '')}), "
            f"{_intervals(r['intervals'], it)}; goodput {r['goodput_mean']:.4f} ({gains})")


def text_report(rep: dict[str, Any]) -> str:
    rows = _rows(rep)
    heads = headers(rep)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = header_lines(rep) + ["", fmt.format(*heads), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    a = rep["analytic"]
    lines += ["", recommendation_line(rep),
              f"Young/Daly for a synchronous persistent checkpoint ({a['sync_checkpoint_cost_s']:.2f} s): "
              f"{a['young_interval_iterations']:.0f} / {a['daly_interval_iterations']:.0f} iterations"]
    if rep.get("checks"):
        lines += ["", "checks (model vs published / analytic):"]
        lines += [f"  [{c['verdict']}] {c['name']}: {c['source']}: {c['reference']} | model: {c['model']}"
                  + (f" ({c['note']})" if c["note"] else "") for c in rep["checks"]]
    return "\n".join(lines)


def markdown_table(rep: dict[str, Any]) -> str:
    def cell(v: str) -> str:
        return v.replace("|", "\\|")

    heads = headers(rep)
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in _rows(rep)]
    return "\n".join(lines)


def markdown_checks(checks: list[dict[str, Any]]) -> str:
    lines = ["| check | source | reference | model | verdict | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['source']} | {c['reference']} | {c['model']} | {c['verdict']} | {c['note']} |"
              for c in checks]
    return "\n".join(lines)
