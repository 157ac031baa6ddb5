"""Worker: train with differential checkpoints on, then restore the newest version in place (its base plus
the differentials after it, replayed) and check the result equals the live state it replaced, bit for bit.

    torchrun --nproc-per-node 2 tests/integration/workers/differential_equality.py CONFIG STEPS
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import deadpool_ext.deepspeed as dpx
from deadpool_ext.distributed import init_distributed
from deadpool_ext.training.data import ByteLMData
from deadpool_ext.training.models import build_gpt


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def main(argv: list[str]) -> int:
    config, steps = argv[0], int(argv[1])
    init_distributed()
    torch.manual_seed(0)
    model = build_gpt("tiny")
    engine, *_ = dpx.initialize(model=model, config=config, model_parameters=model.parameters())
    data = ByteLMData(seq_len=64, seed=0)
    micro = 0
    while engine.global_steps < steps:
        ids, labels = data.gpt_batch(micro * 8 + engine.global_rank * 4, 4)
        micro += 1
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
    mgr = engine.deadpool.snapshots
    mgr.wait_idle()
    adapter = engine.deadpool.adapter
    want = {name: t.detach().clone() for name, t in adapter.tensors()}
    want_params = [p.detach().clone() for p in engine.module.parameters()]
    want_meta = adapter.meta()
    probe = data.gpt_batch(10_000 + engine.global_rank * 4, 4)

    def probe_loss() -> float:  # a forward pass sees the gathered parameters, not just the partitions
        engine.eval()
        with torch.no_grad():
            out = engine(input_ids=probe[0], labels=probe[1]).loss.item()
        engine.train()
        return out

    want_loss = probe_loss()
    # Wreck the live state, so only a correct restore can bring it back.
    with torch.no_grad():
        for _, t in adapter.tensors():
            if t.is_floating_point():
                t.add_(1.0)
    version = mgr.restore_latest()
    stats = mgr.stats()
    assert version == steps, (version, steps)
    assert stats["replayed"] == steps % 4, stats
    got = dict(adapter.tensors())
    bad = [n for n, t in want.items() if not torch.equal(_bytes(got[n]), _bytes(t))]
    assert not bad, f"rank {engine.global_rank}: differs after replay: {bad}"
    for key in ("global_steps", "global_samples", "lr_scheduler", "param_groups"):
        assert adapter.meta()[key] == want_meta[key], key
    assert probe_loss() == want_loss, "forward pass differs after replay (stale gathered parameters?)"
    if adapter.zero_stage < 3:  # ZeRO-3 module parameters are gathered on use; the partitions were compared
        assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(engine.module.parameters(), want_params))
    # what the test reads: one JSON record per rank, after every check above passed
    print("RESULT " + json.dumps({"rank": engine.global_rank, "tensors_equal": len(want), "replayed": stats["replayed"],
                                  "base": steps - steps % 4, "diff_nbytes": stats["diff_nbytes"],
                                  "base_nbytes": stats["base_nbytes"]}), flush=True)
    engine.deadpool.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
