"""The DeepSpeed state adapter against every optimizer wrapper DeepSpeed builds, in one process (a 1-rank gloo
world): real engines built by ``deepspeed.initialize`` (fp32 and bf16 at ZeRO 0-3, ``BF16_Optimizer``; fp16's
``FP16_Optimizer``, ``FP16_UnfusedOptimizer`` and ZeRO 1-3 where DeepSpeed's CPU accelerator runs fp16), and the
real fp16 wrappers built directly, which runs on every host (where the CPU has no mkldnn fp16, DeepSpeed refuses
an fp16 engine, and that refusal is tested instead).

Each case: a snapshot after one step, two more steps, the snapshot restored, the step redone: the loss and
every tensor the adapter names are bit-identical to the first time. That reads every attribute the adapter
uses on the real class, after a real step of it."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import matrix, one_rank_gloo_world

IN, OUT = 8, 4


@pytest.fixture(scope="module")
def world():
    with one_rank_gloo_world():
        yield


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, OUT))


def _config(stage: int, *, bf16: bool = False, accum: str | None = None, clip: float = 1.0,
            fp16: dict | None = None, torch_adam: bool = True) -> dict:
    """``torch_adam=False`` makes DeepSpeed build its ``FusedAdam`` (at ZeRO 0 with fp16: ``FP16_Optimizer``),
    JIT-compiled for the CPU accelerator on first use (~40 s once per extensions directory)."""
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                          "torch_adam": torch_adam}},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                             "warmup_num_steps": 5}},
                 "gradient_clipping": clip, "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if fp16 is not None:
        cfg["fp16"] = {"enabled": True, **fp16}
    return cfg


def _engine(cfg: dict):
    import deepspeed

    model = _model()
    eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return eng


def _batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, IN, generator=g).to(dtype), torch.randn(4, OUT, generator=g)


def _engine_step(eng, i: int) -> float:
    x, y = _batch(i, next(eng.module.parameters()).dtype)
    loss = torch.nn.functional.mse_loss(eng(x).float(), y)
    eng.backward(loss)
    eng.step()
    return loss.item()


def _state(adapter) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in adapter.tensors()}


def _scalars(adapter) -> dict:
    """The plain state a redone step must also reproduce: counters and the loss scaler."""
    meta = adapter.meta()
    return {k: meta[k] for k in ("global_steps", "skipped_steps", "loss_scaler", "optim_scalars")}


def _roundtrip(adapter, step) -> None:
    """Snapshot after step 1, steps 2 and 3, restore, redo step 2: bit-identical loss and state."""
    step(1)
    snap = {n: t.detach().clone() for n, t in adapter.captured()}
    meta = copy.deepcopy(adapter.meta())
    loss2 = step(2)
    state2, scalars2 = _state(adapter), _scalars(adapter)
    step(3)
    assert any(not torch.equal(state2[n], t) for n, t in _state(adapter).items()), "step 3 changed nothing"
    adapter.restore(snap, meta)
    assert step(2) == loss2
    again = _state(adapter)
    assert again.keys() == state2.keys()
    for name, t in state2.items():
        assert torch.equal(again[name], t), name
    assert _scalars(adapter) == scalars2


CASES = {  # config -> the wrapper DeepSpeed builds for it (engine._do_optimizer_sanity_check)
    "fp32-zero0": (_config(0), "AdamW"),  # weight decay: DeepSpeed builds torch AdamW
    "bf16-zero0": (_config(0, bf16=True), "FP16_UnfusedOptimizer"),
    "bf16-zero1": (_config(1, bf16=True), "DeepSpeedZeroOptimizer"),
    "bf16-zero1-fp32accum": (_config(1, bf16=True, accum="fp32"), "BF16_Optimizer"),
    "bf16-zero2-fp32accum": (_config(2, bf16=True, accum="fp32"), "DeepSpeedZeroOptimizer"),
    "bf16-zero3": (_config(3, bf16=True), "DeepSpeedZeroOptimizer_Stage3"),
}


def _real_engine(cfg: dict, wrapper: str):
    """An engine ``deepspeed.initialize`` builds for ``cfg`` and its adapter, both checked to hold ``wrapper``."""
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter

    eng = _engine(cfg)
    assert type(eng.optimizer).__name__ == wrapper
    adapter = DeepSpeedStateAdapter(eng, derive_params=cfg["zero_optimization"]["stage"] > 0)
    assert adapter.wrapper == wrapper
    return eng, adapter


@pytest.mark.parametrize("case", list(CASES))
def test_real_engine_wrappers_snapshot_and_restore_bit_identical(world, case):
    cfg, wrapper = CASES[case]
    eng, adapter = _real_engine(cfg, wrapper)
    _roundtrip(adapter, lambda i: _engine_step(eng, i))
    names = [n for n, _ in adapter.tensors()]
    assert any(n.startswith("master.") for n in names) and any(".exp_avg_sq" in n for n in names), names
    if cfg.get("bf16"):
        assert {t.dtype for n, t in adapter.tensors() if n.startswith("params.")} == {torch.bfloat16}


def test_bf16_optimizer_has_a_partition_layout_for_elastic(world):
    """BF16_Optimizer's flat partitions follow ZeRO-1's rule: an elastic reshard can use them."""
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter

    eng = _engine(_config(1, bf16=True, accum="fp32"))
    adapter = DeepSpeedStateAdapter(eng)
    layout = adapter.partition_layout()
    assert layout is not None and layout["rule"] == "flat", adapter.why_no_layout()
    assert sum(n for _, n in layout["groups"][0]) == sum(p.numel() for p in eng.module.parameters())


# -- fp16 on real engines, where DeepSpeed's CPU accelerator runs it ------------------------------------------
# The host property that decides it: DeepSpeed's CPU accelerator runs fp16 only where torch's oneDNN (mkldnn)
# has fp16 kernels for this CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, e.g. AVX512-FP16 or AMX).
FP16_PROPERTY = "torch.ops.mkldnn._is_mkldnn_fp16_supported()"


def _fp16_runs_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.fixture
def fp16_engines(world):
    """Skips, naming the host property, where DeepSpeed refuses fp16 engines (the refusal is tested instead)."""
    if not _fp16_runs_here():
        pytest.skip(f"this host's CPU has no mkldnn fp16 ({FP16_PROPERTY} is False): DeepSpeed's CPU accelerator "
                    "refuses fp16 engines here; test_cpu_refuses_fp16_where_it_has_no_mkldnn_fp16 runs instead")


FP16_CASES = {  # config -> the wrapper DeepSpeed builds for it
    "fp16-zero0": (_config(0, fp16={"initial_scale_power": 8}), "FP16_UnfusedOptimizer"),
    "fp16-zero0-static": (_config(0, fp16={"loss_scale": 128}), "FP16_UnfusedOptimizer"),
    "fp16-zero0-fusedadam": (_config(0, fp16={"initial_scale_power": 8}, torch_adam=False), "FP16_Optimizer"),
    "fp16-zero0-fusedadam-static": (_config(0, fp16={"loss_scale": 128}, torch_adam=False), "FP16_Optimizer"),
    "fp16-zero1": (_config(1, fp16={"initial_scale_power": 8}), "DeepSpeedZeroOptimizer"),
    "fp16-zero2": (_config(2, fp16={"initial_scale_power": 8}), "DeepSpeedZeroOptimizer"),
    "fp16-zero3": (_config(3, fp16={"initial_scale_power": 8}), "DeepSpeedZeroOptimizer_Stage3"),
}


# The FusedAdam cases JIT-compile DeepSpeed's CPU fused_adam op first (about 40 s on a fresh extensions cache, as
# CI's is): full matrix only. In CI, FP16_Optimizer's state round trip is the directly built wrapper's test below.
@pytest.mark.parametrize("case", matrix(list(FP16_CASES), ci=[c for c in FP16_CASES if "fusedadam" not in c]))
def test_real_fp16_engines_snapshot_and_restore_bit_identical(fp16_engines, case):
    cfg, wrapper = FP16_CASES[case]
    eng, adapter = _real_engine(cfg, wrapper)
    assert {t.dtype for n, t in adapter.tensors() if n.startswith("params.")} == {torch.float16}
    _roundtrip(adapter, lambda i: _engine_step(eng, i))  # the loss scaler too (_scalars)
    assert adapter.meta()["loss_scaler"], "the loss scale is captured"


@pytest.mark.parametrize("stage", [1, 3])
def test_real_fp16_engine_restores_the_loss_scale_after_overflows(fp16_engines, stage):
    """A scale so high that the first steps overflow: the snapshot holds the lowered scale and the skipped-step
    count, and a restore brings both back (they decide whether the redone step is skipped). ZeRO only: DeepSpeed
    0.19.8's ``engine.backward`` scales the loss for ZeRO optimizers alone, so at ZeRO 0 (``FP16_Optimizer``,
    ``FP16_UnfusedOptimizer``) no scale overflows; their scaler's round trip is in the cases above."""
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter

    eng = _engine(_config(stage, fp16={"initial_scale_power": 30, "hysteresis": 1}))
    adapter = DeepSpeedStateAdapter(eng, derive_params=stage > 0)
    _engine_step(eng, 1)
    assert eng.skipped_steps == 1, "the first step overflowed"
    snap = {n: t.detach().clone() for n, t in adapter.captured()}
    meta = copy.deepcopy(adapter.meta())
    later = [_engine_step(eng, i) for i in range(2, 30)]
    after = _scalars(adapter)
    assert after["skipped_steps"] > 1 and after != _scalars_of(meta), "the scale moved on after the snapshot"
    adapter.restore(snap, meta)
    assert _scalars(adapter) == _scalars_of(meta)
    assert [_engine_step(eng, i) for i in range(2, 30)] == later
    assert _scalars(adapter) == after


