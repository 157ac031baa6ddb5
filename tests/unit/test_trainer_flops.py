"""The HF Trainer's FLOP estimate under ZeRO-3 (``patches/transformers_trainer_flops.py``): a real GPT-2 partitioned
by a real ZeRO-3 engine counts its whole model at every call, whatever DeepSpeed has gathered at that moment."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deadpool_ext import patches
from tests.conftest import one_rank_gloo_world

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_count(model) -> int:
    """HF's own count on an unpartitioned copy: the number the patched estimate must use in every process."""
    return model.num_parameters(exclude_embeddings=True)


@pytest.fixture
def flops_patch():
    p = patches.get("transformers_trainer_flops")
    p.apply()
    try:
        yield p
    finally:
        p.revert()


def test_zero3_estimate_counts_the_whole_model_whatever_is_gathered(flops_patch):
    import deepspeed
    from transformers.trainer import Trainer

    whole = _hf_count(_gpt2())
    model = _gpt2()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    with one_rank_gloo_world():
        deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        partitioned = [p for p in model.parameters() if p.numel() == 0]
        assert partitioned, "ZeRO-3 left every parameter whole: nothing under test"
        trainer = SimpleNamespace(model=model)
        inputs = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
        assert model.num_parameters(exclude_embeddings=True) < whole  # HF's count: only what is gathered now
        assert Trainer.floating_point_ops(trainer, inputs) == 6 * 16 * whole
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # everything gathered: the same number
            assert Trainer.floating_point_ops(trainer, inputs) == 6 * 16 * whole


def test_unpartitioned_model_keeps_hfs_own_estimate(flops_patch):
    from transformers.trainer import Trainer

    model = _gpt2()
    inputs = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    assert Trainer.floating_point_ops(SimpleNamespace(model=model), inputs) == 6 * 4 * _hf_count(model)
    assert not hasattr(model, "_deadpool_whole_parameter_count")  # nothing cached for a model HF counts right
    assert Trainer.floating_point_ops(SimpleNamespace(model=torch.nn.Linear(2, 2)), inputs) == 0  # HF's: no count


def test_revert_restores_hfs_method():
    from transformers.trainer import Trainer

    before = Trainer.floating_point_ops
    p = patches.get("transformers_trainer_flops")
    p.apply()
    assert Trainer.floating_point_ops is not before
    p.revert()
    assert Trainer.floating_point_ops is before
