"""An unmodified Hugging Face ``Trainer`` job (GPT-2, DeepSpeed through Accelerate): no line of deadpool_ext in it.

Launched through the extension's runner, every engine whose DeepSpeed config has a ``"deadpool"`` section gets
the extension::

    torchrun --nproc-per-node 2 -m deadpool_ext.run scripts/examples/hf_trainer.py \
        --deepspeed configs/hf_trainer_zero3_cpu.json --max-steps 20 --metrics-out m.jsonl
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/hf_trainer.py --deepspeed ...
        (the same; a lost worker is replaced by the spare and the interrupted step redone, in place)

As standard scripts do, it writes ``train_results.json`` and ``trainer_state.json`` into ``--output-dir``: after
a recovery they hold what the uninterrupted run's hold (every step's log entry once, ``train_loss``; ``total_flos``
but for HF's ZeRO-3 count of a restarted engine's first step); ``train_runtime`` is the training time of the steps
that count (the failure's cost left out).

Plain ``torchrun scripts/examples/hf_trainer.py ...`` runs it without the extension (DeepSpeed drops the
section it does not know; ``deadpool check CONFIG`` says which launches honour it).
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import time

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

SEQ = 32
BATCH = 2
"""Micro-batch per rank (``per_device_train_batch_size``)."""


def model_config() -> GPT2Config:
    return GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


class ByteChunks(torch.utils.data.Dataset):
    def __init__(self, n: int = 2048) -> None:
        with open(sysconfig.get_paths()["stdlib"] + "/argparse.py", "rb") as fh:
            data = fh.read()
        n = min(n, len(data) // SEQ)
        self.ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    """Rank 0 writes {"step", "loss", other metrics of the entry, "total_flos" so far, "time", "step_time_s"} per
    logged step (JSON lines), and {"step": -1, "event": "train_begin", "time", "global_step"} when training begins
    (after a resumed checkpoint was loaded)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.last = 0.0

    def _write(self, rec: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
        self.last = time.time()
        if self.path and state.is_world_process_zero:
            self._write({"step": -1, "event": "train_begin", "time": self.last, "global_step": state.global_step,
                         "step_time_s": 0.0})

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 - the Trainer's signature
        if self.path and state.is_world_process_zero and logs and "loss" in logs:
            now = time.time()
            self._write({"step": state.global_step, **logs, "total_flos": state.total_flos, "time": now,
                         "step_time_s": now - self.last})
            self.last = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", required=True, help="DeepSpeed config JSON")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output-dir", default="/tmp/hf_trainer_out")
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--save-steps", type=int, default=0,
                   help="the Trainer's own checkpoint every N steps (0: none), what --resume continues from")
    p.add_argument("--resume", action="store_true", help="resume_from_checkpoint: the newest under --output-dir")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model with from_config, as standard Trainer scripts do: under ZeRO-3 inside "
                        "deepspeed.zero.Init (partitioned as it is built)")
    args = p.parse_args()
    targs = TrainingArguments(output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.max_steps,
                              per_device_train_batch_size=BATCH, gradient_accumulation_steps=args.grad_accum,
                              learning_rate=3e-4, logging_steps=1, report_to=[], seed=args.seed,
                              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                              data_seed=args.seed, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                              dataloader_num_workers=0)
    torch.manual_seed(args.seed)
    config = model_config()
    # (TrainingArguments first: with a ZeRO-3 config, from_config then builds the model inside zero.Init)
    model = AutoModelForCausalLM.from_config(config) if args.zero_init else GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=targs, train_dataset=ByteChunks(), callbacks=[Losses(args.metrics_out)])
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_metrics("train", result.metrics)  # train_results.json (train_loss, total_flos, train_runtime)
    trainer.save_state()  # trainer_state.json (log_history, global_step, epoch)
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        dp = getattr(engine, "deadpool", None)
        logged = [e["step"] for e in trainer.state.log_history if "loss" in e]
        summary = {"deadpool": dp.stats() if dp is not None else None, "global_step": trainer.state.global_step,
                   "logged_steps": logged}
        print(f"[hf_trainer] summary {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