def test_a_restore_leaves_no_optimizer_state_the_snapshot_did_not_have():
    """What the overflow test above found: a snapshot taken before the optimizer's first real step holds no moments;
    restoring it must remove the moments a later step made, not keep them (in place where the shape fits)."""
    from deadpool_ext.snapshot.state import restore_optimizer_state

    avg = torch.ones(3)
    state = {"step": torch.tensor(7.0), "exp_avg": avg, "exp_avg_sq": torch.ones(3), "extra": 1}
    restore_optimizer_state(state, {"optim.0.exp_avg": torch.zeros(3), "optim.10.exp_avg": torch.ones(3)},
                            "optim.0.", {"scalar": 2})
    assert set(state) == {"exp_avg", "scalar"} and state["exp_avg"] is avg and not avg.any()
    restore_optimizer_state(state, {}, "optim.0.", {})
    assert state == {}


def _scalars_of(meta: dict) -> dict:
    return {k: meta[k] for k in ("global_steps", "skipped_steps", "loss_scaler", "optim_scalars")}


# -- fp16 wrappers built directly: every host, also where DeepSpeed refuses fp16 engines ------------------------
class _Engine(torch.nn.Module):
    """What the adapter reads from a DeepSpeed engine, around a real fp16 wrapper (the engine is not under test;
    where the CPU has no mkldnn fp16, DeepSpeed will not build one with fp16)."""

    def __init__(self, model: torch.nn.Module, optimizer) -> None:
        super().__init__()
        self.module, self.optimizer = model, optimizer
        self.global_steps = self.global_samples = self.skipped_steps = self.micro_steps = 0
        self.dp_world_size, self.lr_scheduler, self.global_rank = 1, None, 0

    def zero_optimization_stage(self) -> int:
        return 0

    def train_batch_size(self) -> int:
        return 4

    def step(self, i: int) -> float:
        x, y = _batch(i, torch.float16)
        self(x)  # the adapter's RNG hook runs here, as in an engine's forward
        loss = torch.nn.functional.mse_loss(self.module(x).float(), y)
        self.optimizer.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        self.micro_steps += 1
        self.global_samples += 4
        return loss.item()

    def forward(self, x):
        return x


