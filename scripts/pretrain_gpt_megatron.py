"""GPT pretraining on Megatron-Core (local layer spec, no Transformer Engine) with deadpool_ext on.

Launch (CPU, 4 ranks as 2 nodes + 1 spare node, tensor parallel 2, data parallel 2)::

    deadpool-run --nnodes 2 --nproc-per-node 2 --spare-nodes 1 scripts/pretrain_gpt_megatron.py \
        --tensor-model-parallel-size 2 --train-iters 30 --model-size tiny --metrics-out m.jsonl

or ``torchrun --nproc-per-node 4 scripts/pretrain_gpt_megatron.py --pipeline-model-parallel-size 2 ...``.
The extension is on by default; ``--deadpool-config FILE`` (``{"deadpool": {...}}``) configures it.
On a machine without CUDA the Megatron-Core CPU shims of ``patches/`` are applied explicitly at start-up.
"""
from __future__ import annotations

import os
import sys

# The repository root, for the patches/ package (deadpool_ext itself is installed).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_ext.training.megatron.train import run  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    return run(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
