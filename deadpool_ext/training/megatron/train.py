"""The pretraining loop of ``scripts/pretrain_gpt_megatron.py``: Megatron-Core GPT with deadpool_ext on.

Same flags and metrics as ``scripts/pretrain_gpt.py`` (``--train-iters``, ``--model-size``, ``--seed``,
``--metrics-out``, ``--save``/``--save-interval``/``--load``) plus Megatron-LM's
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` / ``--global-batch-size``.
Deterministic: the model is drawn from ``--seed`` and batches are a pure function of (seed, sample index), so
two runs with one seed and layout write identical losses, and a run that lost a node mid-way writes the losses
of one that did not. After an elastic shrink or grow (``deadpool-run --no-spare-policy shrink``) the world has
another data-parallel size: the factory lays it out again with the global batch kept (more or fewer
micro-batches per rank), and the losses follow the uninterrupted run's up to the order of the reductions.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from ...config import ConfigError, DeadpoolConfig
from ...distributed import init_distributed
from ...integrations.base import ResilientLoop
from ...integrations.megatron import parallel
from ...integrations.megatron.layout import Layout, LayoutError, keep_global_batch
from ...integrations.megatron.runtime import MegatronRuntime
from ...logs import configure_logging
from ...rebuild.context import context
from ...recovery.timeline import write_refusal
from ..data import ByteLMData, seed_everything
from ..models import MODEL_SIZES
from .model import ModelSpec, build, count_parameters
from .step import forward_backward, global_mean_loss, microbatches

log = logging.getLogger("deadpool_ext")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Megatron-Core GPT pretraining with deadpool_ext")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=20, help="optimizer steps to train (total, across restarts)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=None,
                   help="micro-batches per iteration and DP rank (default: the pipeline-parallel size)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration, kept at every data-parallel size (Megatron-LM's flag; the "
                        "micro-batches per rank follow from it); default: micro x num-microbatches x dp at start")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="Megatron's DistributedOptimizer")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU)")
    p.add_argument("--metrics-out", default=None, help="JSON lines, one per completed step (global rank 0)")
    p.add_argument("--deadpool-config", default=None,
                   help='JSON file with a "deadpool" section (the keys of the DeepSpeed config section); '
                        "default: the extension on with default settings")
    p.add_argument("--save", default=None, help="directory for tier-3 bases (dist_checkpointing, torch_dist)")
    p.add_argument("--save-interval", type=int, default=0, help="write a base every K steps (0: never)")
    p.add_argument("--load", default=None, help="start from the latest base in this directory (any TP/PP layout)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def load_deadpool_config(path: str | None) -> DeadpoolConfig:
    if path is None:
        return DeadpoolConfig.from_dict({})
    with open(path) as fh:
        raw = json.load(fh)
    if not isinstance(raw, dict) or set(raw) - {"deadpool"}:
        extra = sorted(set(raw) - {"deadpool"}) if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"--deadpool-config {path}: expected {{\"deadpool\": {{...}}}}, found {extra}")
    return DeadpoolConfig.from_dict(raw.get("deadpool", {}))


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; a bad flag value or ``deadpool`` config ends the job with its one line."""
    try:
        return _run(argv)
    except ConfigError as exc:
        write_refusal(exc, exit_status=1)
        raise SystemExit(str(exc)) from None


def batch_flags(global_batch_size: int | None, num_microbatches: int | None, micro_batch_size: int,
                layout: Layout) -> tuple[int, int]:
    """(global batch, micro-batches per rank) from the batch flags at this layout; a ConfigError naming the flags
    when they cannot both hold (pure: unit-tested in tests/unit/test_megatron_layout.py)."""
    if global_batch_size is not None and num_microbatches is not None:
        raise ConfigError("--global-batch-size and --num-microbatches: give one of them (the micro-batches per "
                          "rank follow from the global batch)", key="--num-microbatches")
    num_micro = num_microbatches or layout.pp
    global_batch = global_batch_size or micro_batch_size * num_micro * layout.dp
    try:
        num_micro, _ = keep_global_batch(global_batch, micro_batch_size, num_micro, layout.dp, False)
    except LayoutError:
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
                          f"{micro_batch_size} x data-parallel size {layout.dp}", key="--global-batch-size") from None
    return global_batch, num_micro


