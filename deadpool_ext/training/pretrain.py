"""The pretraining loop shared by ``scripts/pretrain_gpt.py`` and ``scripts/pretrain_bert.py``.

Deterministic by construction: model init from ``--seed``, batches a pure function of (seed, sample index),
data position = DeepSpeed's ``global_samples`` (restored with every snapshot or checkpoint), so a resumed run
sees exactly the batches and random numbers of an uninterrupted one.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..config import ConfigError, split_deepspeed_config
from ..distributed import init_distributed
from ..integrations.base import ResilientLoop
from ..recovery.timeline import write_refusal
from .data import ByteLMData, seed_everything
from .models import (
    GPT_IMPL_ENV,
    GPT_IMPLS,
    MODEL_SIZES,
    build_bert,
    build_gpt,
    count_parameters,
    default_gpt_impl,
    seq_len_for,
)

log = logging.getLogger("deadpool_ext")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="DeepSpeed JSON config; a \"deadpool\" section in it turns the extension on")
    p.add_argument("--train-iters", type=int, default=20, help="optimizer steps to train (total, across restarts)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="tiny for tests, small (~25M) and medium (~125M) for benchmarks")
    p.add_argument("--gpt-impl", choices=GPT_IMPLS, default=None,
                   help=f"GPT only: hf (Hugging Face's GPT2LMHeadModel) or torch (the same architecture in plain "
                        f"PyTorch, no transformers import: seconds less start-up per process); default "
                        f"${GPT_IMPL_ENV} or hf")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dropout", type=float, default=None, metavar="P",
                   help="GPT only: dropout probability (default: the model's own, 0.1); 0 makes a run at another "
                        "data-parallel size (an elastic shrink) follow the same loss trajectory up to reduction order")
    p.add_argument("--metrics-out", default=None, help="JSON lines, one per completed step (global rank 0)")
    p.add_argument("--save", default=None, metavar="URL",
                   help="tier 3: where base checkpoints are persisted in the background (a path or an fsspec URL "
                        "such as s3://bucket/run); overrides deadpool.persist.url")
    p.add_argument("--save-interval", type=int, default=None, metavar="K",
                   help="persist a base every K steps (0: never); overrides deadpool.persist.interval")
    p.add_argument("--load", default=None, metavar="URL",
                   help="resume from the newest base there that every rank verifies (tier 3), falling back to "
                        "older ones; a plain DeepSpeed checkpoint directory also works")
    p.add_argument("--log-interval", type=int, default=10, help="print progress every N steps")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _with_persist_flags(args: argparse.Namespace) -> str | dict[str, Any]:
    """The DeepSpeed config with ``--save``/``--save-interval`` written into ``deadpool.persist`` (the flags
    override the file). Without a ``deadpool`` section the file is used as is and tier 3 runs standalone."""
    if args.save is None and args.save_interval is None:
        return args.deepspeed_config
    with open(args.deepspeed_config) as fh:
        cfg = json.load(fh)
    section = cfg.get("deadpool")
    if isinstance(section, dict) and section.get("enabled", True):
        persist = dict(section.get("persist") or {})
        if args.save is not None:
            persist["url"] = args.save
        if args.save_interval is not None:
            persist["interval"] = args.save_interval
        cfg["deadpool"] = {**section, "persist": persist}
    return cfg


def run(argv: Sequence[str] | None, objective: str) -> dict[str, Any]:
    """Train; a bad ``deadpool`` config (or a key that differs across ranks) ends the job with its one line."""
    try:
        return _run(argv, objective)
    except ConfigError as exc:
        write_refusal(exc, exit_status=1)
        raise SystemExit(str(exc)) from None


def _run(argv: Sequence[str] | None, objective: str) -> dict[str, Any]:
    description = {"gpt": "GPT-2 causal LM pretraining", "bert": "BERT masked-LM pretraining"}[objective]
    args = build_parser(description).parse_args(argv)
    if args.save_interval and not args.save:
        raise SystemExit("--save-interval needs --save URL")
    if args.save_interval is not None and args.save_interval < 0:
        raise SystemExit("--save-interval must be >= 0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if args.gpt_impl is not None and objective != "gpt":
        raise SystemExit("--gpt-impl applies to the GPT script only")
    if args.gpt_impl is None:
        try:
            args.gpt_impl = default_gpt_impl() if objective == "gpt" else "hf"
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    # Imports before init_distributed(): a spare under deadpool-run waits inside it, so DeepSpeed and
    # transformers (when the model is Hugging Face's) are already loaded when it is assigned (seconds off the
    # hot-swap critical path).
    import deepspeed  # noqa: F401

    if objective != "gpt" or args.gpt_impl == "hf":
        import transformers  # noqa: F401

    from .. import deepspeed as dpx
    from ..integrations.deepspeed.warmup import import_lazy_modules

    # What deepspeed.initialize would import on first use, then everything imported so far frozen out of the
    # cyclic GC (ZeRO-3 runs gc.collect() while building an engine; module-level objects never die anyway):
    # the first engine of a spare, and every rebuilt one, is built seconds sooner.
    import_lazy_modules()
    gc.freeze()
    # The first model is built before the process group: a spare builds it while it waits for an assignment
    # instead of after (same seed, same random numbers consumed, so the same model as before on every rank).
    seed_everything(args.seed)
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise SystemExit(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.dropout is not None and objective != "gpt":
        raise SystemExit("--dropout applies to the GPT script only")

    def build_model(size: str, init: bool = True) -> Any:
        if objective == "gpt":
            return build_gpt(size, init=init, dropout=args.dropout, impl=args.gpt_impl)
        return build_bert(size, init=init)

    prebuilt = [build_model(args.model_size)]
    ds_config = _with_persist_flags(args)
    # The collective timeout of the first generation is the section's (hot_swap.collective_timeout_s).
    _, section = split_deepspeed_config(ds_config)
    init_distributed(timeout_s=section.hot_swap.collective_timeout_s if section is not None else None,
                     in_place=section is not None and section.enabled and section.hot_swap.in_place)
    import torch.distributed as dist

    from ..snapshot.rng_json import gather_rng_states
    from ..snapshot.state import restore_rng

    data = ByteLMData(seq_len=seq_len_for(args.model_size), seed=args.seed)
    n_params = 0

    def rng_client_state() -> dict[str, Any]:
        # Collective: every rank's RNG goes into the base, so a resume at another rank count still finds its own.
        # JSON over tensors, not all_gather_object (which unpickles what peers send); exact round trip.
        return {"deadpool_rng": gather_rng_states()}

    def attach_tier3(eng: Any) -> None:
        from ..integrations.deepspeed.tier3 import Tier3Persister, persister_of

        if persister_of(eng) is None and args.save:
            # No deadpool section (or it is disabled): tier 3 on its own, driven from this loop.
            from ..config import PersistConfig

            eng.deadpool_tier3 = Tier3Persister(eng, PersistConfig(url=args.save, interval=args.save_interval or 0))
        p = persister_of(eng)
        if p is not None:
            p.set_client_state(rng_client_state)

    def build_engine():
        nonlocal n_params
        from ..rebuild.recover import weights_will_be_restored

        # A hot-swap rebuild whose state is restored from memory next skips the random init (its result would be
        # overwritten at once); the first model is initialised from --seed as always.
        model = prebuilt.pop() if prebuilt else build_model(args.model_size, init=not weights_will_be_restored())
        n_params = count_parameters(model)
        eng, _, _, _ = dpx.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        if eng.deadpool is not None:
            def client_get() -> dict[str, Any]:
                return {"corpus": data.fingerprint}

            def client_set(state: dict[str, Any]) -> None:
                if state.get("corpus", data.fingerprint) != data.fingerprint:
                    raise RuntimeError(f"snapshot was taken on corpus {state['corpus']}, "
                                       f"this run reads {data.fingerprint}")

            eng.deadpool.set_client_state(client_get, client_set)
            eng.deadpool.set_rebuild(build_engine)
        attach_tier3(eng)
        return eng

    engine = build_engine()
    rank = engine.global_rank

    start = 0
    loaded_step: int | None = None  # the step of the checkpoint --load loaded (a tier-3 base or a DeepSpeed checkpoint)
    if args.load:
        from ..integrations.deepspeed.resume import NoVerifiedBaseError, resume_from_tier3

        client: Any  # the checkpoint's client state; None when there was nothing to load
        try:
            version, client = resume_from_tier3(engine, args.load)
        except NoVerifiedBaseError as exc:
            raise SystemExit(str(exc)) from None
        path: str | None = f"{args.load} (tier-3 base {version})"
        if version is None:  # not written by tier 3: a plain DeepSpeed checkpoint directory
            has_latest = os.path.exists(os.path.join(args.load, "latest"))
            path, client = engine.load_checkpoint(args.load) if has_latest else (None, None)
        if path is None:
            if args.load != args.save and "://" not in args.load and not os.path.isdir(args.load):
                raise SystemExit(f"--load {args.load}: no such directory and no checkpoint found there")
            # Megatron-LM semantics: relaunching with --load = --save before the first base exists starts
            # from scratch (memory tiers may still hold a newer state: tried next).
            if rank == 0:
                log.warning("--load %s: no complete base there yet; starting from step 0", args.load)
        else:
            rngs = client.get("deadpool_rng", {})
            if str(rank) in rngs or "rng" in client:
                restore_rng(rngs[str(rank)] if str(rank) in rngs else client["rng"])
            log.info("resumed from checkpoint %s at step %d", path, int(engine.global_steps))
            loaded_step = int(engine.global_steps)
        start = int(engine.global_steps)
    if engine.deadpool is not None:
        # Across tiers: the memory tiers are used only for a version newer than the tier-3 base just loaded
        # (all ranks agree on both); if they cannot rebuild one, the tier-3 base stands (logged).
        start = max(start, engine.deadpool.resume(newer_than=start if args.load else None))

    def layout(engine: Any) -> tuple[int, int, int, int, int]:
        dp = engine.dp_world_size
        return (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), dp,
                dist.get_rank(group=engine.data_parallel_group) if dp > 1 else 0, engine.global_rank)

    micro, gas, dp, dp_rank, rank = layout(engine)
    metrics = None
    step_times: list[float] = []
    loss_value = float("nan")
    if rank == 0:
        print(f"[pretrain_{objective}] {args.model_size}: {n_params/1e6:.2f}M params, dp={dp}, micro={micro}, "
              f"gas={gas}, "
              f"steps {start}->{args.train_iters}, corpus {data.fingerprint}", flush=True)
    engine.train()

    def one_step(engine: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        base = int(engine.global_samples)
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            first = base + (m * dp + dp_rank) * micro
            ids, labels = data.gpt_batch(first, micro) if objective == "gpt" else data.bert_batch(first, micro)
            loss = engine(input_ids=ids.to(engine.device), labels=labels.to(engine.device)).loss
            engine.backward(loss)
            total += loss.detach().to("cpu", torch.float64)
            if m == gas - 1 and dp > 1:
                # Reduced before the optimizer step: a peer lost during this collective fails the step
                # before it is taken (and snapshotted), so every step a restore can resume after also
                # has its metrics line.
                dist.all_reduce(total, group=engine.data_parallel_group)
            engine.step()
        return float(total.item() / (gas * dp)), time.perf_counter() - t0

    def after_swap(new: Any) -> None:
        # Hot-swap (deadpool-run): a peer died mid-step; the world was rebuilt in-process and the newest
        # version every rank holds restored. The step is redone on the new engine.
        nonlocal micro, gas, dp, dp_rank, rank
        new.train()
        micro, gas, dp, dp_rank, rank = layout(new)

    loop = ResilientLoop(engine, runtime=lambda e: e.deadpool, done=lambda e: int(e.global_steps) >= args.train_iters,
                         step=one_step, after_swap=after_swap)
    for engine, (loss_value, dt) in loop:
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
        if getattr(engine, "deadpool_tier3", None) is not None:
            engine.deadpool_tier3.after_step()  # with a deadpool section the runtime's step hook does this
    engine = loop.handle
    swaps = loop.swaps
    summary = {
        "objective": objective, "model_size": args.model_size, "params": n_params, "world_size": dist.get_world_size(),
        "steps_run": len(step_times), "final_step": int(engine.global_steps), "final_loss": loss_value,
        "median_step_time_s": float(np.median(step_times)) if step_times else None, "hot_swaps": swaps,
        "loaded_step": loaded_step, "start_step": start,
    }
    from ..integrations.deepspeed.tier3 import persister_of

    tier3 = persister_of(engine)
    if tier3 is not None:
        tier3.close()  # publishes the base in flight (bounded by persist.timeout_s)
        summary["tier3"] = tier3.stats()
    if engine.deadpool is not None:
        summary["deadpool"] = engine.deadpool.stats()
        engine.deadpool.close()
    if metrics is not None:
        metrics.close()
    if rank == 0:
        print(f"[pretrain_{objective}] summary {json.dumps(summary)}", flush=True)
    dist.barrier()
    from ..rebuild.context import context

    current = context().membership
    if current is not None:
        current.mark_done()
    return summary
