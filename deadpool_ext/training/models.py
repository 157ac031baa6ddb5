"""Model builders for the pretraining scripts: Hugging Face GPT-2 and BERT architectures, randomly initialised.

Sizes: ``tiny`` for tests (seconds on a laptop CPU), ``small`` (~25M parameters) and ``medium`` (~125M) for
benchmarks. Vocabulary is the byte-level one of :mod:`deadpool_ext.training.data`.

GPT comes in two implementations of the same architecture (``--gpt-impl``): ``hf``, Hugging Face's
``GPT2LMHeadModel`` (the default, what the benchmarks measure), and ``torch``, :class:`TorchGPT` below, in plain
PyTorch. Their parameters have the same sizes (Hugging Face's Conv1D holds a linear weight transposed), but not
the same names or the same random initial values, so runs of one are compared with runs of the same one.
``torch`` exists for start-up cost: importing ``transformers``' GPT-2 modeling costs about 1.7 s of CPU per
process on a 2-core host (measured beside a 2-rank job's total of 12 s), paid by every worker, spare and
restarted rank; the test suite runs ``torch`` (``DEADPOOL_GPT_IMPL``, :data:`GPT_IMPL_ENV`, set by
``tests/conftest.py``) so that its several hundred short jobs do not pay it.
"""
from __future__ import annotations

import contextlib
import math
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

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


GPT_IMPLS = ("hf", "torch")
GPT_IMPL_ENV = "DEADPOOL_GPT_IMPL"
"""The default of ``--gpt-impl`` when set (``hf`` when not)."""


def default_gpt_impl() -> str:
    impl = os.environ.get(GPT_IMPL_ENV, "hf")
    if impl not in GPT_IMPLS:
        raise ValueError(f"{GPT_IMPL_ENV}={impl!r} is not one of {list(GPT_IMPLS)}")
    return impl


class _Block(torch.nn.Module):
    """GPT-2's pre-norm block: causal self-attention and a 4x GELU MLP, each added to the residual stream."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = torch.nn.LayerNorm(hidden)
        self.attn = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln_2 = torch.nn.LayerNorm(hidden)
        self.fc = torch.nn.Linear(hidden, 4 * hidden)
        self.fc_proj = torch.nn.Linear(4 * hidden, hidden)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh")))


class TorchGPT(torch.nn.Module):
    """GPT-2 in plain PyTorch (``--gpt-impl torch``): learned positions, pre-norm blocks, a final LayerNorm, the
    output projection tied to the token embedding. Called as the Hugging Face model is by the scripts:
    ``model(input_ids=..., labels=...)`` returns an object whose ``loss`` is the next-token cross-entropy
    (labels shifted by one inside, -100 ignored) and ``logits``."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB_SIZE, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.h = torch.nn.ModuleList(_Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's init: N(0, 0.02), residual projections scaled by depth
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_proj.weight")) else 0.02
                torch.nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def build_gpt(size: str, init: bool = True, dropout: float | None = None, impl: str = "hf") -> torch.nn.Module:
    """``dropout``: residual, embedding and attention dropout (None: GPT-2's 0.1). ``impl``: ``hf`` or ``torch``
    (module docstring). ``init=False`` skips the random initialisation where the implementation can (``hf``):
    the weights are about to be overwritten by a restore."""
    if impl not in GPT_IMPLS:
        raise ValueError(f"--gpt-impl {impl!r} is not one of {list(GPT_IMPLS)}")
    layers, hidden, heads, seq = _check_size(size)
    if impl == "torch":
        return TorchGPT(layers, hidden, heads, seq, 0.1 if dropout is None else dropout)
    from transformers import GPT2Config, GPT2LMHeadModel

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
