"""GPT-2 (Hugging Face architecture) pretraining on DeepSpeed, with deadpool_ext when the config says so.

Launch (CPU, 4 ranks, ZeRO-3)::

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py \
        --deepspeed_config configs/gpt_tiny_zero3_cpu.json --train-iters 20 --metrics-out metrics.jsonl

or with DeepSpeed's launcher: ``deepspeed --num_gpus 4 scripts/pretrain_gpt.py --deepspeed_config ...``.
"""
from __future__ import annotations

import sys

from deadpool_ext.training.pretrain import run


def main(argv: list[str] | None = None) -> dict:
    return run(argv, "gpt")


if __name__ == "__main__":
    main(sys.argv[1:])
