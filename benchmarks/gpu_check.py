#!/usr/bin/env python
"""GPU path check: deadpool_ext snapshots of a 1B+ parameter model on one NVIDIA GPU.

Trains a GPT-2-like model (transformers ``GPT2LMHeadModel``, bf16, DeepSpeed ZeRO-1 on a single GPU, torch Adam)
with the deadpool section on (snapshot every iteration, no peers on one node) and measures, A/B interleaved in
one process (blocks of steps with snapshots on and off, order alternating per round):

* step-time ratio with / without snapshots at interval 1 (ratio of medians, paired per round, 90% bootstrap CI);
* blocking time per snapshot (what the training thread waits: the hook plus any wait for the previous copy);
* the device-to-host copy into page-locked (``cudaHostRegister``-ed) shared-memory slots on the manager's side
  CUDA stream, overlapped with the next step's forward/backward: copy time and bandwidth; and the same copy with
  the GPU idle, as the bandwidth reference.

    bash benchmarks/gpu_check.sh                                   # what to run on the GPU machine (< 8 min)
    DEADPOOL_GPU_OUT=/tmp/out python benchmarks/gpu_check.py --layers 24 --hidden 2048

Writes ``gpu_check.json`` into ``--out`` (default: ``$DEADPOOL_GPU_OUT``, else ``$OUT``, else ``./gpu_check_out``).
Without CUDA it stops at once with exit code 2 and says so. Argument parsing, the configuration and the result
schema are plain functions (tests/unit/test_gpu_check.py runs them on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXIT_NO_CUDA = 2
SCHEMA_VERSION = 1
REQUIRED = {"benchmark": str, "schema": int, "status": str, "command": str, "settings": dict, "device": dict,
            "model": dict, "step_s": dict, "ratio": (float, type(None)), "ratio_ci90": (list, type(None)),
            "paired_ratio": (float, type(None)), "blocking_s": dict, "copy_s": dict,
            "d2h_gbs_overlapped": (float, type(None)), "d2h_gbs_idle": (float, type(None)), "wall_s": float}


class NoCuda(RuntimeError):
    """CUDA is not available: nothing on this path can be measured here."""


def parse_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24, help="transformer layers (24 x 2048 wide: ~1.3B parameters)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4,
                   help="micro-batches per step: a longer step gives the copy something to overlap with")
    p.add_argument("--zero-stage", type=int, choices=(1, 2), default=1)
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds (each: a block on, a block off)")
    p.add_argument("--steps-per-block", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="stop starting new rounds after this many seconds (the script must finish in 8 min)")
    p.add_argument("--shm-root", default="/dev/shm")
    p.add_argument("--out", default=env.get("DEADPOOL_GPU_OUT") or env.get("OUT") or "gpu_check_out")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "heads", "vocab", "seq_len", "micro_batch", "grad_accum", "rounds",
                 "steps_per_block"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def param_count(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """GPT-2 parameter count (tied embeddings): embeddings + per layer 12 h^2 + 13 h + final layer norm."""
    return vocab * hidden + seq_len * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def deepspeed_config(args: argparse.Namespace, job_id: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero_stage},
        # torch's Adam: no JIT-compiled fused op needed on the test machine.
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "deadpool": {"enabled": True, "job_id": job_id, "snapshot": {"interval": 1}, "replication": {"factor": 0},
                     "local": {"shm_root": args.shm_root}, "recovery": {"restore_on_start": False}},
    }


def summarize(values: Sequence[float]) -> dict[str, Any]:
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": None, "p90": None, "mean": None, "min": None, "max": None}
    q = (len(vals) - 1) * 0.9
    lo = int(q)
    p90 = vals[lo] + (vals[min(lo + 1, len(vals) - 1)] - vals[lo]) * (q - lo)
    return {"n": len(vals), "median": statistics.median(vals), "p90": p90, "mean": statistics.fmean(vals),
            "min": vals[0], "max": vals[-1]}


def ratio_ci(on: Sequence[float], off: Sequence[float], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """90% percentile-bootstrap interval of median(on) / median(off)."""
    import random

    if len(on) < 2 or len(off) < 2:
        return None
    rng = random.Random(seed)
    rs = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
                for _ in range(resamples))
    return [rs[int(0.05 * (resamples - 1))], rs[int(0.95 * (resamples - 1))]]


def analyze(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios from measured (non-warm-up) blocks: ``[{"round", "snapshots": bool, "warmup", "step_s": [...]}]``."""
    on = [t for b in blocks if b["snapshots"] and not b["warmup"] for t in b["step_s"]]
    off = [t for b in blocks if not b["snapshots"] and not b["warmup"] for t in b["step_s"]]
    paired = []
    for r in sorted({b["round"] for b in blocks if not b["warmup"]}):
        a = [t for b in blocks if b["round"] == r and b["snapshots"] for t in b["step_s"]]
        z = [t for b in blocks if b["round"] == r and not b["snapshots"] for t in b["step_s"]]
        if a and z:
            paired.append(statistics.median(a) / statistics.median(z))
    return {"step_s": {"on": summarize(on), "off": summarize(off)},
            "ratio": statistics.median(on) / statistics.median(off) if on and off else None,
            "ratio_ci90": ratio_ci(on, off), "paired_ratio": statistics.median(paired) if paired else None,
            "paired_round_ratios": paired}


