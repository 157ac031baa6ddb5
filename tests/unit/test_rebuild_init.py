"""A hot-swap rebuild whose state is restored next may skip the model's random init; nothing else may."""
import pytest
import torch

from deadpool_ext.rebuild.recover import build_for_restore, weights_will_be_restored
from deadpool_ext.training.models import build_gpt


def test_flag_is_set_only_inside_the_factory_and_reset_on_error():
    assert not weights_will_be_restored()
    assert build_for_restore(weights_will_be_restored, True) is True
    assert build_for_restore(weights_will_be_restored, False) is False
    assert not weights_will_be_restored()

    def boom():
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError):
        build_for_restore(boom, True)
    assert not weights_will_be_restored()


def test_uninitialised_model_has_the_same_layout_and_loads_a_state():
    torch.manual_seed(0)
    ref = build_gpt("tiny")
    empty = build_gpt("tiny", init=False)
    assert [(n, p.shape) for n, p in ref.named_parameters()] == [(n, p.shape) for n, p in empty.named_parameters()]
    empty.load_state_dict(ref.state_dict())
    ref.eval(), empty.eval()
    ids = torch.randint(0, 200, (2, 16))
    assert torch.equal(ref(input_ids=ids).logits, empty(input_ids=ids).logits)
