"""Worker: train N steps, rebuild model + optimizer in-process and restore the in-memory snapshot of step K
(every rank from its own tier-1 slot, same world), train on; prints the losses as JSON on rank 0.

    torchrun --nproc-per-node 4 tests/integration/workers/megatron_restore.py --tp 1 --pp 2 --restore-at 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch.distributed as dist  # noqa: E402

from deadpool_ext.config import DeadpoolConfig  # noqa: E402
from deadpool_ext.distributed import init_distributed  # noqa: E402
from deadpool_ext.integrations.megatron import parallel  # noqa: E402
from deadpool_ext.integrations.megatron.layout import Layout, coordinates  # noqa: E402
from deadpool_ext.integrations.megatron.runtime import MegatronRuntime  # noqa: E402
from deadpool_ext.training.data import ByteLMData  # noqa: E402
from deadpool_ext.training.megatron.model import ModelSpec, build  # noqa: E402
from deadpool_ext.training.megatron.step import forward_backward, global_mean_loss, microbatches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--restore-at", type=int, default=0, help="0: never")
    p.add_argument("--shm-root", default="/dev/shm")
    p.add_argument("--differential", type=int, default=0, help="base interval K of differential mode (0: off)")
    a = p.parse_args()
    parallel.apply_cpu_shims()
    init_distributed()
    layout = Layout(world_size=dist.get_world_size(), tp=a.tp, pp=a.pp)
    spec = ModelSpec(size="tiny", train_iters=a.iters, num_microbatches=a.pp)
    section = {"local": {"shm_root": a.shm_root}, "replication": {"factor": 0}}
    if a.differential:
        section["differential"] = {"enabled": True, "base_interval": a.differential}
    cfg = DeadpoolConfig.from_dict(section)
    data = ByteLMData(seq_len=spec.seq_len + 1, seed=1234)
    gb = spec.micro_batch * spec.num_microbatches * layout.dp

    def factory() -> MegatronRuntime:
        parallel.initialize(layout, 1234)
        return MegatronRuntime(build(spec, 1234), cfg, layout, coordinates(dist.get_rank(), layout), seed=1234,
                               global_batch=gb, micro_batch=spec.micro_batch)

    rt = factory()
    rt.resume()
    losses: dict[int, float] = {}
    restored = False
    while rt.progress.iteration < a.iters:
        b = microbatches(data, rt.progress.consumed_samples, spec.micro_batch, spec.num_microbatches, layout.dp,
                         rt.coords.dp)
        out = forward_backward(rt.built.chunks, rt.built.optimizer, b, spec.seq_len, spec.micro_batch)
        rt.step()
        losses[rt.progress.iteration] = global_mean_loss(out, spec.num_microbatches)
        if a.restore_at and not restored and rt.progress.iteration == a.restore_at + 2:
            rt.stats()  # let the newest snapshot finish
            rt.close()
            rt = factory()
            version = rt.resume()
            assert version == a.restore_at + 2, version
            if a.differential:
                replayed = rt.snapshots.stats().get("replayed")
                print("REPLAYED " + json.dumps({"rank": dist.get_rank(), "replayed": replayed}), flush=True)
            restored = True
    if dist.get_rank() == 0:
        print("LOSSES " + json.dumps(losses), flush=True)
    rt.close()
    dist.barrier()


if __name__ == "__main__":
    main()
