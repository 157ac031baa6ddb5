import torch

from deadpool_ext.training.data import MASK_ID, ByteLMData
from deadpool_ext.training.models import build_gpt, count_parameters


def test_batches_are_a_function_of_sample_index():
    a = ByteLMData(seq_len=32, seed=3)
    b = ByteLMData(seq_len=32, seed=3)
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.gpt_batch(100, 4)[0], b.gpt_batch(100, 4)[0])
    assert not torch.equal(a.gpt_batch(100, 4)[0], a.gpt_batch(104, 4)[0])
    assert not torch.equal(a.gpt_batch(0, 4)[0], ByteLMData(seq_len=32, seed=4).gpt_batch(0, 4)[0])


def test_bert_masking():
    ids, labels = ByteLMData(seq_len=64, seed=1).bert_batch(0, 8)
    masked = ids == MASK_ID
    assert masked.any() and torch.all(labels[~masked] == -100) and torch.all(labels[masked] >= 0)


def test_model_sizes():
    assert count_parameters(build_gpt("tiny")) < 1_000_000
    small = count_parameters(build_gpt("small"))
    assert 20e6 < small < 30e6
