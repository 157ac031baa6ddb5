#!/usr/bin/env python3
"""GPU device check (issue 33, parts 3 and 4): deadpool_ext on one NVIDIA GPU, in one command under 8 minutes.

Parts (``--parts``, default all, run in this order, each in its own processes with its own deadline):

a. a GPT of >= 1.3B parameters (transformers GPT-2, bf16, DeepSpeed ZeRO-1, torch Adam) with a snapshot every
   iteration: windows of steps per mode (``none``, ``deadpool_t1`` tier 1 only, ``deadpool`` with the replica in a
   second process's memory over the gloo side group), A/B interleaved in one job, counted whole: a window ends
   when its last snapshot is committed (overhead_analyse.py's rule). Timed by CUDA events on the compute stream,
   no device-wide synchronize inside a window; blocking per snapshot as the training thread saw it; the slots'
   page-locking checked with ``Tensor.is_pinned()``. The second process (rank 1) trains a tiny GPT on the same GPU
   in lockstep, so that a replica has somewhere to go (NCCL cannot put two ranks on one GPU: the default group is
   gloo and each process's data-parallel group is its own one-rank NCCL group).
b. in part a's trainer, after its windows: the snapshot's copy bandwidth against the device's pinned D2H peak
   (``tensor.to("cpu", non_blocking=True)`` into a ``pin_memory`` buffer) and against a copy into a registered slot.
c. a restart restored from tier 1 onto the GPU: a first process snapshots step S, records every tensor's checksum
   and the next 10 losses (snapshots off), exits; a second process restores from shared memory onto the GPU and
   must show the same checksums and the same 10 losses.
d. differentials with torch's CUDA fused Adam: ``torch.optim.Adam(fused=True)`` runs K steps on device tensors;
   deadpool's replay (stepwise and fused, recovery/replay.py) from the base must give the optimizer's bits; the
   two replay times.
e. tier-3 capture blocking from device memory (``persist.url`` set): what ``save`` blocks per base.

On the GPU machine (gpu.md: its own python3, the wheels of ../shared/tools/gpu-wheels.sh in .site)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl \\
      && export PYTHONPATH=$PWD/.site:$PWD DS_BUILD_OPS=0 PYTHONUNBUFFERED=1 || exit 1
    set -o pipefail; PYTHON=python3 bash benchmarks/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log

Writes ``gpu_check.json`` (device, driver, torch, CUDA, DeepSpeed versions; every part's figures or why not) into
``--out`` (default ``$DEADPOOL_GPU_OUT``, else ``$OUT``, else ``benchmarks/results/gpu``). Without CUDA it stops at
once with one line and exit code 2. The analysis is ``gpu_check_analyse.py`` (pure, unit-tested on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gpu_check_analyse import (  # noqa: E402
    MIN_ROUNDS,
    MIN_STEPS,
    PARTS,
    SCHEMA_VERSION,
    bandwidth,
    compare_restart,
    parse_parts,
    schedule,
    summary_lines,
    validate_result,
    windows,
)

EXIT_NO_CUDA = 2
PART_BUDGET_S = {"a": 230.0, "c": 90.0, "d": 40.0, "e": 55.0}
"""Each part's deadline (its processes are killed past it); b runs inside a. The sum (415 s) and the start leave
room under gpu_check.sh's hard stop (465 s) and the 8-minute command; results are written after every part."""


class NoCuda(RuntimeError):
    """CUDA is not available: nothing on this path can be measured here."""


