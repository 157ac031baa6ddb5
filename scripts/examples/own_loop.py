"""A hand-written DeepSpeed loop around a ``DataLoader`` with a ``DistributedSampler``: the README's lines, nothing
else of deadpool_ext. With a ``"deadpool"`` section in the DeepSpeed config it survives a lost worker:

    torchrun --nproc-per-node 2 --max-restarts 1 scripts/examples/own_loop.py \
        --deepspeed_config configs/gpt_tiny_zero3_cpu.json --steps 20 --metrics-out m.jsonl      # restart
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/own_loop.py \
        --deepspeed_config configs/gpt_tiny_zero3_cpu.json --steps 20 --metrics-out m.jsonl      # hot-swap

The lines that are deadpool_ext's are marked ``# deadpool``: ``dp.initialize`` attaches the extension (and builds
the process group on the attempt-prefixed store), ``resilient_steps`` restores the newest step every rank holds
in memory and hands out the loader's batches from the position an uninterrupted run would be at; under
deadpool-run a step that fails because a peer was lost is recovered in place and redone (``with step``).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import deadpool_ext as dp  # deadpool

SEQ = 32


class ByteChunks(Dataset):
    """Fixed chunks of ``SEQ`` bytes of CPython's own sources (offline, the same on every rank)."""

    def __init__(self, n: int = 4096) -> None:
        import sysconfig

        with open(sysconfig.get_paths()["stdlib"] + "/argparse.py", "rb") as fh:
            data = fh.read()
        n = min(n, len(data) // SEQ)
        self.ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused: LOCAL_RANK)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    engine, _, _, _ = dp.initialize(model=model, config=args.deepspeed_config,  # deadpool
                                    model_parameters=model.parameters())
    data = ByteChunks()
    sampler = DistributedSampler(data, num_replicas=engine.dp_world_size, rank=engine.global_rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler, drop_last=True)
    metrics = open(args.metrics_out, "a") if args.metrics_out and engine.global_rank == 0 else None
    steps = dp.resilient_steps(engine, loader, max_steps=args.steps)  # deadpool: restore, data position, hot-swap
    for step in steps:
        with step as batch:  # deadpool
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary and metrics is not None:  # an optimizer step completed (after gradient accumulation)
                metrics.write(json.dumps({"step": int(engine.global_steps), "loss": float(loss.item())}) + "\n")
                metrics.flush()
    start = steps.start_step
    if engine.global_rank == 0:
        stats = engine.deadpool.stats() if engine.deadpool is not None else None
        print(f"[own_loop] summary {json.dumps({'start_step': start, 'swaps': steps.swaps, 'deadpool': stats})}",
              flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
