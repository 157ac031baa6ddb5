"""GradTap records exactly what the inner optimizer consumes: replaying it reproduces the optimizer; bf16
compression (opt-in) is lossy within the documented bound; unsupported optimizers are refused clearly."""
import pytest
import torch

from deadpool_ext.recovery.replay import AdamHyper, AdamTensors, StepDiff, replay_fused
from deadpool_ext.snapshot.differential import GradTap, replay_targets
from deadpool_ext.snapshot.state import UnsupportedEngineError


class _Adapter:
    zero_stage = 1

    def __init__(self, opt, params):
        self.opt, self.params = opt, params

    def inner_optimizer(self):
        return self.opt

    def masters(self):
        return self.params


def _run(compression: str, steps: int = 6, base_at: int = 2):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(10, 7))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    adapter = _Adapter(opt, params)
    tap = GradTap(adapter, compression)
    base, diffs = None, []
    for step in range(1, steps + 1):
        for p in params:
            p.grad = torch.randn_like(p) * step
        opt.step()
        grads, hypers = tap.take()
        if step == base_at:
            base = [AdamTensors(param=t.param.clone(), exp_avg=t.exp_avg.clone(), exp_avg_sq=t.exp_avg_sq.clone(),
                                step=t.step.clone()) for t in replay_targets(adapter)]
        elif step > base_at:
            diffs.append(StepDiff(grads=[grads[f"grad.{i}"].float() for i in range(len(params))],
                                  hypers=[AdamHyper.from_json(hypers[str(i)]) for i in range(len(params))]))
    tap.remove()
    return params, base, diffs, grads


def test_tapped_differentials_replay_to_the_live_state():
    params, base, diffs, grads = _run("none")
    assert all(g.dtype == torch.float32 for g in grads.values())
    replay_fused(base, diffs)
    for b, p in zip(base, params):
        assert torch.equal(b.param, p.detach())


def test_bf16_compression_is_lossy_within_bound():
    params, base, diffs, grads = _run("bf16")
    assert all(g.dtype == torch.bfloat16 for g in grads.values())  # half the bytes of fp32
    replay_fused(base, diffs)
    err = max((b.param - p.detach()).abs().max().item() for b, p in zip(base, params))
    # Each Adam step moves a parameter by about lr; the gradient rounding (2**-8 relative) perturbs the update
    # direction, so after 4 replayed steps the error stays well below one step's size.
    assert 0 < err < 1e-2 * 4 * 0.5, err


def test_unsupported_optimizers_are_refused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(UnsupportedEngineError, match="replay Adam/AdamW steps"):
        GradTap(_Adapter(torch.optim.SGD(p, lr=0.1), p))
    with pytest.raises(UnsupportedEngineError, match="single-tensor"):
        GradTap(_Adapter(torch.optim.Adam(p, lr=0.1, foreach=True), p))
