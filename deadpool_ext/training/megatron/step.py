"""One training iteration of the Megatron-Core GPT model: micro-batches through Megatron's schedule.

Batches follow the deterministic scheme of ``deadpool_ext.training``: sample ``i`` is a pure function of
(seed, i); iteration ``k`` consumes samples ``[k * G, (k + 1) * G)`` with ``G = micro x microbatches x dp``,
micro-batch ``m`` of data-parallel rank ``d`` taking ``first = k*G + (m*dp + d) * micro``. Every TP and PP
rank of one data-parallel replica reads the same micro-batches (the first stage uses the tokens, the last
the labels), so the data position is the single integer ``consumed_samples``.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..data import ByteLMData


def microbatches(data: ByteLMData, consumed: int, micro: int, num_micro: int, dp: int, dp_rank: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) of each micro-batch of this DP rank; data windows are seq_len + 1 tokens long."""
    out = []
    for m in range(num_micro):
        ids, _ = data.gpt_batch(consumed + (m * dp + dp_rank) * micro, micro)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    # A copy: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]], model: Any):
    tokens, labels = next(data_iterator)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand_as(tokens)
    # Causal mask built by the attention module (local spec, mask type causal): no mask tensor needed.
    output = model(tokens, position_ids, None, labels=labels)
    return output, _loss


def forward_backward(chunks: list[Any], optimizer: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     seq_len: int, micro: int) -> list[dict[str, torch.Tensor]]:
    """Zero the grads and run every micro-batch forward and backward; returns the last stage's losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in chunks:
        c.zero_grad_buffer()
    # As Megatron-LM's train_step: after an optimizer step ``param.grad`` aliases the DDP grad buffer, and
    # autograd would accumulate the next backward into it. That hidden state is not part of any snapshot, so
    # a restored run would differ from an uninterrupted one; dropping it makes every iteration start clean.
    optimizer.zero_grad()
    fwd_bwd = get_forward_backward_func()
    return fwd_bwd(forward_step_func=_forward_step, data_iterator=iter(batches), model=chunks,
                   num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=micro,
                   forward_only=False)


def global_mean_loss(losses: list[dict[str, torch.Tensor]], num_micro: int) -> float:
    """Mean loss over every micro-batch of every DP replica, known on every rank (used for metrics).

    Only the last pipeline stage has losses, and TP ranks of a stage hold the same value; one rank per
    replica contributes, in float64, and the world sums: the same order of additions on every run."""
    from megatron.core import parallel_state as ps

    contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    total = torch.zeros(1, dtype=torch.float64)
    if contributes:
        for d in losses:
            total += d["lm loss"].to(torch.float64)
    dist.all_reduce(total)
    return float(total.item() / (num_micro * ps.get_data_parallel_world_size()))