def _fp16_wrapper(kind: str, dynamic: bool):
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    model = _model().half()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    profile = LossScaleProfile.FUSED if kind == "FP16_Optimizer" else LossScaleProfile.UNFUSED
    scale = LossScaleConfig(low_precision_dtype=torch.float16, dynamic_loss_scale=dynamic, static_loss_scale=128.0,
                            dynamic_loss_args=None, profile=profile, initial_dynamic_scale=2.0 ** 8)
    cls = FP16_Optimizer if kind == "FP16_Optimizer" else FP16_UnfusedOptimizer
    return model, cls(inner, loss_scale_config=scale, low_precision_dtype=torch.float16, clip_grad=1.0)


@pytest.mark.parametrize("kind,dynamic", [("FP16_Optimizer", True), ("FP16_UnfusedOptimizer", True),
                                          ("FP16_Optimizer", False)])
def test_fp16_wrappers_snapshot_and_restore_bit_identical(world, kind, dynamic):
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter

    model, opt = _fp16_wrapper(kind, dynamic)
    eng = _Engine(model, opt)
    adapter = DeepSpeedStateAdapter(eng)
    assert adapter.wrapper == kind
    assert {t.dtype for n, t in adapter.tensors() if n.startswith("params.")} == {torch.float16}
    _roundtrip(adapter, eng.step)
    meta = adapter.meta()
    assert meta["loss_scaler"]["cur_scale"] == opt.loss_scale_config.cur_scale
    assert meta["loss_scaler"]["dynamic_loss_scale"] is dynamic


