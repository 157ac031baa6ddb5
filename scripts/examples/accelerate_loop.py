"""An Accelerate loop with DeepSpeed (ZeRO-3 through ``DeepSpeedPlugin``); two lines of deadpool_ext in it
(marked ``# deadpool``), for the restore and the hot-swap; attaching needs none.

    torchrun --nproc-per-node 2 -m deadpool_ext.run scripts/examples/accelerate_loop.py \
        --deepspeed configs/gpt_tiny_zero3_cpu_noopt.json --steps 8 --metrics-out m.jsonl
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/accelerate_loop.py ...
    accelerate launch --config_file acc.yaml -m deadpool_ext.run scripts/examples/accelerate_loop.py --steps 8

Without ``--deepspeed`` the DeepSpeed config is Accelerate's own: its config YAML's ``deepspeed_config_file``,
``accelerate launch --deepspeed_config_file``, or ``ACCELERATE_DEEPSPEED_CONFIG_FILE``.

``accelerator.prepare`` calls ``deepspeed.initialize`` with the plugin's config; the runner's hook attaches the
extension when that config has a ``"deadpool"`` section. ``resilient_steps`` restores from memory after a restart
and puts Accelerate's loader where an uninterrupted run would be; under deadpool-run a step that fails because a
peer was lost is recovered in place and redone. Without the extension it is a plain loop over the loader.
"""
from __future__ import annotations

import argparse
import json
import sysconfig

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel

import deadpool_ext as dp  # deadpool

SEQ = 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", default=None,
                   help="DeepSpeed config JSON (no optimizer section); default: the one accelerate launch names")
    p.add_argument("--deepspeed-inline", default=None, metavar="JSON",
                   help="the DeepSpeed config as JSON text: the script builds the dict in code (no file named)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--plain-loop", action="store_true",
                   help="iterate the loader without resilient_steps (attached, but nothing restores: the extension "
                        "says so at the first snapshot)")
    args = p.parse_args()
    # (no cpu=True on a CPU machine: Accelerate then leaves DeepSpeed out; the device is chosen by itself)
    ds_config = json.loads(args.deepspeed_inline) if args.deepspeed_inline else args.deepspeed
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config) if ds_config else None)
    torch.manual_seed(args.seed)
    with open(sysconfig.get_paths()["stdlib"] + "/argparse.py", "rb") as fh:
        data = fh.read()
    n = len(data) // SEQ
    ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)
    loader = torch.utils.data.DataLoader(ids, batch_size=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def train(batch: torch.Tensor) -> None:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.metrics_out and model.global_rank == 0:
            with open(args.metrics_out, "a") as fh:
                fh.write(json.dumps({"step": int(model.global_steps), "loss": float(loss.item())}) + "\n")

    if args.plain_loop:
        for _, batch in zip(range(args.steps), loader):
            train(batch)
        start_step, swaps = 0, 0
    else:
        steps = dp.resilient_steps(model, loader, max_steps=args.steps)  # deadpool: restore, data position, hot-swap
        for step in steps:
            with step as batch:  # deadpool
                train(batch)
        start_step, swaps = steps.start_step, steps.swaps
    # (rank 0 of the engine: on a CPU machine Accelerate runs DeepSpeed without its own distributed state, so every
    # process is its "main process")
    if model.global_rank == 0:
        rt = getattr(model, "deadpool", None)
        summary = {"start_step": start_step, "swaps": swaps, "deadpool": rt.stats() if rt else None}
        print(f"[accelerate_loop] summary {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
