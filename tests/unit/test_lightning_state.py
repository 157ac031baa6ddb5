"""Lightning's fit loop set to a restored step (no processes, no DeepSpeed: a real single-process Lightning run on
CPU, the extension's runtime replaced by a stand-in that returns a step).

- ``fit_loop_state`` is, step for step across epoch boundaries, the state dict Lightning itself reports at the
  end of the batch that completed that step (with a step-interval LR scheduler, several accumulations);
- a fresh Trainer whose fit loop is positioned at step S (``patches/lightning_fit_loop.py`` +
  ``integrations/lightning.py``, as after a restart) trains on exactly the batches, epochs and batch indices an
  uninterrupted run used after S;
- a failure inside the loop that the runtime recovers (as an in-place hot-swap does) has the loop run again from
  the restored step, on the same batches.
"""
from __future__ import annotations

import json

import pytest

pl = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402

from deadpool_ext import patches  # noqa: E402
from deadpool_ext.integrations import lightning as integ  # noqa: E402
from deadpool_ext.integrations.lightning_state import fit_loop_state, position  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self, records: list, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.records, self.fail_at = records, fail_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fail_at is not None and len(self.records) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("lost peer (stand-in for a collective error)")
        self.records.append((self.trainer.global_step, self.current_epoch, batch_idx, round(float(x.sum()), 5),
                             self.lr_schedulers().last_epoch))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        for cb in self.trainer.callbacks:  # where the extension captures: inside the step, after the optimizer's
            if isinstance(cb, Capture):
                cb.take(self.trainer)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), "interval": "step"}}


class StandIn:
    """The runtime's surface the integration uses: resume() hands back the client state captured at a step and
    returns that step; recover() does the same, as after an in-place swap. ``captured``: step -> client state."""

    in_place = True

    def __init__(self, captured: dict, step: int = 0, restored_at: int | None = None) -> None:
        self.captured, self.step, self.restored_at, self.recovered = captured, step, restored_at, 0
        self.get = self.put = None
        from deadpool_ext.integrations.loaders import LoaderPositions

        self.loaders = LoaderPositions()  # claimed by the integration: Lightning positions its loader itself
        self.loop_owner: str | None = None

    def set_client_state(self, get, put) -> None:
        self.get, self.put = get, put

    def resume(self) -> int:
        if self.step:
            self.put(self.captured[self.step])
        return self.step

    def handle_failure(self, exc, *, same_objects: bool = False):
        if not (self.in_place and isinstance(exc, RuntimeError)):  # the stand-in's "a peer was lost"
            return None
        self.recovered += 1
        self.put(self.captured[self.restored_at])
        return self

    def step_counter(self) -> int:
        return int(self.restored_at or 0)

    def settle_rng(self) -> None:
        pass


class Capture(pl.Callback):
    """The client state as the snapshot takes it: inside each optimizer step, right after the optimizer's (before
    Lightning counts the step and steps its schedulers); step -> state."""

    def __init__(self) -> None:
        self.states: dict = {}

    def take(self, trainer) -> None:
        self.states[trainer.global_step + 1] = json.loads(json.dumps(integ.lightning_state(trainer.fit_loop)))


def _data(n_batches: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(7)
    ds = torch.utils.data.TensorDataset(torch.randn(n_batches * 2, 4, generator=g), torch.randn(n_batches * 2, 1))
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))


def _fit(module, n_batches: int, accumulate: int, max_steps: int, callbacks=()) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, _data(n_batches))
    return trainer


@pytest.fixture
def fit_patch():
    p = patches.get("lightning_fit_loop")
    p.set_hooks(integ.resume_fit, integ.recover_fit, integ.epoch_start)
    p.apply()
    yield p
    p.revert()


