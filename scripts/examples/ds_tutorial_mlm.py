"""A masked-LM pretraining loop written the way DeepSpeed's tutorials write one: its own shuffled ``DataLoader`` and
masking collator, the DeepSpeed config built in code, and DeepSpeed's own resume (``load_checkpoint`` /
``save_checkpoint`` with the step in ``client_state``). No line of deadpool_ext: the ``"deadpool"`` section in the
config dict is what protects it (``--deadpool-section`` adds one here; in your script it is a literal)::

    torchrun --nproc-per-node 2 --max-restarts 1 -m deadpool_ext.run scripts/examples/ds_tutorial_mlm.py \
        --save-dir ckpt --steps 12 --deadpool-section '{"snapshot": {"interval": 1}}'                  # restart
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/ds_tutorial_mlm.py \
        --save-dir ckpt --steps 12 --deadpool-section '{"snapshot": {"interval": 1}}'                  # hot-swap

Without the section it is plain DeepSpeed (``torchrun --nproc-per-node 2 scripts/examples/ds_tutorial_mlm.py``).
On CPU set ``DS_ACCELERATOR=cpu``. Rank 0 writes one JSON line per optimizer step to ``--metrics-out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import deepspeed
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import BertConfig, BertForMaskedLM

SEQ = 32
MASK_ID, VOCAB = 1, 256


class ByteChunks(Dataset):
    """Fixed chunks of ``SEQ`` bytes of CPython's own sources (offline, the same on every rank)."""

    def __init__(self, n: int = 512) -> None:
        import sysconfig

        with open(sysconfig.get_paths()["stdlib"] + "/argparse.py", "rb") as fh:
            data = fh.read()
        n = min(n, len(data) // SEQ)
        self.ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def mask_tokens(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """BERT's masking, drawn from the global RNG like transformers' DataCollatorForLanguageModeling."""
    ids = torch.stack(batch)
    labels = ids.clone()
    chosen = torch.bernoulli(torch.full(ids.shape, 0.15)).bool()
    labels[~chosen] = -100
    ids = ids.masked_fill(chosen, MASK_ID)
    return {"input_ids": ids, "labels": labels}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to train")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--sampler", choices=("random", "distributed"), default="random",
                   help="random: shuffle=True (the global RNG); distributed: DistributedSampler with set_epoch")
    p.add_argument("--dataset-size", type=int, default=512)
    p.add_argument("--save-dir", default="checkpoints")
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--no-load", action="store_true", help="never load a checkpoint (a script that resumes nothing)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--deadpool-section", default=None, help="JSON of a \"deadpool\" section to add to the config")
    args = p.parse_args(argv)

    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10 ** 6,
    }
    if args.deadpool_section:
        ds_config["deadpool"] = json.loads(args.deadpool_section)
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=128, max_position_embeddings=SEQ))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    data = ByteChunks(args.dataset_size)
    sampler = (DistributedSampler(data, shuffle=True, seed=args.seed) if args.sampler == "distributed" else None)
    loader = DataLoader(data, batch_size=args.micro_batch, shuffle=sampler is None, sampler=sampler,
                        collate_fn=mask_tokens, drop_last=True)

    _, client_sd = engine.load_checkpoint(args.save_dir) if not args.no_load else (None, None)
    step = client_sd["step"] if client_sd else 0
    rank = torch.distributed.get_rank()
    metrics = open(args.metrics_out, "a") if args.metrics_out and rank == 0 else None
    if rank == 0:
        print(f"[ds_tutorial_mlm] starting at step {step}", flush=True)
    micro = step * args.gas
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.gas:
                continue
            step += 1
            if metrics is not None:
                metrics.write(json.dumps({"step": step, "loss": loss.item(),
                                          "global_steps": int(engine.global_steps), "time": time.time()}) + "\n")
                metrics.flush()
            if step % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir, client_state={"step": step})
            if step >= args.steps:
                break
        if step >= args.steps:
            break
    if rank == 0:
        print(f"[ds_tutorial_mlm] summary {json.dumps({'step': step, 'global_steps': int(engine.global_steps)})}",
              flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