def test_fp16_loss_scale_is_restored(world):
    """A dynamic loss scale that moved after the snapshot comes back (it decides the next step's skip)."""
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter

    model, opt = _fp16_wrapper("FP16_UnfusedOptimizer", True)
    eng = _Engine(model, opt)
    adapter = DeepSpeedStateAdapter(eng)
    eng.step(1)
    snap = {n: t.detach().clone() for n, t in adapter.captured()}
    meta = copy.deepcopy(adapter.meta())
    was = (opt.loss_scale_config.cur_scale, opt.loss_scale_config.cur_iter, opt.loss_scale_config.last_overflow_iter)
    opt.loss_scale_config.cur_scale, opt.loss_scale_config.cur_iter = 3.0, 99
    opt.loss_scale_config.last_overflow_iter = 98
    adapter.restore(snap, meta)
    assert (opt.loss_scale_config.cur_scale, opt.loss_scale_config.cur_iter,
            opt.loss_scale_config.last_overflow_iter) == was


def test_cpu_refuses_fp16_where_it_has_no_mkldnn_fp16(world):
    """Where the CPU has no mkldnn fp16, DeepSpeed's CPU accelerator refuses an fp16 engine: the wrappers are then
    covered by the directly built ones above. Where it has it, the real fp16 engines above run instead."""
    if _fp16_runs_here():
        pytest.skip(f"this host's CPU has mkldnn fp16 ({FP16_PROPERTY} is True): DeepSpeed runs fp16 engines here; "
                    "test_real_fp16_engines_snapshot_and_restore_bit_identical runs instead")
    with pytest.raises(ValueError, match="fp16 is not supported"):
        _engine(_config(0, fp16={}))


# -- refusals: one line, naming the keys ---------------------------------------------------------------------
class _Odd:
    param_groups: list = []


@pytest.mark.parametrize("optimizer,stage,keys", [
    (None, 0, "optimizer"),
    (_Odd(), 0, "zero_optimization.stage"),
    (type("ZenFlowZeroOptimizer", (), {})(), 2, "zero_optimization.zenflow"),
    (type("SuperOffloadOptimizer_Stage3", (), {})(), 3, "super_offload"),
])
def test_unsupported_wrapper_refused_at_attach_in_one_line(optimizer, stage, keys):
    from deadpool_ext.config import ConfigError
    from deadpool_ext.integrations.deepspeed.state import DeepSpeedStateAdapter
    from deadpool_ext.integrations.deepspeed.wrappers import UnsupportedWrapperError
    from deadpool_ext.snapshot.state import UnsupportedEngineError

    class Eng:
        def zero_optimization_stage(self):
            return stage

    eng = Eng()
    eng.optimizer = optimizer  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedWrapperError) as info:
        DeepSpeedStateAdapter(eng)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, UnsupportedEngineError)
    assert "\n" not in msg and keys in msg and "change" in msg, msg


def test_refused_subclasses_and_keys_are_deepspeeds():
    """The refusal table names classes and config keys the installed DeepSpeed has."""
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deadpool_ext.integrations.deepspeed.wrappers import _REFUSED_SUBCLASSES

    assert set(_REFUSED_SUBCLASSES) == {ZenFlowZeroOptimizer.__name__, SuperOffloadOptimizer_Stage3.__name__}
    assert issubclass(ZenFlowZeroOptimizer, DeepSpeedZeroOptimizer)
    assert issubclass(SuperOffloadOptimizer_Stage3, DeepSpeedZeroOptimizer_Stage3)
    assert "zenflow" in DeepSpeedZeroConfig.model_fields
    assert "super_offload" in DeepSpeedZeroOffloadOptimizerConfig.model_fields
    for attr in ("swap_optimizer", "params_in_nvme_and_cpu"):  # what the NVMe refusal reads, set in __init__
        import inspect

        assert f"self.{attr} = " in inspect.getsource(DeepSpeedZeroOptimizer_Stage3.__init__), attr