@pytest.mark.parametrize("n_batches,accumulate", [(5, 2), (6, 2), (4, 1), (7, 3)])
def test_fit_loop_state_is_lightnings_own_after_every_step(n_batches, accumulate):
    mismatches: list = []
    seen: list[int] = []

    class Compare(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step and trainer.global_step not in seen:
                seen.append(trainer.global_step)
                got = json.loads(json.dumps(trainer.fit_loop.state_dict()))
                want, _ = fit_loop_state(trainer.global_step, n_batches, accumulate, step_schedulers=1)
                if got != want:
                    mismatches.append((trainer.global_step, {k: (got[k], want.get(k)) for k in got
                                                             if got[k] != want.get(k)}))

    per_epoch = -(-n_batches // accumulate)
    _fit(Module([]), n_batches, accumulate, 3 * per_epoch + 1, [Compare()])
    assert seen == list(range(1, 3 * per_epoch + 2))
    assert not mismatches, mismatches[:2]


def test_position_counts_steps_per_epoch():
    assert position(1, 5, 2) == position(1, 5, 2)
    p = position(3, 5, 2)  # 3 steps an epoch (2, 2, 1 batches): step 3 ends epoch 0
    assert (p.epoch, p.batches_used, p.steps_in_epoch) == (0, 5, 3)
    p = position(4, 5, 2)
    assert (p.epoch, p.batches_used, p.steps_in_epoch) == (1, 2, 1)
    with pytest.raises(ValueError):
        position(0, 5, 2)


@pytest.mark.parametrize("restored", [2, 3, 4, 6, 7])
def test_a_loop_positioned_at_a_restored_step_sees_an_uninterrupted_runs_batches(fit_patch, restored):
    n_batches, accumulate, max_steps = 5, 2, 9
    ref: list = []
    cap = Capture()
    _fit(Module(ref), n_batches, accumulate, max_steps, [cap])
    got: list = []
    module = Module(got)
    module.deadpool = StandIn(cap.states, step=restored)
    trainer = _fit(module, n_batches, accumulate, max_steps)
    assert trainer.global_step == max_steps
    assert got == [r for r in ref if r[0] >= restored]
    assert got[0][0] == restored


@pytest.mark.parametrize("fail_at,restored_at", [(9, 4), (7, 3), (12, 6), (12, 5)])
def test_a_recovered_failure_runs_the_loop_again_from_the_restored_step(fit_patch, fail_at, restored_at):
    """Micro-batch ``fail_at`` (0-based) raises; the newest version every rank holds is ``restored_at`` (the step
    before, or one more behind: a commit lag; 3 and 6 end an epoch)."""
    n_batches, accumulate, max_steps = 5, 2, 9
    ref: list = []
    _fit(Module(ref), n_batches, accumulate, max_steps)
    got: list = []
    module = Module(got, fail_at=fail_at)
    cap = Capture()
    rt = module.deadpool = StandIn(cap.states, step=0, restored_at=restored_at)
    trainer = _fit(module, n_batches, accumulate, max_steps, [cap])
    assert rt.recovered == 1 and trainer.global_step == max_steps
    assert got[:fail_at] == ref[:fail_at]
    assert got[fail_at:] == [r for r in ref if r[0] >= restored_at]


def test_an_unrecoverable_failure_propagates_unchanged(fit_patch):
    module = Module([], fail_at=3)
    rt = module.deadpool = StandIn({})
    rt.in_place = False
    with pytest.raises(RuntimeError, match="lost peer"):
        _fit(module, 5, 2, 6)


def test_lightning_scheduler_state_travels_as_json():
    records: list = []
    module = Module(records)
    trainer = _fit(module, 5, 2, 4)
    st = integ.lightning_state(trainer.fit_loop)
    assert json.loads(json.dumps(st)) == st
    sched = trainer.lr_scheduler_configs[0].scheduler
    saved = st["lightning"]["lr_schedulers"][0]
    sched.step()
    assert sched.state_dict()["last_epoch"] != saved["last_epoch"]
    integ.set_lightning_state(trainer.fit_loop, st)
    assert sched.state_dict()["last_epoch"] == saved["last_epoch"]


def test_a_loader_without_length_is_refused_with_one_line(fit_patch):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(1)
            while True:
                yield torch.randn(4, generator=g), torch.randn(1, generator=g)

    module = Module([])
    module.deadpool = StandIn({3: {}}, step=3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(integ.NotPositionableError, match="has no length .* give the dataloader a __len__"):
        trainer.fit(module, torch.utils.data.DataLoader(Stream(), batch_size=2))
