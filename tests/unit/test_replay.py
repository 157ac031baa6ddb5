"""Differential replay reproduces torch's Adam/AdamW bit for bit, naive and fused alike."""
import pytest
import torch

from deadpool_ext.recovery.replay import AdamHyper, AdamTensors, StepDiff, replay_fused, replay_naive


def _train(opt_cls, kwargs, params, grads_per_step, fused=False):
    """Run the real torch optimizer; return the recorded differentials and the final state."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls([{"params": ps[:1], **kwargs}, {"params": ps[1:], **{**kwargs, "lr": kwargs["lr"] * 0.5}}],
                  **({"fused": True} if fused else {"foreach": False}))
    diffs = []
    for grads in grads_per_step:
        for g in opt.param_groups:  # a schedule: lr changes every step, as a scheduler does
            g["lr"] = g["lr"] * 0.9
        hypers = []
        for g in opt.param_groups:
            for _ in g["params"]:
                hypers.append(AdamHyper(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                                        weight_decay=g["weight_decay"], decoupled=opt_cls is torch.optim.AdamW,
                                        amsgrad=g["amsgrad"], maximize=g["maximize"]))
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
        diffs.append(StepDiff(grads=[gr.clone() for gr in grads], hypers=hypers))
    return opt, ps, diffs


def _state(opt, ps):
    return [AdamTensors(param=p.detach().clone(), exp_avg=opt.state[p]["exp_avg"].clone(),
                        exp_avg_sq=opt.state[p]["exp_avg_sq"].clone(), step=opt.state[p]["step"].clone(),
                        max_exp_avg_sq=opt.state[p]["max_exp_avg_sq"].clone() if "max_exp_avg_sq" in opt.state[p]
                        else None) for p in ps]


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 3e-3, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True, "betas": (0.8, 0.95)}),
    (torch.optim.AdamW, {"lr": 1e-3, "maximize": True, "eps": 1e-6}),
])
@pytest.mark.parametrize("replay", [replay_naive, replay_fused])
@pytest.mark.parametrize("kernel", ["single_tensor", "fused"])
def test_replay_equals_the_optimizer_bit_for_bit(opt_cls, kwargs, replay, kernel):
    """Both Adam kernels torch offers on CPU (the single-tensor default and ``fused=True``)."""
    torch.manual_seed(0)
    params = [torch.randn(70001), torch.randn(33, 65)]
    warm = [[torch.randn_like(p) for p in params] for _ in range(3)]
    later = [[torch.randn_like(p) * (k + 1) for p in params] for k in range(5)]
    opt, ps, _ = _train(opt_cls, kwargs, params, warm, fused=kernel == "fused")
    base = _state(opt, ps)  # the base checkpoint, after 3 steps
    # Continue the same optimizer 5 more steps (the run we must reproduce), recording differentials.
    diffs = []
    for grads in later:
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.9
        hypers = [AdamHyper(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                            weight_decay=g["weight_decay"], decoupled=opt_cls is torch.optim.AdamW,
                            amsgrad=g["amsgrad"], maximize=g["maximize"], fused=bool(g["fused"]))
                  for g in opt.param_groups for _ in g["params"]]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
        diffs.append(StepDiff(grads=grads, hypers=hypers))
    want = _state(opt, ps)
    replay(base, diffs) if replay is replay_naive else replay(base, diffs, chunk_elems=4096, batch_chunks=3,
                                                                            kernel_batch_elems=5000)
    for b, w in zip(base, want):
        assert torch.equal(b.param, w.param)
        assert torch.equal(b.exp_avg, w.exp_avg)
        assert torch.equal(b.exp_avg_sq, w.exp_avg_sq)
        assert torch.equal(b.step, w.step)
        if w.max_exp_avg_sq is not None:
            assert torch.equal(b.max_exp_avg_sq, w.max_exp_avg_sq)


def test_replay_rejects_a_differential_of_another_layout():
    s = [AdamTensors(param=torch.zeros(4), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4), step=torch.tensor(0.))]
    bad = StepDiff(grads=[torch.zeros(5)], hypers=[AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)])
    with pytest.raises(ValueError, match="does not match the master"):
        replay_fused(s, [bad])
    with pytest.raises(ValueError, match="covers 2 tensors"):
        replay_naive(s, [StepDiff(grads=[torch.zeros(4)] * 2, hypers=bad.hypers * 2)])


def test_hyper_json_round_trip():
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, fused=True)
    assert AdamHyper.from_json(h.to_json()) == h
    old = {k: v for k, v in h.to_json().items() if k != "fused"}  # written before the field existed
    assert AdamHyper.from_json(old).fused is False


def test_a_chain_may_not_switch_kernels():
    s = [AdamTensors(param=torch.zeros(4), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4), step=torch.tensor(0.))]
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    diffs = [StepDiff(grads=[torch.ones(4)], hypers=[h]),
             StepDiff(grads=[torch.ones(4)], hypers=[AdamHyper(**{**h.to_json(), "fused": True})])]
    with pytest.raises(ValueError, match="switched between the fused and the single-tensor"):
        replay_fused(s, diffs)
