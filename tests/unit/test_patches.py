"""patches/: explicit, idempotent, revertible, version-guarded."""
from __future__ import annotations

import sys

import pytest
import torch

from deadpool_ext import patches
from deadpool_ext.patches.base import Patch, PatchConflictError, UnsupportedVersionError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims refuse on a CUDA machine")


def _targets():
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    return {"current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize,
            "add": mrandom.CudaRNGStatesTracker.add, "fork": mrandom.CudaRNGStatesTracker.fork,
            "schedules.torch": schedules.torch, "clip": optimizer.clip_grad_by_total_norm_fp32,
            "clip_def": clip_grads.clip_grad_by_total_norm_fp32}


def test_importing_patches_changes_nothing():
    before = _targets()
    for name in patches.REGISTRY:
        patches.get(name)  # imports every patch module
    assert _targets() == before
    assert not any(patches.get(n).applied for n in patches.MEGATRON_CORE_CPU)


def test_apply_revert_idempotent():
    original = _targets()
    try:
        patches.apply_all(patches.MEGATRON_CORE_CPU)
        applied = _targets()
        assert all(applied[k] is not original[k] for k in original)
        patches.apply_all(patches.MEGATRON_CORE_CPU)  # second apply: no-op
        assert _targets() == applied
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"
        from megatron.core.pipeline_parallel import schedules

        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        assert schedules.torch.float32 is torch.float32  # everything else is the real torch
    finally:
        patches.revert_all(patches.MEGATRON_CORE_CPU)
    assert _targets() == original
    patches.revert_all(patches.MEGATRON_CORE_CPU)  # second revert: no-op
    assert _targets() == original


def test_rng_tracker_shim_forks_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    patches.get("megatron_core_cpu_rng").apply()
    try:
        t = CudaRNGStatesTracker()
        t.add("model-parallel-rng", 7)
        torch.manual_seed(1)
        outer = torch.get_rng_state()
        with t.fork():
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outer)  # the default stream is untouched
        assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(7)))
        with t.fork():
            b = torch.rand(3)
        assert not torch.equal(a, b)  # the forked stream advanced
    finally:
        patches.get("megatron_core_cpu_rng").revert()


def test_version_guard_refuses_unsupported_versions(monkeypatch):
    p = patches.get("megatron_core_cpu_device")
    monkeypatch.setattr(type(p), "requires", {"megatron-core": ">=99"})
    with pytest.raises(UnsupportedVersionError, match=r"supports megatron-core >=99, found 0\.16"):
        p.apply()
    assert not p.applied and torch.cuda.current_device is not None
    monkeypatch.setattr(type(p), "requires", {"no-such-distribution-xyz": ">=1"})
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        p.check()


def test_apply_all_is_all_or_nothing(monkeypatch):
    original = _targets()
    monkeypatch.setattr(type(patches.get("megatron_core_cpu_synchronize")), "requires", {"torch": "<1"})
    with pytest.raises(UnsupportedVersionError):
        patches.apply_all(patches.MEGATRON_CORE_CPU)
    assert _targets() == original


def test_revert_refuses_when_someone_else_patched_on_top():
    p = patches.get("megatron_core_cpu_synchronize")
    p.apply()
    ours = torch.cuda.synchronize
    try:
        torch.cuda.synchronize = lambda device=None: None
        with pytest.raises(PatchConflictError):
            p.revert()
    finally:
        torch.cuda.synchronize = ours
        p.revert()
    assert not p.applied


def test_unknown_patch_name():
    with pytest.raises(KeyError, match="known patches"):
        patches.get("nope")


def test_base_class_restores_on_failed_apply():
    class Broken(Patch):
        name = "broken"
        requires = {}

        def _apply(self) -> None:
            self._swap(torch, "tanh", lambda x: x)
            raise RuntimeError("boom")

    original = torch.tanh
    with pytest.raises(RuntimeError, match="boom"):
        Broken().apply()
    assert torch.tanh is original


def test_megatron_lm_flags():
    import argparse

    from deadpool_ext.config import DeadpoolConfig
    from deadpool_ext.patches.megatron_lm_hooks import add_deadpool_args, deadpool_section

    args = add_deadpool_args(argparse.ArgumentParser()).parse_args(
        ["--deadpool-snapshot-interval", "2", "--deadpool-replication-factor", "0"])
    cfg = DeadpoolConfig.from_dict(deadpool_section(args))
    assert cfg.snapshot.interval == 2 and cfg.replication.factor == 0 and cfg.enabled
    off = add_deadpool_args(argparse.ArgumentParser()).parse_args(["--deadpool-disable"])
    assert DeadpoolConfig.from_dict(deadpool_section(off)).enabled is False


def test_megatron_lm_hook_refuses_without_megatron_lm_and_wraps_train_step(monkeypatch):
    import types

    hook = patches.get("megatron_lm_hooks")
    if "megatron.training.training" not in sys.modules:
        with pytest.raises(UnsupportedVersionError, match="Megatron-LM"):
            hook.apply()
    # A stand-in for Megatron-LM's module (the real one is not installed here).
    fake = types.ModuleType("megatron.training.training")
    calls: list[str] = []
    fake.train_step = lambda *a, **k: calls.append("step") or "out"
    pkg = types.ModuleType("megatron.training")
    pkg.training = fake
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setitem(sys.modules, "megatron.training.training", fake)
    import megatron

    monkeypatch.setattr(megatron, "training", pkg, raising=False)
    original = fake.train_step
    hook.configure(before=lambda: calls.append("before"), after=lambda: calls.append("after"))
    hook.apply()
    try:
        assert fake.train_step() == "out"
        assert calls == ["before", "step", "after"]
    finally:
        hook.revert()
        hook.configure(before=None, after=None)
    assert fake.train_step is original


def test_zero3_quiet_init_names_parameters_by_count_not_value():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as cls

    from deadpool_ext.patches.deepspeed_zero3_quiet_init import QuietParamNames

    p = torch.nn.Parameter(torch.ones(1000, 100))
    names = QuietParamNames({p: "w"})
    assert repr(names) == "<1 parameter names>" and "tensor" not in repr({"param_names": names})
    assert names[p] == "w" and dict(names) == {p: "w"}
    original = cls.__init__
    patch = patches.get("deepspeed_zero3_quiet_init")
    try:
        patch.apply()
        assert cls.__init__ is not original and cls.__init__.__wrapped__ is original
        patch.apply()  # idempotent
    finally:
        patch.revert()
    assert cls.__init__ is original


def test_unsynced_init_is_scoped_to_its_block():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    from deadpool_ext.patches.deepspeed_unsynced_init import unsynced_weights

    before = (DeepSpeedEngine._broadcast_model, Init._zero_init_param, Init._all_gather)
    with unsynced_weights(False) as on:
        assert not on and (DeepSpeedEngine._broadcast_model, Init._zero_init_param, Init._all_gather) == before
    with pytest.raises(RuntimeError, match="boom"):
        with unsynced_weights() as on:
            assert on and all(now is not b for now, b in
                              zip((DeepSpeedEngine._broadcast_model, Init._zero_init_param, Init._all_gather), before))
            raise RuntimeError("boom")
    assert (DeepSpeedEngine._broadcast_model, Init._zero_init_param, Init._all_gather) == before