def parse_args(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of a,b,c,d,e")
    p.add_argument("--layers", type=int, default=24, help="part a: transformer layers (24 x 2048: ~1.3B parameters)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                   help=f"part a: measured rounds (after one warm-up round); under {MIN_ROUNDS} no goal is judged")
    p.add_argument("--steps-per-window", type=int, default=MIN_STEPS,
                   help=f"part a: steps per window; under {MIN_STEPS} no goal is judged")
    p.add_argument("--replica", choices=("auto", "on", "off"), default="auto",
                   help="part a: the deadpool mode with a replica in a second process (auto: when shared memory "
                        "has room for it)")
    p.add_argument("--small-layers", type=int, default=12, help="parts c and e: layers of their GPT (x --small-hidden)")
    p.add_argument("--small-hidden", type=int, default=1024)
    p.add_argument("--restart-steps", type=int, default=3, help="part c: steps before the snapshot restored from")
    p.add_argument("--diff-params", type=int, default=200_000_000, help="part d: fp32 elements the optimizer holds")
    p.add_argument("--diff-steps", type=int, default=9, help="part d: differentials replayed")
    p.add_argument("--shm-root", default="/dev/shm")
    p.add_argument("--out", default=env.get("DEADPOOL_GPU_OUT") or env.get("OUT")
                   or os.path.join(REPO, "benchmarks", "results", "gpu"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--worker", choices=("train", "restart_first", "restart_second", "diff", "tier3"),
                   help=argparse.SUPPRESS)  # how the script runs its own processes
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.part_list = parse_parts(args.parts)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("layers", "hidden", "heads", "vocab", "seq_len", "micro_batch", "grad_accum", "rounds",
                 "steps_per_window", "small_layers", "small_hidden", "restart_steps", "diff_params", "diff_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads or args.small_hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) and --small-hidden ({args.small_hidden}) must be multiples of --heads "
                f"({args.heads})")
    return args


def param_count(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """GPT-2 parameter count (tied embeddings): embeddings + per layer 12 h^2 + 13 h + final layer norm."""
    return vocab * hidden + seq_len * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def deepspeed_config(args: argparse.Namespace, job_id: str, *, replica: bool, persist: str | None = None,
                     restore: bool = False) -> dict[str, Any]:
    """bf16 ZeRO-1 with torch's Adam and the deadpool section: a snapshot every step; with ``replica`` two simulated
    nodes (the two processes) and one replica each; ``restore`` (part c): shared memory kept 300 s after the
    process exits, and the restart restores from it."""
    local: dict[str, Any] = {"shm_root": args.shm_root, **({"simulate_nodes": 2} if replica else {})}
    if restore:
        local["keep_after_exit_s"] = 300
    dp: dict[str, Any] = {
        "enabled": True, "job_id": job_id, "snapshot": {"interval": 1},
        "replication": {"factor": 1 if replica else 0}, "local": local,
        "recovery": {"restore_on_start": restore},
    }
    if persist:
        dp["persist"] = {"url": persist, "interval": 2}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "deadpool": dp,
    }


def shm_need_bytes(state_bytes: int, replica: bool) -> int:
    """Shared memory part a needs: 2 slots of the trainer's state, and with a replica 2 buffers of it in the second
    process (double-buffered), plus 5% for headers and the second process's own small state."""
    return int(state_bytes * (4 if replica else 2) * 1.05)


def gpt_state_bytes(params: int) -> int:
    """bf16 parameters + fp32 masters + Adam's two fp32 moments (ZeRO-1, one rank; on the GPU nothing is
    re-derived, so all of it is captured)."""
    return params * (2 + 4 + 4 + 4)


# -- the GPU machine ------------------------------------------------------------------------------------------


def require_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise NoCuda(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise NoCuda(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
    return torch


def versions(torch: Any) -> dict[str, Any]:
    from importlib import metadata

    def pkg(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    driver = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
            "deepspeed": pkg("deepspeed"), "transformers": pkg("transformers"), "python": sys.version.split()[0]}


def device_info(torch: Any) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0), "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}", "host": socket.gethostname(), "cpu_count": os.cpu_count()}


class SingleRankParallel:
    """A DeepSpeed ``mpu``: this process alone is its data-parallel (and model-parallel) world, over a one-rank
    NCCL group, while the default group (gloo) spans the processes of the check (the replica's holder)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group

    get_model_parallel_group = get_tensor_model_parallel_group = get_data_parallel_group

    def get_data_parallel_rank(self) -> int:
        return 0

    get_model_parallel_rank = get_tensor_model_parallel_rank = get_tensor_model_parallel_src_rank = \
        get_data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return 1

    get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_data_parallel_world_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist

        return [dist.get_rank()]


def _init_world(torch: Any) -> Any:
    """Default group gloo over this check's processes (env RANK, WORLD_SIZE, MASTER_*); each process's own one-rank
    NCCL group for DeepSpeed's data parallelism (created by every process, in the same order, as torch requires)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r], backend="nccl")
        if r == dist.get_rank():
            mine = g
    return SingleRankParallel(mine)


def _gpt(torch: Any, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, seed: int,
         deterministic: bool = False) -> Any:
    """A GPT-2 without dropout, built directly in device memory (a 1.3B model initialised on the host takes tens
    of seconds). ``deterministic`` (part c): eager attention, whose backward has no atomics."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq_len,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="eager" if deterministic else "sdpa")
    with torch.device("cuda"):
        return GPT2LMHeadModel(cfg)


def _engine(torch: Any, args: argparse.Namespace, model: Any, config: dict[str, Any], mpu: Any) -> Any:
    import deadpool_ext.deepspeed as dpx

    # device_rank 0: both processes of part a are on the one GPU, while LOCAL_RANK (0, 1) places them on two
    # simulated nodes for the replica (DeepSpeed would otherwise select the device by LOCAL_RANK)
    engine, _, _, _ = dpx.initialize(args=argparse.Namespace(device_rank=0), model=model, config=config,
                                     model_parameters=model.parameters(), mpu=mpu)
    return engine


def _batch(torch: Any, step: int, micro: int, args: argparse.Namespace, vocab: int, seq: int) -> Any:
    """The batch of (optimizer step, micro-step): a function of both, so a restarted process sees the same data."""
    g = torch.Generator(device="cuda").manual_seed(args.seed * 100_003 + step * 101 + micro)
    return torch.randint(0, vocab, (args.micro_batch, seq), device="cuda", generator=g)


def _train_step(torch: Any, engine: Any, args: argparse.Namespace, vocab: int, seq: int) -> Any:
    """One optimizer step (grad_accum micro-steps); returns the last micro-step's loss as a device tensor (read
    outside any timed window)."""
    step = int(engine.global_steps)
    loss = None
    for micro in range(args.grad_accum):
        ids = _batch(torch, step, micro, args, vocab, seq)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return loss.detach()


def worker_train(args: argparse.Namespace) -> dict[str, Any]:
    """Parts a and b. Rank 0 trains the big GPT; rank 1 (when the replica is on) a tiny one, in the same windows."""
    torch = require_cuda()
    import torch.distributed as dist

    mpu = _init_world(torch)
    rank, world = dist.get_rank(), dist.get_world_size()
    replica = world == 2
    big = rank == 0
    layers, hidden = (args.layers, args.hidden) if big else (2, 256)
    model = _gpt(torch, layers, hidden, args.heads if big else 4, args.vocab, args.seq_len, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    engine = _engine(torch, args, model, deepspeed_config(args, f"gpuchecka{os.getppid()}", replica=replica), mpu)
    init_s = time.perf_counter() - t0
    snaps = engine.deadpool.snapshots
    snaps.active = False
    factor = snaps.peers.factor
    modes = ["none", "deadpool_t1"] + (["deadpool"] if replica else [])
    budget_end = time.monotonic() + float(os.environ.get("GPU_CHECK_MEASURE_S", "180"))
    blocks: list[dict[str, Any]] = []
    pinned: dict[str, Any] = {}
    stream = torch.cuda.current_stream()
    for rnd, mode in schedule(args.rounds, modes):
        stop = torch.tensor([1 if time.monotonic() > budget_end and rnd > 1 else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every process stops at the same window (gloo, host tensor)
        if int(stop.item()):
            break
        torch.cuda.synchronize()  # outside the window: it starts on an idle device
        dist.barrier()
        snaps.active = mode != "none"
        snaps.peers.factor = factor if mode == "deadpool" else 0
        n_block = len(snaps.timings.blocking_s)
        n_copy = len(snaps.timings.copy_s)
        n_dev = len(snaps._side.copy_s) if snaps._side is not None else 0
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps_per_window)]
        done = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for ev in ends:
            _train_step(torch, engine, args, args.vocab, args.seq_len)
            ev.record(stream)
        if snaps.active:
            snaps.wait_idle()  # the host waits for the last snapshot's commit (copy event, seal, replica, commit)
        done.record(stream)  # after the commit: the window's end on the device's clock
        done.synchronize()  # this event only, after the window closed
        snaps.active = False
        snaps.peers.factor = factor
        steps_s = [start.elapsed_time(ends[0]) / 1e3] + [a.elapsed_time(b) / 1e3 for a, b in zip(ends, ends[1:])]
        blocks.append({"round": rnd, "mode": mode, "warmup": rnd == 0, "steps": len(ends),
                       "window_s": start.elapsed_time(done) / 1e3, "step_s": steps_s,
                       "tail_s": ends[-1].elapsed_time(done) / 1e3,
                       "blocking_s": list(snaps.timings.blocking_s[n_block:]),
                       "copy_s": list(snaps.timings.copy_s[n_copy:]),
                       # the copies alone, on the device's clock (side-stream events around them)
                       "device_copy_s": list(snaps._side.copy_s[n_dev:]) if snaps._side is not None else []})
        if mode != "none" and not pinned:
            pinned = {"slots_is_pinned": [bool(s.tensor().is_pinned()) for s in snaps.store.slots if s is not None],
                      "registered": [snaps._pinner.is_pinned(s) for s in snaps.store.slots if s is not None]}
        if big:
            b = blocks[-1]
            print(f"[gpu_check a] round {rnd} {mode}: window {b['window_s']:.3f} s for {b['steps']} steps, tail "
                  f"{b['tail_s']:.3f} s", flush=True)
    state = [t for _, t in engine.deadpool.adapter.tensors()]
    captured = [t for _, t in engine.deadpool.adapter.captured()]
    out: dict[str, Any] = {"rank": rank, "params": n_params, "init_s": init_s, "blocks": blocks, "pinned": pinned,
                           "state_bytes": sum(t.numel() * t.element_size() for t in state),
                           "captured_bytes": sum(t.numel() * t.element_size() for t in captured),
                           "shm_bytes": snaps.memory_bytes(), "replica": replica,
                           "replica_bytes": snaps.peers.held_nbytes(),
                           "on_device": all(t.is_cuda for t in captured)}
    if big and "b" in args.part_list:
        out["b"] = _peak_copy(torch, captured, snaps)
    engine.deadpool.close()
    dist.barrier()
    return out


def _peak_copy(torch: Any, tensors: list[Any], snaps: Any) -> dict[str, Any]:
    """The device's pinned D2H peak on the same bytes (plain ``to("cpu", non_blocking=True)`` into a pin_memory
    buffer, timed by CUDA events on a side stream), and the same into a registered slot."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    biggest = max(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
    slot = snaps.store.slots[0].tensor() if snaps.store.slots[0] is not None else None
    side = torch.cuda.Stream()

    def timed(dst: Any) -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(side)
        with torch.cuda.stream(side):
            for t in tensors:
                n = t.numel() * t.element_size()
                dst[:n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
        b.record(side)
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    timed(buf)  # warm-up
    peak = nbytes / min(timed(buf) for _ in range(3)) / 1e9
    slot_gbs = None
    if slot is not None and slot.numel() >= biggest:
        slot_gbs = nbytes / min(timed(slot) for _ in range(2)) / 1e9
    return {"pinned_peak_gbs": peak, "registered_slot_gbs": slot_gbs, "buffer_is_pinned": bool(buf.is_pinned())}


def worker_restart(args: argparse.Namespace, second: bool) -> dict[str, Any]:
    """Part c. First: S steps with snapshots, checksums of every tensor at S, then 10 steps without snapshots
    (the uninterrupted losses). Second (a new process): restore from tier 1, checksums, the same 10 steps."""
    torch = require_cuda()
    from deadpool_ext.snapshot.format import tensor_checksum

    torch.use_deterministic_algorithms(True, warn_only=True)
    mpu = _init_world(torch)
    model = _gpt(torch, args.small_layers, args.small_hidden, args.heads, args.vocab, args.seq_len, args.seed,
                 deterministic=True)
    job = f"gpucheckc{os.getppid()}"
    engine = _engine(torch, args, model, deepspeed_config(args, job, replica=False, restore=True), mpu)
    snaps = engine.deadpool.snapshots
    resumed = engine.deadpool.resume()  # the first process: nothing to restore (0); the second: step S
    if second and resumed != args.restart_steps:
        raise RuntimeError(f"the restarted process resumed at step {resumed}, not {args.restart_steps}")
    if not second:
        for _ in range(args.restart_steps):
            _train_step(torch, engine, args, args.vocab, args.seq_len)
        snaps.wait_idle()
        assert snaps.committed_version == args.restart_steps, snaps.committed_version
    version = int(engine.global_steps)
    checksums = {name: tensor_checksum(t) for name, t in engine.deadpool.adapter.tensors()}
    snaps.active = False
    losses = [float(_train_step(torch, engine, args, args.vocab, args.seq_len).float().item()) for _ in range(10)]
    st = snaps.timings
    out = {"version": version, "checksums": checksums, "losses": losses, "restored_from": st.restored_from,
           "restore_s": st.restore_s, "on_device": all(t.is_cuda for _, t in engine.deadpool.adapter.tensors())}
    engine.deadpool.close()
    return out


def worker_diff(args: argparse.Namespace) -> dict[str, Any]:
    """Part d: torch's fused Adam on device tensors, replayed from the base by deadpool's stepwise and fused
    replay; both must give the optimizer's bits."""
    torch = require_cuda()
    from deadpool_ext.recovery.replay import AdamHyper, AdamTensors, StepDiff, replay_fused, replay_naive

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    sizes = [args.diff_params // 8] * 8
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g)) for n in sizes]
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    for p in params:  # one step to create the state, then the base
        p.grad = torch.randn_like(p)
    opt.step()
    base = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone(),
             opt.state[p]["step"].clone()) for p in params]
    diffs = []
    for k in range(args.diff_steps):
        grads = [torch.randn(p.shape, device="cuda", generator=g) for p in params]
        lr = 1e-3 * (1 - k / (2 * args.diff_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
        hyper = AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, fused=True)
        diffs.append(StepDiff(grads=grads, hypers=[hyper] * len(params)))
    want = [(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]

    def run(fn: Any) -> tuple[float, bool]:
        states = [AdamTensors(param=a.clone(), exp_avg=b.clone(), exp_avg_sq=c.clone(), step=d.clone())
                  for a, b, c, d in base]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(states, diffs)
        torch.cuda.synchronize()  # a replay's time, not a training window
        dt = time.perf_counter() - t0
        exact = all(torch.equal(s.param, w[0]) and torch.equal(s.exp_avg, w[1]) and torch.equal(s.exp_avg_sq, w[2])
                    for s, w in zip(states, want))
        return dt, exact

    naive_s, naive_ok = run(replay_naive)
    fused_s, fused_ok = run(replay_fused)
    return {"elements": sum(sizes), "steps": args.diff_steps, "stepwise_s": naive_s, "fused_s": fused_s,
            "stepwise_bit_exact": naive_ok, "fused_bit_exact": fused_ok, "bit_exact": naive_ok and fused_ok,
            "speedup": naive_s / fused_s if fused_s else None, "kernel": "torch._fused_adamw_ (fused=True)"}


def worker_tier3(args: argparse.Namespace) -> dict[str, Any]:
    """Part e: a base every 2 steps persisted from device memory; what each capture blocked."""
    torch = require_cuda()
    import tempfile

    mpu = _init_world(torch)
    model = _gpt(torch, args.small_layers, args.small_hidden, args.heads, args.vocab, args.seq_len, args.seed)
    where = tempfile.mkdtemp(prefix="gpucheck-tier3-")
    try:
        engine = _engine(torch, args, model, deepspeed_config(args, f"gpuchecke{os.getppid()}", replica=False,
                                                                persist=where), mpu)
        engine.deadpool.snapshots.active = False  # tier 3 alone
        for _ in range(6):
            _train_step(torch, engine, args, args.vocab, args.seq_len)
        persist = engine.deadpool.persist
        caps = list(persist.captures) if persist is not None else []
        engine.deadpool.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    from common import summarize

    return {"bases": len(caps), "capture_s": summarize([c["capture_s"] for c in caps]),
            "bytes": caps[0]["bytes"] if caps else None,
            "gbs": caps[0]["bytes"] / min(c["capture_s"] for c in caps) / 1e9 if caps else None}


# -- the parent: one process per part (two for a with the replica), each with a deadline ---------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(worker: str, argv: list[str], ranks: int, deadline_s: float, out: str) -> tuple[list[Any], str]:
    """Run ``--worker`` in ``ranks`` processes; (their results, status). Past the deadline they are killed."""
    port = str(_free_port())
    procs, files = [], []
    for r in range(ranks):
        res = os.path.join(out, f".{worker}.{r}.json")
        files.append(res)
        # LOCAL_RANK / LOCAL_WORLD_SIZE: deadpool's simulated nodes split a host's processes by local rank
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GPU_CHECK_MEASURE_S": str(max(30, deadline_s - 70)),
               "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS (part c's bit-identical losses)
               "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--worker", worker,
                                       "--result", res], env=env, start_new_session=True))
    end = time.monotonic() + deadline_s
    status = "ok"
    for p in procs:
        try:
            rc = p.wait(max(1.0, end - time.monotonic()))
            if rc != 0 and status == "ok":
                status = f"failed: a process of --worker {worker} exited {rc} (its traceback is in the log)"
        except subprocess.TimeoutExpired:
            status = f"timeout: --worker {worker} ran past its {deadline_s:.0f} s deadline"
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)
    results = []
    for f in files:
        try:
            with open(f) as fh:
                results.append(json.load(fh))
            os.unlink(f)
        except (OSError, ValueError):
            results.append(None)
    if status == "ok" and None in results:
        status = f"failed: --worker {worker} wrote no result"
    return results, status


