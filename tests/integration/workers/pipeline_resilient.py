"""The 2-stage ``PipelineModule`` job of ``ds_wrappers_pipeline.py`` (fp32, same layers and batches) in a
``ResilientLoop`` of ``engine.train_batch()``, for a hot-swap under deadpool-run
(``tests/integration/test_code_config_fast_paths.py``)::

    deadpool-run --nnodes 2 --nproc-per-node 1 --spare-nodes 1 \
        tests/integration/workers/pipeline_resilient.py CONFIG ITERS OUT [--rebuild]

``CONFIG``: a DeepSpeed config file, or its JSON text (a dict built in code: nothing names a file before the
start). ``--rebuild``: the engine is built by a factory the runtime rebuilds with after a failure
(``hot_swap.in_place: false``), passed DeepSpeed's way, ``args.deepspeed_config``, with the same ``args`` each
time. The last stage writes ``{"step", "loss"}`` JSON lines to ``OUT`` (a step redone after a swap is written
again).
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_wrappers_pipeline import HIDDEN, LAYERS, Cast, batches, loss_fn  # noqa: E402


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("iters", type=int)
    p.add_argument("out")
    p.add_argument("--rebuild", action="store_true")
    opts = p.parse_args(argv)
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deadpool_ext import ResilientLoop

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule's topology asks deepspeed.comm
    if opts.config.lstrip().startswith("{"):
        cfg = json.loads(opts.config)
    else:
        with open(opts.config) as fh:
            cfg = json.load(fh)
    args = argparse.Namespace(deepspeed_config=cfg, local_rank=-1)

    def build():
        torch.manual_seed(0)
        layers = [LayerSpec(Cast, torch.float32)]
        for _ in range(LAYERS):
            layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN), LayerSpec(torch.nn.Tanh)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
        engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=list(model.parameters()))
        if opts.rebuild:
            engine.deadpool.set_rebuild(build)
        return engine

    engine = build()
    engine.deadpool.resume()
    gas = engine.gradient_accumulation_steps()
    out = open(opts.out, "a") if engine.is_last_stage() else None
    loop = ResilientLoop(engine, runtime=lambda e: e.deadpool, done=lambda e: e.global_steps >= opts.iters,
                         step=lambda e: e.train_batch(iter(batches(e.global_steps + 1, gas))))
    for e, loss in loop:
        if out is not None:
            out.write(json.dumps({"step": int(e.global_steps), "loss": float(loss)}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
