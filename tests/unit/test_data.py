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


def test_the_two_gpt_implementations_have_the_same_parameter_sizes_and_the_same_interface():
    import pytest
    import torch

    hf, plain = build_gpt("tiny"), build_gpt("tiny", impl="torch")
    # The same tensors up to orientation (Hugging Face's Conv1D stores a linear layer's weight transposed).
    assert sorted(sorted(p.shape) for p in hf.parameters()) == sorted(sorted(p.shape) for p in plain.parameters())
    assert count_parameters(hf) == count_parameters(plain)
    assert plain.lm_head.weight is plain.wte.weight  # the output projection is tied, as in GPT-2
    ids = torch.randint(0, 256, (2, 16))
    out = plain(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 260) and out.loss.dim() == 0 and torch.isfinite(out.loss)
    # The loss is next-token cross-entropy: labels shifted by one, -100 ignored.
    masked = ids.clone()
    masked[:, :8] = -100
    plain.eval()
    want = torch.nn.functional.cross_entropy(plain(input_ids=ids).logits[:, 7:-1].reshape(-1, 260),
                                             ids[:, 8:].reshape(-1))
    assert torch.allclose(plain(input_ids=ids, labels=masked).loss, want)
    with pytest.raises(ValueError, match="--gpt-impl 'jax' is not one of"):
        build_gpt("tiny", impl="jax")