def validate_result(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing or mistyped field of a result document."""
    for key, typ in REQUIRED.items():
        if key not in doc:
            raise ValueError(f"gpu_check result: missing {key!r}")
        if not isinstance(doc[key], typ) or (typ is float and isinstance(doc[key], bool)):
            raise ValueError(f"gpu_check result: {key!r} has type {type(doc[key]).__name__}")
    if doc["benchmark"] != "gpu_check" or doc["schema"] != SCHEMA_VERSION:
        raise ValueError(f"gpu_check result: not a schema-{SCHEMA_VERSION} gpu_check document")
    if doc["status"] not in ("ok", "truncated"):
        raise ValueError(f"gpu_check result: status {doc['status']!r}")
    for side in ("on", "off"):
        if not isinstance(doc["step_s"].get(side), dict) or "median" not in doc["step_s"][side]:
            raise ValueError(f"gpu_check result: step_s.{side} must be a summary")


def require_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise NoCuda(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise NoCuda(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda}); "
                     "this check needs one NVIDIA GPU and a CUDA build of torch")
    return torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def idle_copy_gbs(torch: Any, tensors: list[Any]) -> float | None:
    """Device-to-host bandwidth of the same bytes into a pinned buffer, on a side stream, GPU otherwise idle."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total == 0:
        return None
    buf = torch.empty(max(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[:n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
    stream.synchronize()
    return total / (time.perf_counter() - t0) / 1e9


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    torch = require_cuda()
    t_start = time.perf_counter()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())})
    sys.path.insert(0, REPO)
    from transformers import GPT2Config, GPT2LMHeadModel

    import deadpool_ext.deepspeed as dpx
    from deadpool_ext.distributed import init_distributed

    init_distributed()
    torch.manual_seed(args.seed)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=args.seq_len, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    job_id = f"gpucheck{os.getpid()}"
    t0 = time.perf_counter()
    engine, _, _, _ = dpx.initialize(model=model, config=deepspeed_config(args, job_id),
                                     model_parameters=model.parameters())
    init_s = time.perf_counter() - t0
    snaps = engine.deadpool.snapshots
    snaps.active = False
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    def step() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.grad_accum):
            ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), device="cuda", generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    blocks: list[dict[str, Any]] = []
    status = "ok"
    for r in range(args.rounds + 1):
        if r and time.perf_counter() - t_start > args.budget_s:
            status = "truncated"
            break
        warm = r == 0
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            snaps.active = on
            n = args.warmup_steps if warm else args.steps_per_block
            blocks.append({"round": r, "snapshots": on, "warmup": warm, "step_s": [step() for _ in range(n)]})
            snaps.wait_idle()  # outside the step timer: the next block starts clean
            snaps.active = False
            print(f"[gpu_check] round {r}{' (warm-up)' if warm else ''} snapshots {'on ' if on else 'off'}: median "
                  f"step {statistics.median(blocks[-1]['step_s']):.3f} s", flush=True)
    st = snaps._stats
    tensors = [t for _, t in engine.deadpool.adapter.tensors()]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    copy = summarize(st.get("copy_s", []))
    idle = idle_copy_gbs(torch, tensors)
    doc = {"benchmark": "gpu_check", "schema": SCHEMA_VERSION, "status": status, "command": command,
           "settings": {k: v for k, v in vars(args).items()}, "wall_s": 0.0,
           "device": {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
                      "host": socket.gethostname(), "cpu_count": os.cpu_count()},
           "model": {"params": n_params, "params_formula": param_count(args.layers, args.hidden, args.vocab,
                                                                       args.seq_len),
                     "layout": f"1 GPU, DeepSpeed ZeRO-{args.zero_stage}, bf16, torch Adam",
                     "state_bytes": state_bytes, "init_s": init_s},
           "blocking_s": summarize(st.get("blocking_s", [])), "copy_s": copy,
           "d2h_gbs_overlapped": state_bytes / copy["median"] / 1e9 if copy["median"] else None,
           "d2h_gbs_idle": idle, "pinned": bool(getattr(snaps, "_stream", None) is not None),
           "shm_bytes": snaps.memory_bytes(), "blocks": blocks, **analyze(blocks)}
    engine.deadpool.close()
    doc["wall_s"] = time.perf_counter() - t_start
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        require_cuda()
    except NoCuda as exc:
        print(f"gpu_check: no CUDA here: {exc}. Nothing measured.", file=sys.stderr)
        return EXIT_NO_CUDA
    doc = run(args, command.strip())
    validate_result(doc)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"[gpu_check] ratio {doc['ratio']}, blocking median {doc['blocking_s']['median']} s, copy "
          f"{doc['copy_s']['median']} s ({doc['d2h_gbs_overlapped']} GB/s overlapped, {doc['d2h_gbs_idle']} GB/s "
          f"idle); wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