def _shm_free(root: str) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def run_parts(args: argparse.Namespace, argv: list[str], save: Any = None) -> dict[str, dict[str, Any]]:
    """Every selected part, in order; ``save(parts)`` after each, so a run cut short keeps what it measured."""
    parts: dict[str, dict[str, Any]] = {}
    want = args.part_list
    save = save or (lambda _parts: None)
    if "a" in want or "b" in want:
        state = gpt_state_bytes(param_count(args.layers, args.hidden, args.vocab, args.seq_len))
        free = _shm_free(args.shm_root)
        replica = args.replica == "on" or (args.replica == "auto" and free >= shm_need_bytes(state, True))
        why_not = None
        if free < shm_need_bytes(state, replica):
            why_not = (f"skipped: {args.shm_root} has {free / 1e9:.1f} GB free, part a needs "
                       f"{shm_need_bytes(state, replica) / 1e9:.1f} GB (pass --shm-root DIR on a larger tmpfs)")
        if why_not:
            for p in ("a", "b"):
                if p in want:
                    parts[p] = {"status": why_not}
        else:
            results, status = _spawn("train", argv, 2 if replica else 1, PART_BUDGET_S["a"], args.out)
            _clean_shm(args)  # tens of GB of slots and replicas: freed before the next part
            trainer = results[0]
            if "a" in want:
                parts["a"] = {"status": status}
                if trainer is not None:
                    parts["a"].update({k: v for k, v in trainer.items() if k != "b"})
                    parts["a"]["analysis"] = windows(trainer["blocks"])
                    parts["a"]["replica_note"] = ("on: rank 1 (a tiny GPT on the same GPU) holds the replica"
                                                  if replica else f"off: {args.shm_root} has {free / 1e9:.1f} GB "
                                                  f"free, a replica needs {shm_need_bytes(state, True) / 1e9:.1f}")
            if "b" in want:
                if trainer is None or "b" not in trainer:
                    parts["b"] = {"status": status if status != "ok" else "failed: no measurement"}
                else:
                    copy_s = [v for blk in trainer["blocks"] if not blk["warmup"] for v in blk["device_copy_s"]]
                    parts["b"] = {"status": status, **trainer["b"],
                                  **bandwidth(trainer["captured_bytes"], copy_s, trainer["b"]["pinned_peak_gbs"],
                                              trainer["b"]["registered_slot_gbs"])}
        save(parts)
    if "c" in want:
        first, status = _spawn("restart_first", argv, 1, PART_BUDGET_S["c"] / 2, args.out)
        second, status2 = _spawn("restart_second", argv, 1, PART_BUDGET_S["c"] / 2, args.out) \
            if status == "ok" else ([None], status)
        _clean_shm(args)
        parts["c"] = {"status": status2 if status == "ok" else status}
        if first[0] is not None and second[0] is not None:
            parts["c"].update(compare_restart(first[0], second[0]))
            parts["c"]["restore_s"] = second[0].get("restore_s")
            parts["c"]["on_device"] = second[0].get("on_device")
        save(parts)
    if "d" in want:
        res, status = _spawn("diff", argv, 1, PART_BUDGET_S["d"], args.out)
        parts["d"] = {"status": status, **(res[0] or {})}
        save(parts)
    if "e" in want:
        res, status = _spawn("tier3", argv, 1, PART_BUDGET_S["e"], args.out)
        parts["e"] = {"status": status, **(res[0] or {})}
        _clean_shm(args)
    return parts


