#!/usr/bin/env python
"""Recovery across hosts: the namespace bed (3 hosts, each its own address and /dev/shm, a 3-member etcd), one
deadpool-run per host, against the same job on one host, side by side in one run.

Modes (GPT, DeepSpeed ZeRO-3, 3 nodes x 1 process + 2 spares, snapshots every step, replication factor 1):

* ``same_host``        one launcher on one bed host, every node simulated there; SIGKILL of worker ``node1.0``
                       (what ``bench_recovery.py`` measures, here on the bed with the etcd store);
* ``follower_host``    3 launchers; host 2 (node2) SIGKILLed whole, its launcher and memory included;
* ``coordinator_host`` 3 launchers; host 0 (node0, spare0 and the coordinator role) SIGKILLed whole: another
                       launcher takes the role over when host 0's lease lapses (``--leader-ttl-s``).

For each run: the timeline's phases (``recovery.timeline.phases``: detect, agree, rebuild, restore, recompute,
total; the injector's ``fault`` event is t = 0), the losses against the mode's fault-free run of the same
length (bit for bit), and for coordinator loss the moment another launcher took the role.

    python benchmarks/bench_hosts.py                      # GPT small, 2 repeats per mode (~10 min)
    python benchmarks/bench_hosts.py --size tiny --repeats 1   # smoke run (~3 min)

Needs root (network namespaces). Writes ``benchmarks/results/recovery_hosts.json`` and ``.md`` (``--name``).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from common import machine_info  # noqa: E402

from deadpool_ext.recovery.timeline import phases  # noqa: E402
from deadpool_ext.testing.hostjob import HostsRun, run_on_hosts  # noqa: E402
from deadpool_ext.testing.hosts import HostBed, missing_requirements  # noqa: E402

MODES = ("same_host", "follower_host", "coordinator_host")
PHASES = ("detect_s", "agree_s", "rebuild_s", "restore_s", "recompute_s", "total_s")


def write_config(path: str, micro_batch: int) -> None:
    with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        cfg = json.load(fh)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["deadpool"] = {"enabled": True, "snapshot": {"interval": 1}, "replication": {"factor": 1}}
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def one_run(mode: str, workdir: str, args: argparse.Namespace, *, fault: bool, tag: str,
            suspect_age_s: float | None = None) -> HostsRun:
    """One job on a fresh bed; ``suspect_age_s``: deadpool-run's --suspect-age-s (None: the launcher's default)."""
    bed = HostBed(3, workdir=workdir, shm_size="6g")
    bed.start()
    try:
        bed.start_etcd(secrets.token_urlsafe(24), members=3)
        cfg = os.path.join(workdir, f"{tag}.ds.json")
        write_config(cfg, args.micro_batch)
        metrics = os.path.join(workdir, f"{tag}.jsonl")
        script = ["scripts/pretrain_gpt.py", "--deepspeed_config", cfg, "--model-size", args.size,
                  "--train-iters", str(args.kill_step + args.steps_after), "--metrics-out", metrics,
                  "--seed", str(args.seed)]
        victim = {"same_host": None, "follower_host": 2, "coordinator_host": 0}[mode]

        def kill(b: HostBed, _timeline: str) -> None:
            if victim is None:   # the worker node1.0 on the single host
                import psutil

                for p in psutil.process_iter(["environ"]):
                    try:
                        if (p.info["environ"] or {}).get("DEADPOOL_WORKER_ID") == "node1.0" and p.pid in b.pids(0):
                            p.kill()
                            return
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
                raise RuntimeError("worker node1.0 not found on host 0")
            b.kill_host(victim)

        run = run_on_hosts(bed, workdir, script, metrics, nnodes=3, spares=2, name=tag,
                           fault=kill if fault else None, fault_step=args.kill_step, timeout_s=args.timeout_s,
                           hosts=1 if mode == "same_host" else 3, leader_ttl_s=args.leader_ttl_s,
                           extra=["--detect-timeout-s", str(args.detect_timeout_s),
                                  *(["--suspect-age-s", str(suspect_age_s)] if suspect_age_s is not None
                                    else [])])
        return run
    finally:
        bed.close()


def summarize(run: HostsRun, reference: dict[int, float]) -> dict[str, Any]:
    ph = phases(run.events)
    rec: dict[str, Any] = {"rcs": run.rcs, "steps": len(run.metrics),
                           "losses_identical": run.metrics == reference and bool(reference),
                           "phases": ph[0] if ph else None}
    if run.t_fault is not None:
        leaders = [e for e in run.events if e.get("event") == "leader" and e["time"] > run.t_fault]
        rec["took_over_s"] = round(leaders[0]["time"] - run.t_fault, 3) if leaders else None
        assigned = [e for e in run.events if e.get("event") == "assignment"]
        rec["assignment_s"] = round(assigned[0]["published_at"] - run.t_fault, 3) if assigned else None
        rec["replaced"] = assigned[0]["replaced"] if assigned else None
    return rec


def _machine_line(m: Any) -> str:
    if not isinstance(m, dict):
        return str(m)
    versions = m.get("versions") or {}
    parts = [f"{m.get('cpu_count')} CPUs ({m.get('cpu_model')})"]
    if m.get("loadavg"):
        parts.append("load at start [" + ", ".join(f"{x:.1f}" for x in m["loadavg"]) + "]")
    if versions:
        parts.append(", ".join(f"{k} {v}" for k, v in versions.items() if v))
    parts.append(f"git {(m.get('git') or {}).get('commit', '')[:10]}")
    parts.append(str(m.get("time_utc")))
    return "; ".join(parts)


def _suspect_value(v: float | None) -> str:
    return "default (1.5 x --heartbeat-s)" if v is None else ("0, off" if v == 0 else str(v))


def _suspect(doc: dict[str, Any]) -> str:
    """The run's --suspect-age-s: the launcher's default (1.5 x --heartbeat-s), a value, the values compared
    (``variants``), or absent (before it)."""
    if "variants" in doc:
        return "compared: " + " / ".join(_suspect_value(v) for v in doc["variants"])
    if "suspect_age_s" not in doc:
        return "- (before survivors reported)"
    return _suspect_value(doc["suspect_age_s"])


def parse_variants(text: str) -> list[float | None]:
    """``--compare-suspect-age-s``: comma-separated seconds or ``default``; at least two, no repeats."""
    out: list[float | None] = []
    for item in (t.strip() for t in text.split(",")):
        try:
            v = None if item == "default" else float(item)
        except ValueError:
            raise ValueError(f"--compare-suspect-age-s: {item!r} is not a number of seconds or 'default'") from None
        if v is not None and v < 0:
            raise ValueError(f"--compare-suspect-age-s: {item!r} is negative")
        out.append(v)
    if len(out) < 2 or len(set(out)) != len(out):
        raise ValueError(f"--compare-suspect-age-s: give two or more different values, got {text!r}")
    return out


def run_key(mode: str, variant: float | None) -> str:
    """Where a compared run is kept in ``doc["runs"]``: ``follower_host@0``, ``follower_host@default``."""
    return f"{mode}@default" if variant is None else f"{mode}@{variant:g}"


def render(doc: dict[str, Any]) -> str:
    lines = [f"# Recovery across hosts: namespace bed vs one host ({doc['size']})", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {_machine_line(doc['machine'])}; total wall {doc['wall_s']:.0f} s.", "",
             "Setup: 3 hosts as Linux network namespaces (own address, own tmpfs /dev/shm), a 3-member etcd cluster "
             "on their bridge, one `deadpool-run` per host (`--leader-ttl-s "
             f"{doc['leader_ttl_s']}`, `--detect-timeout-s {doc['detect_timeout_s']}`, `--suspect-age-s "
             f"{_suspect(doc)}`); GPT {doc['size']}, ZeRO-3, "
             "3 nodes x 1 process + 2 spares, snapshots every step, one peer replica. Kill after step "
             f"{doc['kill_step']} of {doc['kill_step'] + doc['steps_after']}. Every phase in seconds from the "
             "SIGKILL (`recovery.timeline.phases`); medians over repeats, each repeat listed. "
             "Losses compared bit for bit with the same mode's fault-free run.", "",
             "| mode | what is lost | first survivor's report | detect | agree | rebuild | restore | recompute | total "
             "| coordinator taken over | next generation published | losses identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lost = {"same_host": "worker node1.0 (one process)", "follower_host": "host 2: node2, its launcher, its memory",
            "coordinator_host": "host 0: node0, spare0, the coordinator's launcher, its memory"}
    rows = ([(m, f"{m}, --suspect-age-s {_suspect_value(v)}", doc["runs"][run_key(m, v)])
             for m in doc["modes"] for v in doc["variants"]] if "variants" in doc
            else [(m, m, doc["runs"][m]) for m in doc["modes"]])
    for mode, label, runs in rows:
        ph = [r["phases"] for r in runs if r.get("phases")]

        def med(key: str, rows: list[dict[str, Any]] = ph) -> str:
            vals = [r[key] for r in rows if r.get(key) is not None]
            if not vals:
                return "-"
            each = ", ".join(f"{v:.2f}" for v in vals)
            return f"{statistics.median(vals):.2f} ({each})" if len(vals) > 1 else f"{vals[0]:.2f}"
        took = med("took_over_s", runs) if mode == "coordinator_host" else "-"
        ident = "yes" if runs and all(r["losses_identical"] for r in runs) else "NO"
        lines.append(f"| {label} | {lost[mode]} | {med('reported_s')} | " + " | ".join(med(k) for k in PHASES)
                     + f" | {took} | {med('assignment_s', runs)} | {ident} ({len(runs)}/{len(runs)}) |")
    if "variants" in doc:
        lines += ["", "The values of `--suspect-age-s` were alternated repeat by repeat in this one run (each repeat "
                  "runs every value in turn, on a fresh bed each), so they saw the same host."]
    lines += ["", "What the numbers say: see `docs/multi-host.md` (Bounds). Detection of a whole host lost is the "
              "suspect age after a survivor's report of its failed collective (`--suspect-age-s`; the host's sockets "
              "closed), else the heartbeat timeout (`--detect-timeout-s`; the dead launcher reports no exit) or the "
              "host's lease, whichever comes first; the next generation is published once the lost host's lease "
              "lapsed (the fence waits for it); detection of the coordinator's host is the lease TTL (nobody is "
              "watching until another launcher holds the role). Everything after detection is the same protocol "
              "as on one host.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--steps-after", type=int, default=3)
    p.add_argument("--leader-ttl-s", type=int, default=4)
    p.add_argument("--detect-timeout-s", type=float, default=3.0)
    p.add_argument("--suspect-age-s", type=float, default=None,
                   help="deadpool-run --suspect-age-s (default: the launcher's, 1.5 x --heartbeat-s; 0: off, detection "
                        "by the heartbeat timeout or the lease only, as before survivors reported)")
    p.add_argument("--compare-suspect-age-s", default=None, metavar="LIST",
                   help="comma-separated --suspect-age-s values (seconds or 'default') run side by side, alternated "
                        "repeat by repeat, e.g. '0,default': survivors' reports off and on")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--name", default="recovery_hosts")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--render-only", metavar="JSON", default=None, help="rewrite the .md beside JSON, run nothing")
    args = p.parse_args(argv)
    if args.render_only:
        with open(args.render_only) as fh:
            doc = json.load(fh)
        with open(args.render_only[:-len(".json")] + ".md", "w") as fh:
            fh.write(render(doc))
        return 0
    why = missing_requirements()
    if why is not None:
        print(f"bench_hosts: {why}", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bench_hosts: --modes: unknown {bad}; allowed: {', '.join(MODES)}", file=sys.stderr)
        return 2
    try:
        variants = parse_variants(args.compare_suspect_age_s) if args.compare_suspect_age_s else None
    except ValueError as exc:
        print(f"bench_hosts: {exc}", file=sys.stderr)
        return 2
    if variants is not None and args.suspect_age_s is not None:
        print("bench_hosts: --suspect-age-s and --compare-suspect-age-s: give one", file=sys.stderr)
        return 2
    t0 = time.time()
    doc: dict[str, Any] = {
        "command": "python benchmarks/bench_hosts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "size": args.size, "kill_step": args.kill_step, "steps_after": args.steps_after,
        "leader_ttl_s": args.leader_ttl_s, "detect_timeout_s": args.detect_timeout_s,
        "suspect_age_s": args.suspect_age_s,
        "modes": modes, "references": {}}
    if variants is not None:
        doc["variants"] = variants
    keys = ([(m, v, run_key(m, v)) for m in modes for v in variants] if variants is not None
            else [(m, args.suspect_age_s, m) for m in modes])
    doc["runs"] = {k: [] for _, _, k in keys}
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as scratch:
        for mode in modes:
            ref = one_run(mode, scratch, args, fault=False, tag=f"{mode}_ref")
            doc["references"][mode] = {"rcs": ref.rcs, "steps": len(ref.metrics)}
            print(f"[bench_hosts] {mode} reference: rcs {ref.rcs}, {len(ref.metrics)} steps", flush=True)
            for r in range(args.repeats):
                for key, suspect in [(k, v) for m, v, k in keys if m == mode]:
                    run = one_run(mode, scratch, args, fault=True, tag=f"{key.replace('@', '_')}_r{r}",
                                  suspect_age_s=suspect)
                    rec = summarize(run, ref.metrics)
                    if rec["phases"] is None or not rec["losses_identical"]:
                        rec["log_tail"] = run.tails(1500)
                    doc["runs"][key].append(rec)
                    ph = rec["phases"] or {}
                    print(f"[bench_hosts] {key} r{r}: total {ph.get('total_s')}, detect {ph.get('detect_s')}, "
                          f"reported {ph.get('reported_s')}, published {rec.get('assignment_s')}, "
                          f"took over {rec.get('took_over_s')}, identical {rec['losses_identical']}, rcs {run.rcs}",
                          flush=True)
    doc["wall_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
