"""A DeepSpeed pipeline-parallel job (``PipelineModule``, 2 stages) with the extension attached, for
``tests/integration/test_ds_wrappers.py``: bf16 or fp32 as the config says (DeepSpeed builds a ``BF16_Optimizer``
for a bf16 pipeline), activation checkpointing on every layer, gradient clipping.

    torchrun --nproc-per-node 2 tests/integration/workers/ds_wrappers_pipeline.py CONFIG ITERS OUT \
        [--save-at N --save-dir D] [--load-dir D --load-tag T]

Batches are a pure function of (step, micro-batch), so a resumed run sees what an uninterrupted one would. Rank 0
(the first stage) and the last stage write nothing but ``OUT``: JSON lines ``{"step", "loss"}`` from the last
stage (the one that computes the loss), after a save ``{"saved": [file names in the tag directory]}``, after a
load ``{"rank", "loads": [[file name, how the checkpoint engine checked it], ...]}``.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HIDDEN, LAYERS, MICRO = 16, 4, 2


class Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def batches(step: int, gas: int):
    for m in range(gas):
        g = torch.Generator().manual_seed(1000 * step + m)
        x = torch.randn(MICRO, HIDDEN, generator=g)
        yield x, x.flip(1) * 0.5  # a target a small MLP can learn


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("iters", type=int)
    p.add_argument("out")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-dir", default="")
    p.add_argument("--load-dir", default="")
    p.add_argument("--load-tag", default=None)
    args = p.parse_args(argv)
    from deepspeed.pipe import LayerSpec, PipelineModule

    import deadpool_ext.deepspeed as dpx
    from deadpool_ext.distributed import init_distributed

    init_distributed()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule's topology asks deepspeed.comm, before initialize
    with open(args.config) as fh:
        cfg = json.load(fh)
    torch.manual_seed(0)
    layers = [LayerSpec(Cast, torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32)]
    for _ in range(LAYERS):
        layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN), LayerSpec(torch.nn.Tanh)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                           activation_checkpoint_interval=1)
    engine, *_ = dpx.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad])
    assert type(engine).__name__ == "PipelineEngine", type(engine)
    gas = engine.gradient_accumulation_steps()
    start = engine.deadpool.resume() if engine.deadpool is not None else 0
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        assert path is not None, f"nothing loaded from {args.load_dir}"
        start = int(engine.global_steps)
    out = open(args.out, "a") if engine.is_last_stage() or engine.global_rank == 0 else None
    if out is not None and args.load_dir:  # how the checkpoint engine checked each file this rank loaded
        loads = [(os.path.basename(p), how) for p, how in engine.checkpoint_engine.loads]
        out.write(json.dumps({"rank": engine.global_rank, "loads": loads}) + "\n")
        out.flush()
    if out is not None and engine.global_rank == 0:
        out.write(json.dumps({"start": start, "optimizer": type(engine.optimizer).__name__}) + "\n")
        out.flush()
    for step in range(start + 1, args.iters + 1):
        loss = engine.train_batch(iter(batches(step, gas)))
        if engine.is_last_stage() and out is not None:
            out.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
            out.flush()
        if step == args.save_at:
            engine.save_checkpoint(args.save_dir, tag=f"global_step{step}")
            torch.distributed.barrier()
            if engine.global_rank == 0 and out is not None:
                names = sorted(os.listdir(os.path.join(args.save_dir, f"global_step{step}")))
                out.write(json.dumps({"saved": names}) + "\n")
                out.flush()
    if engine.deadpool is not None:
        engine.deadpool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