def _clean_shm(args: argparse.Namespace) -> None:
    """Every shared-memory directory this check's jobs left (their ids end in this process's pid)."""
    for name in os.listdir(args.shm_root):
        if name.startswith("deadpool.gpucheck") and name.split(".")[1].endswith(str(os.getpid())):
            shutil.rmtree(os.path.join(args.shm_root, name), ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        torch = require_cuda()
    except NoCuda as exc:
        print(f"gpu_check: no CUDA here: {exc}. Nothing measured.", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.worker:
        sys.path.insert(0, REPO)
        fn = {"train": worker_train, "restart_first": lambda a: worker_restart(a, False),
              "restart_second": lambda a: worker_restart(a, True), "diff": worker_diff, "tier3": worker_tier3}
        result = fn[args.worker](args)
        with open(args.result, "w") as fh:
            json.dump(result, fh)
        return 0
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    head = {"benchmark": "gpu_check", "schema": SCHEMA_VERSION,
            "command": "python3 benchmarks/gpu_check.py " + " ".join(argv),
            "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
            "versions": versions(torch), "device": device_info(torch)}
    print(f"[gpu_check] {head['device']['name']}, driver {head['versions']['driver']}, torch "
          f"{head['versions']['torch']} (CUDA {head['versions']['cuda']}), DeepSpeed {head['versions']['deepspeed']}; "
          f"parts {','.join(args.part_list)}", flush=True)

    def save(parts: dict[str, Any], final: bool = False) -> dict[str, Any]:
        done = final and all(p in parts for p in args.part_list)
        doc = {**head, "status": "ok" if done and all(p["status"] == "ok" for p in parts.values()) else "partial",
               "parts": parts, "wall_s": time.perf_counter() - t0,
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        validate_result(doc)
        with open(path + ".tmp", "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(path + ".tmp", path)
        return doc

    try:
        parts = run_parts(args, argv, save)
    finally:
        _clean_shm(args)
    doc = save(parts, final=True)
    for line in summary_lines(doc):
        print(line, flush=True)
    print(f"[gpu_check] wrote {path} ({doc['wall_s']:.0f} s)", flush=True)
    return 0 if doc["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
