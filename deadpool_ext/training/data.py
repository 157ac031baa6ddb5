"""Offline, deterministic pretraining data: a byte-level tokenizer over text that ships with Python.

Why this corpus: the machines that run tests and CI have no route to a dataset hub, and a training job that
is meant to be bit-for-bit reproducible needs bytes that are identical on every rank. CPython's standard
library sources are real English-and-code text, are present wherever the interpreter is, and are read in a
sorted, fixed order. A fingerprint of the bytes is exposed so runs can log which corpus they saw.

Why the data position is a plain integer: batches are a pure function of (seed, global sample index), so
"samples consumed" is the whole data-loader state. A resumed run that restores that integer sees exactly the
batches an uninterrupted run would have seen, with no iterator state to serialise.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

# Byte-level vocabulary: 256 byte values plus special tokens used by the BERT objective.
BYTE_VOCAB = 256
PAD_ID = 256
MASK_ID = 257
CLS_ID = 258
SEP_ID = 259
VOCAB_SIZE = 260


@lru_cache(maxsize=4)
def load_corpus(max_bytes: int = 4 << 20) -> bytes:
    """Concatenate CPython standard-library sources (sorted paths) up to ``max_bytes``."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so os.walk's traversal order is fixed across machines and runs.
        dirnames[:] = sorted(d for d in dirnames if d not in {"site-packages", "__pycache__", "test", "tests"})
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            with open(os.path.join(dirpath, fname), "rb") as fh:
                data = fh.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if total < 1 << 16:
        raise RuntimeError(f"standard library under {root} yielded only {total} bytes of text; cannot build a corpus")
    return b"".join(chunks)


def corpus_fingerprint(corpus: bytes) -> str:
    return hashlib.sha256(corpus).hexdigest()[:16]


# No slots: the sampler caches the token tensor and fingerprint computed in __post_init__.
@dataclass(kw_only=True)
class ByteLMData:
    """Deterministic sampler of fixed-length windows from the corpus.

    ``batch(first_sample, count)`` returns the windows for global sample indices
    ``first_sample .. first_sample+count-1``; the window start of sample ``i`` depends only on ``(seed, i)``.
    """

    seq_len: int
    seed: int
    corpus_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        corpus = load_corpus(self.corpus_bytes)
        self._tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.long)
        self.fingerprint = corpus_fingerprint(corpus)
        if self._tokens.numel() <= self.seq_len + 1:
            raise ValueError(f"seq_len={self.seq_len} is longer than the corpus ({self._tokens.numel()} bytes)")

    def _starts(self, first_sample: int, count: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + first_sample)
        high = self._tokens.numel() - self.seq_len - 1
        return torch.randint(0, high, (count,), generator=gen)

    def gpt_batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) for causal LM; labels are the inputs (the model shifts them)."""
        idx = self._starts(first_sample, count)[:, None] + torch.arange(self.seq_len)[None, :]
        ids = self._tokens[idx]
        return ids, ids.clone()

    def bert_batch(self, first_sample: int, count: int, mask_prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) for masked LM: 15% of positions masked, labels -100 elsewhere."""
        ids, _ = self.gpt_batch(first_sample, count)
        ids = ids.clone()
        ids[:, 0] = CLS_ID
        gen = torch.Generator().manual_seed(self.seed * 7_919 + first_sample + 1)
        mask = torch.rand(ids.shape, generator=gen) < mask_prob
        mask[:, 0] = False
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        ids = torch.where(mask, torch.full_like(ids, MASK_ID), ids)
        return ids, labels


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch generators from one seed (model init draws from them)."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
