#!/usr/bin/env python
"""What signing the peer channel's snapshot blobs costs (``replicate/auth.py``, a checkpoint key set).

Three measurements, each signed vs unsigned side by side in one run:

1. **tag throughput**: :class:`BlobSigner.tag` over blobs of 16, 64 and 256 MiB (one core), repeated; MiB/s.
2. **one tier-2 round, real processes**: two ranks under torchrun exchange a blob of ``--blob-mb`` MiB each way
   through :class:`GlooTransport` (gloo on loopback), rounds alternating unsigned / signed in one job; round
   time (slowest rank), ratio signed / unsigned with a bootstrap interval.
3. **training step**: ``pretrain_gpt.py`` GPT ``--size`` (default small), ZeRO-3, 2 ranks on two simulated nodes,
   a snapshot every step replicated to the other node (factor 1), jobs alternating without / with
   ``DEADPOOL_CHECKPOINT_KEY`` (``--pairs`` pairs); median step time after warm-up, the snapshot's blocking
   time and its background replication time (``stats()``), ratio with a bootstrap interval.

Usage::

    python benchmarks/bench_peer_sign.py --quick     # tiny model, small blobs, ~1 minute
    python benchmarks/bench_peer_sign.py             # ~6-10 minutes on 2 shared cores

Writes ``benchmarks/results/peer_sign.json`` and ``peer_sign.md`` (``--name`` to change). Runs itself under
torchrun in ``--worker`` mode for part 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    REPO,
    RESULTS_DIR,
    bootstrap_ratio_ci,
    fmt_ratio,
    machine_info,
    md_table,
    median,
    ratio,
    summarize,
    write_json,
    write_text,
)

KEY = "bench-peer-sign-key-0123456789abcdef"
KEY_ENV = "DEADPOOL_CHECKPOINT_KEY"


# -- part 1 -------------------------------------------------------------------------------------------------------
def tag_throughput(sizes_mb: list[int], repeats: int) -> list[dict[str, Any]]:
    import torch

    from deadpool_ext.replicate.auth import BlobSigner

    signer = BlobSigner(KEY.encode())
    out = []
    for mb in sizes_mb:
        blob = torch.randint(0, 256, (mb << 20,), dtype=torch.uint8)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            signer.tag(0, blob[8:], blob[:8])
            rates.append(mb / (time.perf_counter() - t0))
        out.append({"blob_mib": mb, "mib_s": summarize(rates)})
        print(f"[peer_sign] tag {mb} MiB: median {median(rates):.0f} MiB/s", flush=True)
    return out


# -- part 2 -------------------------------------------------------------------------------------------------------
def worker(blob_mb: int, rounds: int, out_path: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from deadpool_ext.replicate.auth import BlobSigner
    from deadpool_ext.replicate.gloo import GlooTransport
    from deadpool_ext.replicate.transport import BlobReceive, BlobSend
    from deadpool_ext.snapshot.slots import serialize

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    n = (blob_mb << 20) // 4
    blob = torch.frombuffer(bytearray(serialize({"w": torch.rand(n)}, {"rank": rank, "version": 1})),
                            dtype=torch.uint8)
    into = torch.zeros(blob.numel() + 4096, dtype=torch.uint8)
    transports = {"unsigned": GlooTransport(group), "signed": GlooTransport(group, BlobSigner(KEY.encode()))}
    times: dict[str, list[float]] = {"unsigned": [], "signed": []}
    for i in range(rounds + 1):  # round 0 warms the connections up, not counted
        for mode in (("unsigned", "signed") if i % 2 else ("signed", "unsigned")):
            dist.barrier(group)
            t0 = time.perf_counter()
            refused = transports[mode].exchange([BlobSend(1 - rank, blob)], [BlobReceive(1 - rank, into, blob.numel())])
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
            assert not refused
            if i:
                times[mode].append(float(dt.item()))
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({"blob_mib": blob_mb, "blob_bytes": int(blob.numel()), "times": times}, fh)
    dist.barrier()
    dist.destroy_process_group()


def transport_rounds(blob_mb: int, rounds: int, tmp: str) -> dict[str, Any]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port, run_job

    out = os.path.join(tmp, f"rounds_{blob_mb}.json")
    res = run_job(Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=2, port=free_port(),
                      args=("--worker", str(blob_mb), str(rounds), out)).argv(), timeout_s=900, env=base_env())
    if res.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"part 2 worker failed (rc={res.returncode}):\n{res.output[-3000:]}")
    with open(out) as fh:
        data = json.load(fh)
    u, s = data["times"]["unsigned"], data["times"]["signed"]
    data.update(unsigned=summarize(u), signed=summarize(s), ratio=ratio(median(s), median(u)),
                ratio_ci90=bootstrap_ratio_ci(s, u))
    print(f"[peer_sign] round {blob_mb} MiB each way: unsigned {median(u):.3f} s, signed {median(s):.3f} s, "
          f"ratio {fmt_ratio(data['ratio'])}", flush=True)
    return data


# -- part 3 -------------------------------------------------------------------------------------------------------
def training_pairs(size: str, iters: int, warmup: int, pairs: int, tmp: str) -> dict[str, Any]:
    from deadpool_ext.testing.jobs import Job
    from deadpool_ext.testing.launch import base_env, free_port, run_job

    base = json.load(open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")))
    runs: dict[str, list[dict[str, Any]]] = {"unsigned": [], "signed": []}
    for p in range(pairs):
        for mode in (("unsigned", "signed") if p % 2 == 0 else ("signed", "unsigned")):
            name = f"{mode}{p}"
            shm = os.path.join(tmp, f"shm_{name}")
            os.makedirs(shm)
            cfg = dict(base, deadpool={"snapshot": {"interval": 1}, "replication": {"factor": 1},
                                       "local": {"shm_root": shm, "simulate_nodes": 2}})
            cfg_path = os.path.join(tmp, f"{name}.json")
            with open(cfg_path, "w") as fh:
                json.dump(cfg, fh)
            metrics = os.path.join(tmp, f"{name}.jsonl")
            env = base_env({KEY_ENV: KEY} if mode == "signed" else {})
            if mode == "unsigned":
                env.pop(KEY_ENV, None)
            job = Job(launcher="torchrun", script="scripts/pretrain_gpt.py", nproc_per_node=2, port=free_port(),
                      config=cfg_path, args=("--model-size", size, "--train-iters", str(iters)), metrics=metrics)
            res = run_job(job.argv(), timeout_s=1800, env=env)
            if res.returncode != 0:
                raise SystemExit(f"part 3 job {name} failed (rc={res.returncode}):\n{res.output[-3000:]}")
            signed_line = "snapshot blobs between peers are signed" in res.output
            if signed_line != (mode == "signed"):
                raise SystemExit(f"part 3 job {name}: signing was {'on' if signed_line else 'off'}, expected {mode}")
            summary = [ln for ln in res.output.splitlines() if ln.startswith("[pretrain_gpt] summary ")][-1]
            stats = json.JSONDecoder().raw_decode(summary[len("[pretrain_gpt] summary "):])[0]["deadpool"]
            with open(metrics) as fh:
                records = [json.loads(line) for line in fh if line.strip()]
            steps = [r["step_time_s"] for r in records if r["step"] > warmup]
            runs[mode].append({"step_time_s": steps, "blocking_s_median": stats.get("blocking_s_median"),
                               "replicate_s_median": stats.get("replicate_s_median")})
            print(f"[peer_sign] job {name}: median step {median(steps):.3f} s, replicate "
                  f"{stats.get('replicate_s_median')}", flush=True)
    out: dict[str, Any] = {"size": size, "iters": iters, "warmup": warmup, "pairs": pairs, "runs": runs}
    for key in ("step_time_s",):
        u = [v for r in runs["unsigned"] for v in r[key]]
        s = [v for r in runs["signed"] for v in r[key]]
        out[key] = {"unsigned": summarize(u), "signed": summarize(s), "ratio": ratio(median(s), median(u)),
                    "ratio_ci90": bootstrap_ratio_ci(s, u)}
    for key in ("blocking_s_median", "replicate_s_median"):
        u = [r[key] for r in runs["unsigned"] if r[key] is not None]
        s = [r[key] for r in runs["signed"] if r[key] is not None]
        out[key] = {"unsigned": summarize(u), "signed": summarize(s), "ratio": ratio(median(s), median(u))}
    return out


# -- report -------------------------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.1f} ms"


def _ci(ci: Any) -> str:
    return "—" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# Signing the peer channel: cost (`{res['command']}`)", "",
             f"{m['cpu_count']} CPUs ({m['cpu_model']}), load {m['loadavg'][0]:.1f} at start, "
             f"git {str(m['git']['commit'])[:8]}{' (dirty)' if m['git']['dirty'] else ''}, {m['time_utc']}. "
             "Signed and unsigned are measured side by side in one run (rounds and jobs alternate).", "",
             "## 1. HMAC-SHA256 tag throughput (one core)", "",
             md_table(["blob", "median MiB/s", "min", "max", "n"],
                      [[f"{r['blob_mib']} MiB", f"{r['mib_s']['median']:.0f}", f"{r['mib_s']['min']:.0f}",
                        f"{r['mib_s']['max']:.0f}", r["mib_s"]["n"]] for r in res["tag"]]), "",
             "## 2. One tier-2 round, 2 ranks, gloo on loopback, a blob each way", "",
             md_table(["blob", "unsigned (median)", "signed (median)", "ratio signed/unsigned", "90% CI", "rounds"],
                      [[f"{r['blob_mib']} MiB", _ms(r["unsigned"]["median"]), _ms(r["signed"]["median"]),
                        fmt_ratio(r["ratio"]), _ci(r["ratio_ci90"]), r["unsigned"]["n"]]
                       for r in res["rounds"]]), ""]
    t = res.get("training")
    if t:
        st = t["step_time_s"]
        lines += [f"## 3. Training step, GPT {t['size']}, ZeRO-3, 2 ranks on 2 simulated nodes, a snapshot every "
                  f"step replicated (factor 1); {t['pairs']} job pairs, steps {t['warmup'] + 1}-{t['iters']}", "",
                  md_table(["", "unsigned", "signed", "ratio signed/unsigned", "90% CI"],
                           [["step time (median over all jobs' steps)", _ms(st["unsigned"]["median"]),
                             _ms(st["signed"]["median"]), fmt_ratio(st["ratio"]), _ci(st["ratio_ci90"])],
                            ["snapshot blocking (median of the jobs' medians)",
                             _ms(t["blocking_s_median"]["unsigned"]["median"]),
                             _ms(t["blocking_s_median"]["signed"]["median"]),
                             fmt_ratio(t["blocking_s_median"]["ratio"]), "—"],
                            ["background replication (median of the jobs' medians)",
                             _ms(t["replicate_s_median"]["unsigned"]["median"]),
                             _ms(t["replicate_s_median"]["signed"]["median"]),
                             fmt_ratio(t["replicate_s_median"]["ratio"]), "—"]]), ""]
    lines += ["Reading: the tag is computed in the snapshot worker thread, after the training thread was released "
              "(snapshot blocking does not include it); what it costs the step is the CPU it takes from training "
              "while it runs, which part 3 measures. Without a key nothing is computed (zeros travel in the "
              "trailer)."]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, small blobs (a smoke run)")
    p.add_argument("--blob-mb", default=None, help="comma-separated blob sizes for part 2 (MiB)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per mode in part 2")
    p.add_argument("--size", default=None, help="model size for part 3 (tiny, small, medium)")
    p.add_argument("--iters", type=int, default=None, help="steps per job in part 3")
    p.add_argument("--pairs", type=int, default=None, help="job pairs in part 3 (0: skip part 3)")
    p.add_argument("--name", default=None, help="result file stem (default peer_sign, peer_sign_quick)")
    args = p.parse_args()
    q = args.quick
    blob_mb = [int(x) for x in (args.blob_mb or ("4,16" if q else "16,128")).split(",")]
    rounds = args.rounds or (3 if q else 8)
    size = args.size or ("tiny" if q else "small")
    iters = args.iters or (8 if q else 24)
    pairs = args.pairs if args.pairs is not None else (1 if q else 2)
    name = args.name or ("peer_sign_quick" if q else "peer_sign")
    res: dict[str, Any] = {"command": "python benchmarks/bench_peer_sign.py " + " ".join(sys.argv[1:]),
                           "machine": machine_info()}
    res["tag"] = tag_throughput([4, 16] if q else [16, 64, 256], 3 if q else 5)
    with tempfile.TemporaryDirectory(prefix="peer_sign_") as tmp:
        res["rounds"] = [transport_rounds(mb, rounds, tmp) for mb in blob_mb]
        if pairs:
            res["training"] = training_pairs(size, iters, min(4, iters // 3), pairs, tmp)
    write_json(os.path.join(RESULTS_DIR, f"{name}.json"), res)
    write_text(os.path.join(RESULTS_DIR, f"{name}.md"), render(res))
    print(f"[peer_sign] wrote benchmarks/results/{name}.json and .md", flush=True)


if __name__ == "__main__":
    main()
