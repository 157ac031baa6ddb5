"""The pretraining loop shared by ``scripts/pretrain_gpt.py`` and ``scripts/pretrain_bert.py``.

Deterministic by construction: model init from ``--seed``, batches a pure function of (seed, sample index),
data position = DeepSpeed's ``global_samples`` (restored with every snapshot or checkpoint), so a resumed run
sees exactly the batches and random numbers of an uninterrupted one.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from typing import Any, Sequence

import numpy as np
import torch

from ..distributed import init_distributed
from .data import ByteLMData
from .models import MODEL_SIZES, build_bert, build_gpt, count_parameters, seq_len_for

log = logging.getLogger("deadpool_ext")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="DeepSpeed JSON config; a \"deadpool\" section in it turns the extension on")
    p.add_argument("--train-iters", type=int, default=20, help="optimizer steps to train (total, across restarts)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="tiny for tests, small (~25M) and medium (~125M) for benchmarks")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", default=None, help="JSON lines, one per completed step (global rank 0)")
    p.add_argument("--save", default=None, help="directory for DeepSpeed checkpoints (engine.save_checkpoint)")
    p.add_argument("--save-interval", type=int, default=0, help="save a checkpoint every K steps (0: never)")
    p.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    p.add_argument("--log-interval", type=int, default=10, help="print progress every N steps")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(argv: Sequence[str] | None, objective: str) -> dict[str, Any]:
    description = {"gpt": "GPT-2 causal LM pretraining", "bert": "BERT masked-LM pretraining"}[objective]
    args = build_parser(description).parse_args(argv)
    if args.save_interval and not args.save:
        raise SystemExit("--save-interval needs --save DIR")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    init_distributed()
    import deepspeed

    from .. import deepspeed as dpx
    from ..snapshot.state import capture_rng, restore_rng

    import torch.distributed as dist

    seed_everything(args.seed)
    data = ByteLMData(seq_len=seq_len_for(args.model_size), seed=args.seed)
    n_params = 0

    def build_engine():
        nonlocal n_params
        model = build_gpt(args.model_size) if objective == "gpt" else build_bert(args.model_size)
        n_params = count_parameters(model)
        eng, _, _, _ = dpx.initialize(model=model, config=args.deepspeed_config, model_parameters=model.parameters())
        if eng.deadpool is not None:
            def client_get() -> dict[str, Any]:
                return {"corpus": data.fingerprint}

            def client_set(state: dict[str, Any]) -> None:
                if state.get("corpus", data.fingerprint) != data.fingerprint:
                    raise RuntimeError(f"snapshot was taken on corpus {state['corpus']}, this run reads {data.fingerprint}")

            eng.deadpool.set_client_state(client_get, client_set)
            eng.deadpool.set_rebuild(build_engine)
        return eng

    engine = build_engine()
    rank = engine.global_rank

    start = 0
    if args.load:
        path, client = engine.load_checkpoint(args.load)
        if path is None:
            raise SystemExit(f"--load {args.load}: no checkpoint found there")
        restore_rng(client["deadpool_rng"][str(rank)] if "deadpool_rng" in client else client["rng"])
        start = int(engine.global_steps)
        log.info("resumed from checkpoint %s at step %d", path, start)
    if engine.deadpool is not None:
        start = max(start, engine.deadpool.resume())

    def layout():
        dp = engine.dp_world_size
        return (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), dp,
                dist.get_rank(group=engine.data_parallel_group) if dp > 1 else 0, engine.global_rank)

    micro, gas, dp, dp_rank, rank = layout()
    metrics = None
    step_times: list[float] = []
    loss_value = float("nan")
    swaps = 0
    if rank == 0:
        print(f"[pretrain_{objective}] {args.model_size}: {n_params/1e6:.2f}M params, dp={dp}, micro={micro}, gas={gas}, "
              f"steps {start}->{args.train_iters}, corpus {data.fingerprint}", flush=True)
    engine.train()
    while int(engine.global_steps) < args.train_iters:
        t0 = time.perf_counter()
        try:
            base = int(engine.global_samples)
            total = torch.zeros(1, dtype=torch.float64)
            for m in range(gas):
                first = base + (m * dp + dp_rank) * micro
                ids, labels = data.gpt_batch(first, micro) if objective == "gpt" else data.bert_batch(first, micro)
                loss = engine(input_ids=ids.to(engine.device), labels=labels.to(engine.device)).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach().to("cpu", torch.float64)
            if dp > 1:
                dist.all_reduce(total, group=engine.data_parallel_group)
        except Exception as exc:
            # Hot-swap (deadpool-run): a peer died mid-step. Rebuild the world in-process and continue from the
            # newest version every rank holds; anything else is re-raised.
            if engine.deadpool is None or not engine.deadpool.can_recover(exc):
                raise
            engine = engine.deadpool.recover(exc)
            engine.train()
            micro, gas, dp, dp_rank, rank = layout()
            swaps += 1
            continue
        loss_value = float(total.item() / (gas * dp))
        dt = time.perf_counter() - t0
        step_times.append(dt)
        step = int(engine.global_steps)
        if rank == 0 and args.metrics_out:
            if metrics is None:
                metrics = open(args.metrics_out, "a")
            metrics.write(json.dumps({"step": step, "loss": loss_value, "step_time_s": dt, "time": time.time(),
                                      "lr": engine.get_lr()[0], "samples": int(engine.global_samples)}) + "\n")
            metrics.flush()
        if rank == 0 and (step % args.log_interval == 0 or step == args.train_iters):
            print(f"[pretrain_{objective}] step {step}/{args.train_iters} loss {loss_value:.4f} ({dt*1000:.0f} ms)",
                  flush=True)
        if args.save and args.save_interval and step % args.save_interval == 0:
            rng = [None] * dist.get_world_size()
            dist.all_gather_object(rng, capture_rng())
            engine.save_checkpoint(args.save, tag=f"global_step{step}",
                                   client_state={"deadpool_rng": {str(r): s for r, s in enumerate(rng)}})
    summary = {
        "objective": objective, "model_size": args.model_size, "params": n_params, "world_size": dist.get_world_size(),
        "steps_run": len(step_times), "final_step": int(engine.global_steps), "final_loss": loss_value,
        "median_step_time_s": float(np.median(step_times)) if step_times else None, "hot_swaps": swaps,
    }
    if engine.deadpool is not None:
        summary["deadpool"] = engine.deadpool.stats()
        engine.deadpool.close()
    if metrics is not None:
        metrics.close()
    if rank == 0:
        print("[pretrain_%s] summary %s" % (objective, json.dumps(summary)), flush=True)
    dist.barrier()
    from ..distributed import membership

    if membership() is not None:
        membership().mark_done()
    return summary
