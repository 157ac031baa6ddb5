"""Swappable process groups under a real DeepSpeed ZeRO-3 engine on a 2-rank gloo world (torchrun).

argv: mode, output directory (rank 0 writes losses.json there). Modes:
  plain     torch's gloo groups (the reference)
  swap      swappable groups; after step 5 every group's communicator is replaced by one of a new generation
            (what an in-place hot-swap does, without a failure): training goes on with the same engine object
  solo      swappable groups; both ranks build their engine *solo* (each computes every set-up collective
            locally, as a spare does while the survivors keep their engines), then go live on a new generation,
            set the same initial weights into their partitions (what the restore from memory does with a snapshot)
            and train: the losses must equal the plain run's

Used by tests/integration/test_swap_groups.py."""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deadpool_ext.rebuild import swap

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world,
                         is_master=rank == 0, timeout=timedelta(seconds=60))
    if mode == "plain":
        dist.init_process_group("gloo", store=dist.PrefixStore("g0", base), rank=rank, world_size=world)
    else:
        swap.use()
        if mode == "solo":
            swap.set_mode("solo")
            dist.init_process_group(swap.BACKEND, store=swap.SoloStore(world), rank=rank, world_size=world)
        else:
            dist.init_process_group(swap.BACKEND, store=dist.PrefixStore("g0", base), rank=rank, world_size=world)
    from deadpool_ext.distributed import destroy_groups_at_exit

    destroy_groups_at_exit()  # what the extension's own start-up does (else gloo may abort at interpreter exit)
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    initial = [p.detach().clone() for p in model.parameters()]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {"groups_before": swap.describe(), "engine_id": id(engine)}
    if mode == "solo":
        swap.go_live(dist.PrefixStore("g1", base), 1, rank)
        # Both ranks restore the same initial weights into their own partitions (what the restore from memory
        # does with a snapshot): the solo rank's values before that are whatever its local set-up left.
        opt = engine.optimizer
        opt.checkpoint_event_prologue()
        with torch.no_grad():
            for p, w in zip(engine.module.parameters(), initial):
                n = p.ds_tensor.numel()
                flat = torch.nn.functional.pad(w.reshape(-1), (0, n * world - w.numel()))
                p.ds_tensor.copy_(flat[rank * n:(rank + 1) * n])
            for bit16, master in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                master.copy_(bit16)
        opt.checkpoint_event_epilogue()  # re-gathers the persistent (small, always gathered) parameters
    g = torch.Generator().manual_seed(1)
    losses = []
    detached_error = None
    for step in range(12):
        x = torch.randn(4, 16, generator=g)
        y = torch.randn(4, 4, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if mode == "swap" and step == 5:
            swap.detach("test")
            try:
                dist.all_reduce(torch.ones(1))
            except swap.GroupDetached as exc:
                detached_error = str(exc)
            out["swapped"] = swap.go_live(dist.PrefixStore("g1", base), 1, rank)
    out.update(losses=losses, detached_error=detached_error, groups_after=swap.describe() if mode != "plain" else [],
               engine_id_after=id(engine), backend=dist.get_backend())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
