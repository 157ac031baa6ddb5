"""An unmodified Lightning job (GPT-2, ``DeepSpeedStrategy`` ZeRO-3): no line of deadpool_ext in it.

Launched through the extension's runner, the engine Lightning's strategy builds from a DeepSpeed config with a
``"deadpool"`` section gets the extension::

    torchrun --nproc-per-node 2 --max-restarts 1 -m deadpool_ext.run scripts/examples/lightning_fit.py \
        --deepspeed configs/lightning_zero3_cpu.json --max-steps 20 --metrics-out m.jsonl
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/lightning_fit.py --deepspeed ...
        (the same; a lost worker is replaced by the spare and the interrupted step redone, in place)

On a machine without CUDA Lightning refuses its DeepSpeed strategy; the runner lets it run on DeepSpeed's CPU
accelerator (``patches/lightning_deepspeed_cpu.py``). Plain ``torchrun`` runs the script without the extension.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from transformers import GPT2Config, GPT2LMHeadModel

SEQ = 32


class ByteChunks(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        with open(sysconfig.get_paths()["stdlib"] + "/argparse.py", "rb") as fh:
            data = fh.read()
        n = min(n, len(data) // SEQ)
        self.ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class GPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                                bos_token_id=0, eos_token_id=0))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> None:
        return None  # the DeepSpeed config's optimizer and scheduler


class Losses(pl.Callback):
    """Rank 0 writes {"step", "loss", "epoch"} after each optimizer step (the loss of its last micro-batch)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.before = path, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # noqa: ANN001 - Lightning's hook
        self.before = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001 - Lightning's hook
        if trainer.global_step > self.before:  # this batch ended an optimizer step
            if self.path and trainer.is_global_zero:
                with open(self.path, "a") as fh:
                    fh.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"]),
                                         "epoch": trainer.current_epoch, "batch_idx": batch_idx}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", required=True, help="DeepSpeed config JSON")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048, help="dataset size (small: epochs end within the run)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", default=None)
    args = p.parse_args()
    pl.seed_everything(args.seed, workers=True)
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=local,
                         num_nodes=world // local, strategy=DeepSpeedStrategy(config=args.deepspeed),
                         max_steps=args.max_steps, accumulate_grad_batches=args.grad_accum, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Losses(args.metrics_out)])
    loader = torch.utils.data.DataLoader(ByteChunks(args.samples), batch_size=2, shuffle=True)
    trainer.fit(GPT(), loader)
    if trainer.is_global_zero:
        dp = getattr(trainer.strategy.model, "deadpool", None)
        summary = {"deadpool": dp.stats() if dp is not None else None, "global_step": trainer.global_step,
                   "epoch": trainer.current_epoch}
        print(f"[lightning_fit] summary {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
