#!/usr/bin/env python
"""A replica fetched at a restore: its checksums checked while it arrives, against checked after it arrived.

Two ranks on one gloo group (the snapshot side group's transport, ``GlooTransport``); rank 0 holds a sealed
snapshot blob of a rank's captured state, rank 1 fetches it into a pre-touched buffer and checks it before use, in
interleaved pairs (the order alternating per pair):

- ``after``: the body in one message, then every checksum (``probe_slot(verify=True)``: what a restore did before);
- ``overlapped``: the body in ``FETCH_CHUNK_BYTES`` pieces, each tensor hashed as far as it has arrived
  (``StreamVerifier``), the rest of the check once the blob is in (``probe_received``: what a restore does now).

Also measured in the same run, per size: the transfer alone (one message, no check) and the check alone (every
checksum of the received blob), so the overlapped time can be read against its floor, max(transfer, check), and the
sequential one against their sum. Reported: rank 1's seconds from the start of the round to the checked blob,
medians with [min, max], and the per-pair difference (overlapped - after).

    python benchmarks/bench_fetch_check.py                      # 139 and 357 MiB blobs (GPT small / medium per rank)

Writes ``benchmarks/results/fetch_check.json`` and ``.md``. On this 2-core host the sender's kernel copy, gloo's
receiving thread and the hashing thread share two cores; across real hosts only the last two share the receiver's.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, bootstrap_median_ci, machine_info, write_json, write_text  # noqa: E402

MODES = ("after", "overlapped")
SIZES_MIB = (139, 357)  # GPT small at 2 ranks, GPT medium at 4 ranks: a rank's captured state (0.75 of it)


def _blob(mib: int) -> Any:
    """A sealed blob like a rank's captured state: fp32 tensors, a quarter of the bytes in one (the embedding's
    partition), the rest in 3 x 48 equal ones (master, exp_avg, exp_avg_sq of 48 parameter partitions)."""
    import torch

    from deadpool_ext.snapshot.slots import serialize

    n = (mib << 20) // 4
    big = n // 4
    each = (n - big) // 144
    gen = torch.Generator().manual_seed(mib)
    tensors = {"big": torch.randn(big, generator=gen)}
    tensors.update({f"t{i}": torch.randn(each, generator=gen) for i in range(144)})
    return torch.frombuffer(bytearray(serialize({"tensors": tensors, "state": {}}, {"version": 1, "rank": 0})),
                            dtype=torch.uint8)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from deadpool_ext.replicate.gloo import GlooTransport
    from deadpool_ext.replicate.transport import FETCH_CHUNK_BYTES, BlobReceive, BlobSend
    from deadpool_ext.snapshot import format as fmt
    from deadpool_ext.snapshot.slots import probe_received, probe_slot

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    transport = GlooTransport(dist.new_group(backend="gloo"))
    out: dict[str, Any] = {"sizes": {}}
    for mib in args.sizes:
        blob = _blob(mib) if rank == 0 else None
        n = int(blob.numel()) if blob is not None else 0
        sizes = [n]
        dist.broadcast_object_list(sizes, src=0)
        n = sizes[0]
        into = torch.ones(n, dtype=torch.uint8)  # touched
        runs: dict[str, list[float]] = {m: [] for m in (*MODES, "transfer", "check")}

        def once(mode: str, blob: Any = blob, into: Any = into, n: int = n, runs: Any = runs) -> None:
            chunk = FETCH_CHUNK_BYTES if mode == "overlapped" else None
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                assert blob is not None
                transport.exchange([BlobSend(1, blob)], [], chunk)
                return
            buf = memoryview(into.numpy())
            check = fmt.StreamVerifier(buf) if mode == "overlapped" else None
            transport.exchange([], [BlobReceive(0, into, n, check.advance if check else None)], chunk)
            t1 = time.perf_counter()
            if mode == "overlapped":
                meta, why = probe_received(buf, check)
            elif mode in ("after", "check"):
                meta, why = probe_slot(buf, verify=True, restorable=True)
            else:
                meta, why = {}, None
            t2 = time.perf_counter()
            if meta is None:
                raise SystemExit(f"[bench] the fetched blob failed its check: {why}")
            runs[mode].append(t2 - (t1 if mode == "check" else t0))

        for _ in range(args.warmup):
            for mode in MODES:
                once(mode)
        for pair in range(args.pairs):
            for mode in (MODES if pair % 2 == 0 else MODES[::-1]):
                once(mode)
            once("transfer")
            once("check")
            if rank == 1:
                print(f"[bench] {mib} MiB pair {pair}: " + ", ".join(f"{m} {runs[m][-1]:.3f} s" for m in runs),
                      flush=True)
        out["sizes"][str(mib)] = {"blob_nbytes": n, "runs": runs}
    if rank == 1:
        with open(args.result_file, "w") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for mib, doc in raw["sizes"].items():
        runs = doc["runs"]
        diffs = [o - a for o, a in zip(runs["overlapped"], runs["after"])]
        med = {m: statistics.median(v) for m, v in runs.items()}
        out[mib] = {"blob_nbytes": doc["blob_nbytes"], **{m: _stats(v) for m, v in runs.items()},
                    "diff_overlapped_minus_after": _stats(diffs),
                    "diff_median_ci90": bootstrap_median_ci(diffs),
                    "floor_overlapped_s": max(med["transfer"], med["check"]),
                    "sum_transfer_check_s": med["transfer"] + med["check"],
                    "check_hidden_fraction": ((med["after"] - med["overlapped"]) / med["check"]
                                              if med["check"] else None)}
    return out


def render(doc: dict[str, Any]) -> str:
    lines = ["# A fetched replica checked while it arrives", "",
             f"Command: `{doc['command']}`  ",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in doc["machine"].items()), "",
             "Two ranks on one host, one gloo group (the snapshot side group's transport). Rank 1's seconds from the "
             "start of the round to a blob checked before use; median [min, max] over "
             f"{doc['pairs']} interleaved pairs (order alternating). *after*: one message, then every checksum (the "
             "restore before this change); *overlapped*: 16 MiB pieces, each tensor hashed as far as it has arrived, "
             "the rest once the blob is in (the restore now). *transfer* and *check* alone, in the same run, give the "
             "floor of the overlapped time (the larger of the two) and the sequential time (their sum).", "",
             "| blob | after | overlapped | overlapped - after (per pair) | its median's 90% CI | transfer alone | "
             "check alone | floor max(transfer, check) | check time hidden |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.3f} s [{s['min']:.3f}, {s['max']:.3f}]"

    for a in doc["results"].values():
        hidden = a["check_hidden_fraction"]
        lo_hi = a.get("diff_median_ci90")
        ci = "-" if not lo_hi else f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}] s"
        lines.append(f"| {a['blob_nbytes'] / 2**20:.0f} MiB | {cell(a['after'])} | {cell(a['overlapped'])} | "
                     f"{cell(a['diff_overlapped_minus_after'])} | {ci} | {cell(a['transfer'])} | {cell(a['check'])} | "
                     f"{a['floor_overlapped_s']:.3f} s | {'-' if hidden is None else f'{hidden:.0%}'} |")
    lines += ["", "*check time hidden* = (after - overlapped) / check alone, medians: the share of the checksum pass "
              "that no longer adds to the fetch. Both ranks and gloo's threads share this host's 2 cores, so the "
              "hashing competes with the receive for CPU here; across hosts it competes with the receiver's gloo "
              "thread only.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES_MIB),
                   help="blob sizes in MiB, comma-separated (default 139,357)")
    p.add_argument("--pairs", type=int, default=30, help="measured pairs per size (default 30)")
    p.add_argument("--warmup", type=int, default=1, help="discarded pairs per size")
    p.add_argument("--name", default="fetch_check")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(s <= 0 for s in args.sizes) or args.pairs <= 0 or args.warmup < 0:
        p.error("--sizes and --pairs must be positive, --warmup not negative")
    if args.worker:
        worker(args)
        return 0
    from deadpool_ext.testing.jobs import Job

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        # torchrun's own monitor interval (0.1 s), as this benchmark has always run it
        cmd = Job(launcher="torchrun", script=os.path.abspath(__file__), nproc_per_node=2,
                  port=29500 + os.getpid() % 1000, launcher_flags=("--monitor-interval=0.1",),
                  args=("--worker", "--sizes", ",".join(map(str, args.sizes)), "--pairs", str(args.pairs),
                        "--warmup", str(args.warmup), "--result-file", result)).argv()
        print("[bench] " + shlex.join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=REPO, timeout=1800).returncode
        if rc != 0 or not os.path.exists(result):
            print(f"[bench] the job failed (exit {rc})", file=sys.stderr)
            return 1
        with open(result) as fh:
            raw = json.load(fh)
    doc = {"command": "python " + shlex.join(["benchmarks/bench_fetch_check.py", *(argv or sys.argv[1:])]),
           "machine": machine_info(), "pairs": args.pairs, "raw": raw, "results": analyse(raw)}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{args.name}.json"), doc)
    write_text(os.path.join(args.out, f"{args.name}.md"), render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
