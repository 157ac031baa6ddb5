"""A pipeline-parallel job written the way DeepSpeed's pipeline tutorial writes one: a ``PipelineModule`` of
``LayerSpec`` s, the dataset handed to ``deepspeed.initialize(training_data=...)`` (DeepSpeed's own loader, which the
pipeline engine wraps in a ``RepeatingLoader``), ``engine.train_batch()`` in a plain loop, the config built in code,
and DeepSpeed's own resume (``load_checkpoint`` / ``save_checkpoint`` with the step in ``client_state``). No line of
deadpool_ext: the ``"deadpool"`` section in the config dict protects it (``--deadpool-section`` adds one here)::

    torchrun --nproc-per-node 2 --max-restarts 1 -m deadpool_ext.run scripts/examples/ds_tutorial_pipe.py \
        --save-dir ckpt --steps 12 --deadpool-section '{"snapshot": {"interval": 1}}'                  # restart
    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 scripts/examples/ds_tutorial_pipe.py \
        --save-dir ckpt --steps 12 --deadpool-section '{"snapshot": {"interval": 1}}'                  # hot-swap

Two ranks are two pipeline stages. On CPU set ``DS_ACCELERATOR=cpu``. Rank 0 writes one JSON line per step to
``--metrics-out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 16, 4


def dataset(n: int, seed: int) -> TensorDataset:
    """A fixed classification set (the same on every rank): labels from a random linear map of the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (train_batch calls)")
    p.add_argument("--gas", type=int, default=2, help="micro-batches per step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dataset-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32, help="width of the hidden layers")
    p.add_argument("--save-dir", default="checkpoints")
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--seed", type=int, default=1138)
    p.add_argument("--metrics-out", default=None)
    p.add_argument("--deadpool-section", default=None, help="JSON of a \"deadpool\" section to add to the config")
    args = p.parse_args(argv)

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10 ** 6,
    }
    if args.deadpool_section:
        ds_config["deadpool"] = json.loads(args.deadpool_section)
    hidden = args.hidden
    layers = [LayerSpec(torch.nn.Linear, FEATURES, hidden), LayerSpec(torch.nn.ReLU),
              LayerSpec(torch.nn.Dropout, 0.1), LayerSpec(torch.nn.Linear, hidden, hidden), LayerSpec(torch.nn.ReLU),
              LayerSpec(torch.nn.Dropout, 0.1), LayerSpec(torch.nn.Linear, hidden, CLASSES)]
    net = PipelineModule(layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2,
                         partition_method="parameters", activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=[q for q in net.parameters()
                                                                                   if q.requires_grad],
                                           training_data=dataset(args.dataset_size, args.seed), config=ds_config)

    _, client_sd = engine.load_checkpoint(args.save_dir)
    step = client_sd["step"] if client_sd else 0
    rank = torch.distributed.get_rank()
    metrics = open(args.metrics_out, "a") if args.metrics_out and rank == 0 else None
    if rank == 0:
        print(f"[ds_tutorial_pipe] starting at step {step}", flush=True)
    while step < args.steps:
        loss = engine.train_batch()
        step += 1
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": loss.item(), "global_steps": int(engine.global_steps),
                                      "time": time.time()}) + "\n")
            metrics.flush()
        if step % args.save_interval == 0:
            engine.save_checkpoint(args.save_dir, client_state={"step": step})
    if rank == 0:
        print(f"[ds_tutorial_pipe] summary {json.dumps({'step': step, 'global_steps': int(engine.global_steps)})}",
              flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
