"""Megatron-Core GPT model, DDP wrapper, optimizer and LR schedule for the pretraining script.

Built from the local layer spec (no Transformer Engine). Sizes are those of ``deadpool_ext.training.models``
(tiny / small / medium), on the byte-level vocabulary padded to a fixed 320 entries, so every TP size divides
it and a checkpoint's shapes do not depend on the layout it was written with.

Call order: after ``parallel.initialize()``; ``build(spec)`` returns fresh model chunks, optimizer and
scheduler bound to the current parallel state (hot-swap calls it again on the new world).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...integrations.megatron.runtime import Built
from ..data import VOCAB_SIZE
from ..models import MODEL_SIZES

PADDED_VOCAB = 320
"""VOCAB_SIZE (260) rounded up to a multiple of 64: divisible by every TP size up to 64."""


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    size: str = "tiny"
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 2
    train_iters: int = 20
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    dropout: float = 0.0
    micro_batch: int = 4
    num_microbatches: int = 1
    distributed_optimizer: bool = False
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.size not in MODEL_SIZES:
            raise ValueError(f"--model-size {self.size!r} is not one of {sorted(MODEL_SIZES)}")
        assert VOCAB_SIZE <= PADDED_VOCAB

    @property
    def seq_len(self) -> int:
        return MODEL_SIZES[self.size][3]


def transformer_config(spec: ModelSpec) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers, hidden, heads, _ = MODEL_SIZES[spec.size]
    pp = ps.get_pipeline_model_parallel_world_size()
    if layers % pp:
        raise ValueError(f"--model-size {spec.size} has {layers} layers, not divisible by pipeline-parallel size {pp}")
    tp = ps.get_tensor_model_parallel_world_size()
    if heads % tp:
        raise ValueError(f"--model-size {spec.size} has {heads} attention heads, not divisible by tensor-parallel "
                         f"size {tp}")
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        hidden_dropout=spec.dropout, attention_dropout=spec.dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=spec.bf16,
        # Weights drawn on the CPU from the full (unsharded) matrix and then split: the same model for every
        # TP layout and seed, and no dependency on a device RNG.
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
    )


def build(spec: ModelSpec, seed: int) -> Built:
    """Fresh GPT model chunks (DDP-wrapped), Megatron optimizer and LR scheduler on the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # Same initial weights on every run and after every rebuild (a rebuilt model is overwritten by the
    # restore anyway, but a fresh start must not depend on what the process did before).
    torch.manual_seed(seed)
    config = transformer_config(spec)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB,
        max_sequence_length=spec.seq_len, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=spec.distributed_optimizer,
                                               check_for_nan_in_grad=False, bucket_size=None)
    chunk = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=spec.lr, min_lr=spec.min_lr, weight_decay=spec.weight_decay,
                                 clip_grad=spec.clip_grad, bf16=spec.bf16, params_dtype=config.params_dtype,
                                 use_distributed_optimizer=spec.distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, [chunk])
    global_batch = spec.micro_batch * spec.num_microbatches * ps.get_data_parallel_world_size()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=spec.lr, min_lr=spec.min_lr,
        lr_warmup_steps=spec.warmup_steps * global_batch, lr_decay_steps=max(spec.train_iters, 1) * global_batch,
        lr_decay_style="cosine", start_wd=spec.weight_decay, end_wd=spec.weight_decay,
        wd_incr_steps=max(spec.train_iters, 1) * global_batch, wd_incr_style="constant")
    # Hooks the schedules call: gradient all-reduce across DP (and embedding/PP sync) after the last
    # micro-batch, and no_sync for the ones before it.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunk.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return Built(chunks=[chunk], optimizer=optimizer, scheduler=scheduler, config=config)


def count_parameters(chunks: list[Any]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())
