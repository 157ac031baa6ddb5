#!/usr/bin/env python
"""A straggler swapped out against the same job keeping it (issue 46, part 1), paired round by round in one run.

Each round runs the GPT script (tiny, ZeRO-1) under ``deadpool-run --nnodes 2 --spare-nodes 1`` twice, the order
alternating between rounds: ``swap`` (``--straggler-action swap``) and ``keep`` (``--straggler-action report``: the
straggler is named and kept). After step ``--throttle-at`` node1's worker is moved into a cgroup whose CPU quota is
``--fraction`` of one core (``deadpool_ext/testing/throttle.py``: the kernel's CFS bandwidth control, a real
slowdown; no sleep in the code) and stays there until it exits (the swap fences it) or the job ends.

Per job, from its metrics (every step's time) and timeline: the onset (the instant the quota was set), onset ->
named (the ``straggler`` event), onset -> swap published (the ``assignment`` of generation 1) and onset -> trained
again (the survivors' ``caught_up``); the job's throughput (steps/s) before the onset, during the slowdown (to
``caught_up``, or to the end when kept) and after; onset -> the last step. Paired per round: keep / swap of onset
-> last step (the same steps to train after the onset in both).

    flock /tmp/deadpool-bench.lock python benchmarks/bench_straggler.py     # 4 rounds, ~5 min on 2 cores

Writes ``benchmarks/results/straggler.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, add_output_args, machine_info, md_table, median, render_only, save_result  # noqa: E402
from paired import compare_ratios  # noqa: E402

if REPO not in sys.path:
    sys.path.insert(0, REPO)

BASE = os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")


def _config(tmp: str, shm: str) -> str:
    with open(BASE) as fh:
        cfg = json.load(fh)
    cfg["zero_optimization"] = {"stage": 1}
    cfg["deadpool"]["local"] = {"shm_root": shm}
    path = os.path.join(tmp, "ds.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def run_one(tmp: str, shm: str, config: str, name: str, mode: str, a: argparse.Namespace) -> dict[str, Any]:
    from deadpool_ext.recovery.timeline import read_events
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import run_job, wait_for_step
    from deadpool_ext.testing.throttle import CpuQuota
    from deadpool_ext.testing.wait import wait_until

    job = Job(script="scripts/pretrain_gpt.py", nnodes=2, nproc_per_node=1, spare_nodes=1, shm_root=shm,
              timeline=os.path.join(tmp, f"{name}.timeline.jsonl"), config=config,
              args=("--train-iters", str(a.iters)), metrics=os.path.join(tmp, f"{name}.jsonl"),
              launcher_flags=("--straggler-action", "swap" if mode == "swap" else "report",
                              "--straggler-window", str(a.window), "--straggler-factor", str(a.factor)))
    assert job.metrics is not None and job.timeline is not None
    seen: dict[str, Any] = {}

    def inject(proc: Any) -> None:
        import psutil

        wait_for_step(job.metrics, a.throttle_at, timeout_s=180, proc=proc)

        def victim() -> Any:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if p.environ().get("DEADPOOL_WORKER_ID") == "node1.0":
                        return p
                except psutil.Error:
                    continue
            return None

        p = wait_until(victim, 30, "node1.0's process under the launcher")
        with CpuQuota(a.fraction) as quota:
            quota.add(p.pid)
            seen["onset"] = time.time()
            wait_until(lambda: proc.poll() is not None, 600, "the job's end, node1.0 throttled")

    t0 = time.time()
    res = run_job(job.argv(), timeout_s=900, while_running=inject, env=job.env())
    with open(os.path.join(tmp, f"{name}.log"), "w") as fh:
        fh.write(res.output)
    rows = [json.loads(line) for line in open(job.metrics) if line.strip()]
    events = read_events(job.timeline)
    onset = seen.get("onset")
    out: dict[str, Any] = {"mode": mode, "rc": res.returncode if not res.timed_out else -999,
                           "wall_s": time.time() - t0, "steps": len(rows)}
    if onset is None or not rows:
        return out
    named = [e for e in events if e.get("event") == "straggler"]
    assigned = [e for e in events if e.get("event") == "assignment" and e.get("generation") == 1]
    caught = [e for e in events if e.get("event") == "caught_up" and e.get("generation") == 1]
    end = rows[-1]["time"]
    back = min(float(e["time"]) for e in caught) if caught else None

    def rate(t_from: float, t_to: float) -> float | None:
        steps = [r for r in rows if t_from < r["time"] <= t_to]
        return len(steps) / (t_to - t_from) if steps and t_to > t_from else None

    before_from = next((r["time"] for r in rows if r["step"] == max(3, a.throttle_at // 4)), rows[0]["time"])
    out.update(onset_step=max((r["step"] for r in rows if r["time"] <= onset), default=0),
               named_s=(float(named[0]["time"]) - onset) if named else None,
               named_ratio=named[0].get("ratio") if named else None,
               decisions=[e.get("decision") for e in named],
               swap_s=(float(assigned[0]["published_at"]) - onset) if assigned else None,
               trained_again_s=(back - onset) if back is not None else None,
               rate_before=rate(before_from, onset),
               rate_during=rate(onset, back if back is not None else end),
               rate_after=rate(back, end) if back is not None else None,
               onset_to_end_s=end - onset,
               losses={r["step"]: r["loss"] for r in rows})
    return out


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def col(mode: str, key: str) -> list[float]:
        return [r[mode][key] for r in rounds if r[mode].get(key) is not None]

    ratios = [r["keep"]["onset_to_end_s"] / r["swap"]["onset_to_end_s"] for r in rounds
              if r["swap"].get("onset_to_end_s") and r["keep"].get("onset_to_end_s")]
    c = compare_ratios("keep", "swap", ratios)
    same = [r["swap"].get("losses") == r["keep"].get("losses") for r in rounds]
    return {"named_s": median(col("swap", "named_s")), "swap_s": median(col("swap", "swap_s")),
            "trained_again_s": median(col("swap", "trained_again_s")),
            "rate_before": median(col("swap", "rate_before") + col("keep", "rate_before")),
            "rate_during_swap": median(col("swap", "rate_during")),
            "rate_after_swap": median(col("swap", "rate_after")),
            "rate_kept": median(col("keep", "rate_during")),
            "keep_over_swap": {"median": c.median, "ci": c.ci, "verdict": c.verdict, "ratios": list(c.ratios)},
            "losses_equal": sum(same), "rounds": len(rounds),
            "all_ok": all(r[m]["rc"] == 0 for r in rounds for m in ("swap", "keep"))}


def render(doc: dict[str, Any]) -> str:
    s, a = doc["summary"], doc["args"]

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    rows = []
    for i, r in enumerate(doc["rounds"]):
        for m in ("swap", "keep"):
            x = r[m]
            rows.append([i, m, x.get("rc"), x.get("onset_step"), f(x.get("named_s")), f(x.get("swap_s")),
                         f(x.get("trained_again_s")), f(x.get("rate_before"), 1), f(x.get("rate_during"), 1),
                         f(x.get("rate_after"), 1), f(x.get("onset_to_end_s"))])
    k = s["keep_over_swap"]
    ci = "-" if k["ci"] is None else f"{k['ci'][0]:.2f}-{k['ci'][1]:.2f}"
    return "\n".join([
        "# A straggler swapped out vs kept (issue 46, part 1)", "",
        f"`{doc['command']}` at {doc['when']} ({doc['machine'].get('cpu_count')} CPUs, shared). GPT tiny, ZeRO-1, "
        f"deadpool-run 2 nodes + 1 spare, {a['iters']} steps; after step {a['throttle_at']} node1's worker runs in a "
        f"cgroup of {a['fraction']} of one core (CFS quota, 10 ms period) until it exits or the job ends. "
        f"`--straggler-window {a['window']} --straggler-factor {a['factor']}`; swap and keep (report: named, kept) "
        "alternate, order rotating per round.", "",
        f"- onset -> named: **{f(s['named_s'])} s**, -> swap published: **{f(s['swap_s'])} s**, -> the job trains "
        f"again (survivor caught up): **{f(s['trained_again_s'])} s** (medians; the window is {a['window']} s: the "
        "rule needs the straggler slow over a whole window and each half of it)",
        f"- throughput (steps/s, medians): before {f(s['rate_before'], 1)}; with the straggler "
        f"{f(s['rate_during_swap'], 1)} (swap, until caught up) / {f(s['rate_kept'], 1)} (kept, to the end); after "
        f"the swap {f(s['rate_after_swap'], 1)}",
        f"- onset -> last step, keep / swap, paired per round: {f(k['median'])} (90% CI {ci}): swap "
        f"{'faster' if k['verdict'] == 'worse' else k['verdict']} (a ratio above 1: keeping the straggler took "
        "longer)",
        f"- losses of the swapped job equal the kept job's, step for step: {s['losses_equal']} of {s['rounds']} "
        "rounds", "",
        md_table(["round", "mode", "rc", "onset step", "named s", "swap s", "trains again s", "steps/s before",
                  "during", "after", "onset -> end s"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=250)
    p.add_argument("--throttle-at", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--factor", type=float, default=2.0)
    add_output_args(p, "straggler")
    args = p.parse_args(argv)
    if args.render_only:
        return render_only(args.render_only, render)
    from deadpool_ext.testing.throttle import quota_unavailable

    why = quota_unavailable()
    if why is not None:
        p.error(f"no CPU quota can be set here: {why}")
    tmp = tempfile.mkdtemp(prefix="bench-straggler-")
    shm = tempfile.mkdtemp(prefix="bench-straggler-", dir="/dev/shm")
    try:
        config = _config(tmp, shm)
        rounds = []
        for i in range(args.rounds):
            order = ("swap", "keep") if i % 2 == 0 else ("keep", "swap")
            r = {m: run_one(tmp, shm, config, f"r{i}-{m}", m, args) for m in order}
            print(json.dumps({m: {k: v for k, v in x.items() if k != "losses"} for m, x in r.items()}), flush=True)
            rounds.append(r)
        doc = {"command": " ".join(["python", "benchmarks/bench_straggler.py", *(argv or sys.argv[1:])]),
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
               "machine": machine_info(), "rounds": rounds, "summary": summary(rounds)}
        print(save_result(args.out, args.name, doc, render))
        return 0 if doc["summary"]["all_ok"] else 1
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if os.environ.get("BENCH_KEEP") is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
