"""What a hot-swap rebuild's engine build does with the initial weights, on a real 2-rank gloo world (torchrun).

argv: modes (comma-separated, run in this order in one process group), output directory (each rank writes
<mode>.rank<r>.json there). Modes:
  agree_yes   both ranks are spares that joined generation 1: every_rank_restores() is True on both
  agree_no    rank 0 a joined spare, rank 1 a survivor without a committed snapshot: False on both
  synced      ZeRO-3 engine built the usual way from rank-dependent weights: rank 0's values everywhere
  unsynced    the same under patches/deepspeed_unsynced_init: each rank keeps its own values, no broadcast

Used by tests/integration/test_unsynced_init.py."""
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    modes, out_dir = sys.argv[1].split(","), sys.argv[2]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    # Leave the group while the interpreter is whole: a process exiting while gloo's threads still release a
    # collective's tensors aborts ("terminate called without an active exception", pytorch/pytorch#179291).
    from deadpool_ext.distributed import destroy_groups_at_exit
    destroy_groups_at_exit()
    for mode in modes:
        run(mode, out_dir)


def run(mode: str, out_dir: str) -> None:
    import deepspeed

    from deadpool_ext import patches
    from deadpool_ext.patches.deepspeed_unsynced_init import unsynced_weights
    from deadpool_ext.rebuild import recover

    rank = dist.get_rank()
    out: dict = {"rank": rank, "mode": mode}
    if mode.startswith("agree"):
        # What a hot-swap rebuild's membership says (generation 1; rank 0 a spare that took a node's place):
        # only the agreement is under test here, not the launcher.
        from types import SimpleNamespace

        from deadpool_ext.rebuild.context import context

        role = "spare" if (rank == 0 or mode == "agree_yes") else "active"
        ctx = context()
        before = ctx.membership
        ctx.membership = SimpleNamespace(generation=1, role=role)  # type: ignore[assignment]
        try:
            out["every_rank_restores"] = recover.every_rank_restores()
        finally:
            ctx.membership = before
        _write(out_dir, out)
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    from deadpool_ext.training.models import build_gpt, default_gpt_impl

    original = DeepSpeedEngine._broadcast_model
    torch.manual_seed(100 + rank)  # rank-dependent weights: a broadcast would make them rank 0's
    model = build_gpt("tiny", impl=default_gpt_impl())
    wte_param = next(p for n, p in model.named_parameters() if n.endswith("wte.weight"))
    wte = wte_param.detach().clone().reshape(-1)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3}}
    patches.get("deepspeed_zero3_quiet_init").apply()
    with unsynced_weights(mode == "unsynced") as skipped:
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    out["patch_reverted"] = (DeepSpeedEngine._broadcast_model is original
                             and not patches.get("deepspeed_unsynced_init").applied)
    out["skipped"] = skipped
    p = next(q for n, q in engine.module.named_parameters() if n.endswith("wte.weight"))
    part = p.ds_tensor.detach().reshape(-1)
    n = part.numel()
    own = wte[rank * n: rank * n + n]
    theirs = []
    for src in range(2):
        t = wte.clone()
        dist.broadcast(t, src)
        theirs.append(t[rank * n: rank * n + n])
    valid = min(n, max(0, wte.numel() - rank * n))  # the last partition is padded
    out["partition_is_own_slice"] = bool(torch.equal(part[:valid], own[:valid]))
    out["partition_is_rank0_slice"] = bool(torch.equal(part[:valid], theirs[0][:valid]))
    # The engine trains: one step runs (forward gathers, backward reduce-scatters, optimizer step).
    ids = torch.randint(0, 256, (1, 32))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out["step_loss_finite"] = bool(torch.isfinite(loss).item())
    _write(out_dir, out)


def _write(out_dir: str, out: dict) -> None:
    with open(os.path.join(out_dir, f"{out['mode']}.rank{out['rank']}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
