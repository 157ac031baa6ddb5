"""The 2-stage ``PipelineModule`` job of ``ds_wrappers_pipeline.py`` (fp32, same layers and batches) in a
``ResilientLoop`` of ``engine.train_batch()``, for a hot-swap under deadpool-run
(``tests/integration/test_code_config_fast_paths.py``)::

    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 \
        tests/integration/workers/pipeline_resilient.py CONFIG ITERS OUT

The last stage writes ``{"step", "loss"}`` JSON lines to ``OUT`` (a step redone after a swap is written again).
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_wrappers_pipeline import HIDDEN, LAYERS, Cast, batches, loss_fn  # noqa: E402


def main(argv: list[str]) -> int:
    config, iters, out_path = argv[0], int(argv[1]), argv[2]
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deadpool_ext import ResilientLoop

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule's topology asks deepspeed.comm
    with open(config) as fh:
        cfg = json.load(fh)
    torch.manual_seed(0)
    layers = [LayerSpec(Cast, torch.float32)]
    for _ in range(LAYERS):
        layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN), LayerSpec(torch.nn.Tanh)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    engine.deadpool.resume()
    gas = engine.gradient_accumulation_steps()
    out = open(out_path, "a") if engine.is_last_stage() else None
    loop = ResilientLoop(engine, runtime=lambda e: e.deadpool, done=lambda e: e.global_steps >= iters,
                         step=lambda e: e.train_batch(iter(batches(e.global_steps + 1, gas))))
    for e, loss in loop:
        if out is not None:
            out.write(json.dumps({"step": int(e.global_steps), "loss": float(loss)}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
