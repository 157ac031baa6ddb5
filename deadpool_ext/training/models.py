"""Model builders for the pretraining scripts: Hugging Face GPT-2 and BERT architectures, randomly initialised.

Sizes: ``tiny`` for tests (seconds on a laptop CPU), ``small`` (~25M parameters) and ``medium`` (~125M) for
benchmarks. Vocabulary is the byte-level one of :mod:`deadpool_ext.training.data`.
"""
from __future__ import annotations

import contextlib

import torch

from .data import PAD_ID, VOCAB_SIZE

# (layers, hidden, heads, seq_len)
MODEL_SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 64, 2, 64),
    "small": (6, 576, 9, 256),
    "medium": (12, 928, 16, 512),
}


def _check_size(size: str) -> tuple[int, int, int, int]:
    if size not in MODEL_SIZES:
        raise ValueError(f"--model-size {size!r} is not one of {sorted(MODEL_SIZES)}")
    return MODEL_SIZES[size]


def seq_len_for(size: str) -> int:
    return _check_size(size)[3]


def _weights_init(init: bool):
    """``init=False``: skip random initialisation (the weights are about to be overwritten by a restore);
    transformers' own context for that (transformers >= 5), else a plain init."""
    if init:
        return contextlib.nullcontext()
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _tied(model: torch.nn.Module, init: bool) -> torch.nn.Module:
    # transformers ties the output embedding to the input one inside init_weights, which no_init_weights
    # skips: without this the model would have one more parameter than the model it restores into.
    if not init:
        model.tie_weights()  # type: ignore[operator]  # a transformers model: torch types its attributes as Tensor
    return model


def build_gpt(size: str, init: bool = True, dropout: float | None = None) -> torch.nn.Module:
    """``dropout``: residual, embedding and attention dropout (None: GPT-2's 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, hidden, heads, seq = _check_size(size)
    cfg = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
        bos_token_id=0, eos_token_id=0, pad_token_id=PAD_ID,
    )
    if dropout is not None:
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = dropout
    with _weights_init(init):
        model = GPT2LMHeadModel(cfg)
    return _tied(model, init)


def build_bert(size: str, init: bool = True) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    layers, hidden, heads, seq = _check_size(size)
    cfg = BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=seq, pad_token_id=PAD_ID,
    )
    with _weights_init(init):
        model = BertForMaskedLM(cfg)
    return _tied(model, init)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