def _run(argv: Sequence[str] | None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.save_interval and not args.save:
        raise SystemExit("--save-interval needs --save DIR")
    config = load_deadpool_config(args.deadpool_config)
    configure_logging(config.log_level)
    shims = parallel.apply_cpu_shims()
    init_distributed(timeout_s=config.hot_swap.collective_timeout_s)
    layout = Layout(world_size=dist.get_world_size(), tp=args.tensor_model_parallel_size,
                    pp=args.pipeline_model_parallel_size)
    global_batch, num_micro = batch_flags(args.global_batch_size, args.num_microbatches, args.micro_batch_size,
                                          layout)
    spec = ModelSpec(size=args.model_size, lr=args.lr, train_iters=args.train_iters, dropout=args.dropout,
                     micro_batch=args.micro_batch_size, num_microbatches=num_micro,
                     distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16)
    seed_everything(args.seed)
    data = ByteLMData(seq_len=spec.seq_len + 1, seed=args.seed)
    parallel.initialize(layout, args.seed)

    now = {"num_micro": num_micro}

    def factory() -> MegatronRuntime:
        # The current world: another data-parallel size after an elastic resize (tp and pp stay; the runtime
        # refused a resize that breaks this rule or the global batch before anything was built).
        here = Layout(world_size=dist.get_world_size(), tp=layout.tp, pp=layout.pp)
        n, batch = keep_global_batch(global_batch, spec.micro_batch, now["num_micro"], here.dp,
                                     config.elastic.allow_batch_change)
        now["num_micro"] = n
        built = build(dataclasses.replace(spec, num_microbatches=n), args.seed)
        rt = MegatronRuntime(built, config, here, seed=args.seed,  # its coordinates: the rank it holds
                             global_batch=batch, micro_batch=spec.micro_batch,
                             tier3="--save" if args.save else "--load" if args.load else None)

        def client_set(state: dict[str, Any]) -> None:
            if state.get("corpus", data.fingerprint) != data.fingerprint:
                raise RuntimeError(f"snapshot was taken on corpus {state['corpus']}, this run reads {data.fingerprint}")

        rt.set_client_state(lambda: {"corpus": data.fingerprint}, client_set)
        rt.set_rebuild(factory)
        return rt

    rt = factory()
    rank = dist.get_rank()
    start = rt.resume()
    assert rt.built is not None  # a runtime is closed only by the hot-swap that replaces it
    if args.load and start == 0:
        from ...integrations.megatron.checkpoint import load_base

        loaded = load_base(args.load, rt.built.chunks, rt.built.optimizer, rt.built.scheduler, rt.progress)
        if loaded is None:
            raise SystemExit(f"--load {args.load}: no base found there")
        start = loaded
    if rank == 0:
        print(f"[pretrain_gpt_megatron] {args.model_size}: {count_parameters(rt.built.chunks)/1e6:.2f}M params on "
              f"rank 0, tp={layout.tp} pp={layout.pp} dp={layout.dp}, micro={spec.micro_batch} x {num_micro}, "
              f"steps {start}->{args.train_iters}, corpus {data.fingerprint}, shims {shims or 'none'}", flush=True)
    metrics = open(args.metrics_out, "a") if rank == 0 and args.metrics_out else None
    step_times: list[float] = []
    loss = float("nan")
    for c in rt.built.chunks:
        c.train()

    def one_iteration(rt: MegatronRuntime) -> tuple[float, float | None, float]:
        t0 = time.perf_counter()
        assert rt.built is not None
        batches = microbatches(data, rt.progress.consumed_samples, spec.micro_batch, rt.num_micro, rt.layout.dp,
                               rt.coords.dp)
        with rt.stoppable():
            losses = forward_backward(rt.built.chunks, rt.built.optimizer, batches, spec.seq_len, spec.micro_batch)
        # Reduced before the optimizer step (as Megatron-LM averages losses in the forward pass): a peer stuck in
        # the step's hooks then cannot keep rank 0 from logging the step it completed (chaos --bed, stuck).
        loss = global_mean_loss(losses, rt.num_micro)
        _, grad_norm = rt.step()
        if args.save and args.save_interval and rt.progress.iteration % args.save_interval == 0:
            from ...integrations.megatron.checkpoint import save_base

            save_base(args.save, rt.built.chunks, rt.built.optimizer, rt.built.scheduler, rt.progress, rt.layout,
                      keep_last=config.persist.keep_last)
        return loss, grad_norm, time.perf_counter() - t0

    def after_swap(new: MegatronRuntime) -> None:
        # Hot-swap (deadpool-run): a peer died mid-iteration; parallel state was rebuilt in-process and the
        # newest version every rank holds restored. The iteration is redone.
        assert new.built is not None
        for c in new.built.chunks:
            c.train()

    loop = ResilientLoop(rt, runtime=lambda r: r, done=lambda r: r.progress.iteration >= args.train_iters,
                         step=one_iteration, after_swap=after_swap)
    for rt, (loss, grad_norm, dt) in loop:
        step_times.append(dt)
        step = rt.progress.iteration
        if metrics is not None:
            assert rt.built is not None
            metrics.write(json.dumps({"step": step, "loss": loss, "step_time_s": dt, "time": time.time(),
                                      "lr": rt.built.optimizer.param_groups[0]["lr"],
                                      "samples": rt.progress.consumed_samples, "grad_norm": grad_norm}) + "\n")
            metrics.flush()
        if rank == 0 and (step % args.log_interval == 0 or step == args.train_iters):
            print(f"[pretrain_gpt_megatron] step {step}/{args.train_iters} loss {loss:.4f} ({dt*1000:.0f} ms)",
                  flush=True)
    rt, swaps = loop.handle, loop.swaps
    summary = {"objective": "gpt", "framework": "megatron-core", "model_size": args.model_size,
               "world_size": rt.layout.world_size, "tp": rt.layout.tp, "pp": rt.layout.pp, "dp": rt.layout.dp,
               "steps_run": len(step_times), "final_step": rt.progress.iteration, "final_loss": loss,
               "median_step_time_s": float(np.median(step_times)) if step_times else None, "hot_swaps": swaps,
               "deadpool": rt.stats()}
    rt.close()
    if metrics is not None:
        metrics.close()
    if rank == 0:
        print(f"[pretrain_gpt_megatron] summary {json.dumps(summary)}", flush=True)
    dist.barrier()
    current = context().membership
    if current is not None:
        current.mark_done()
    return summary
