"""The HF Trainer's state in every snapshot, as it was at the end of the step (issue 30, part 3), without processes:
what a step-end capture holds and how a restored Trainer takes it (TrainerState progress fields, log history, the
loop's accumulators bit for bit, start time moved back), the header room sized from the schedule and a history
that outgrows it keeping its newest entries, said; the patch's step-end hook after ``_maybe_log_save_evaluate``,
the loop state applied at the resumed epoch and ``_finalize_training`` given the whole run's start time. (The
snapshot side, ``snapshot/late.py``: tests/unit/test_snapshot_late.py.)
"""
from __future__ import annotations

import time
import types

import torch

from deadpool_ext.snapshot import late as late_mod

# -- the Trainer's bookkeeping ---------------------------------------------------------------------------------

def _trainer(step: int, history: list, *, tr_loss: float, total: float, flos: float):
    from transformers import TrainerControl, TrainerState

    st = TrainerState(global_step=step, epoch=step / 10, total_flos=1e9 * step, num_input_tokens_seen=64 * step,
                      max_steps=40, logging_steps=1, log_history=list(history))
    return types.SimpleNamespace(
        state=st, control=TrainerControl(), callback_handler=types.SimpleNamespace(callbacks=[]),
        args=types.SimpleNamespace(restore_callback_states_from_checkpoint=False, eval_strategy="no"),
        _tr_loss=torch.tensor(tr_loss, dtype=torch.float32), _total_loss_scalar=total, _globalstep_last_logged=step,
        _initial_global_step=0, _initial_num_input_tokens_seen=0, current_flos=flos, lr_scheduler=None,
        _load_callback_state=lambda: None)


def test_a_restored_trainer_takes_the_state_of_the_end_of_the_step():
    from deadpool_ext.integrations import transformers_trainer as tt
    from deadpool_ext.patches import transformers_trainer_resume as rp

    history = [{"loss": 7.1 + i / 7, "grad_norm": 1 / (i + 3), "learning_rate": 3e-4, "epoch": i / 10, "step": i}
               for i in range(1, 6)]
    tr_loss = 2.718281828  # this rank's running loss since the last log (logging_steps > 1): a float32 value
    t = _trainer(5, history, tr_loss=tr_loss, total=36.123456789, flos=12345.0)
    started = time.time() - 30.0
    section = tt.StepEnd(1 << 20).capture(t, started)
    section = late_mod.decode(late_mod.encode(section))  # what the header carries
    fresh = _trainer(0, [], tr_loss=0.0, total=0.0, flos=0.0)
    fresh.state.max_steps = 80  # this launch's configuration stays its own
    assert tt._apply_step_end(fresh, section, 5) == 5
    assert fresh.state.log_history == history and fresh.state.global_step == 5 and fresh.state.epoch == 0.5
    assert fresh.state.total_flos == 5e9 and fresh.state.num_input_tokens_seen == 320 and fresh.state.max_steps == 80
    assert "TrainerControl" in fresh.state.stateful_callbacks
    loop = getattr(fresh, rp.LOOP_ATTR)
    fresh._tr_loss = torch.tensor(0.0)
    start = rp.apply_loop_state(fresh, loop)
    assert torch.equal(fresh._tr_loss, torch.tensor(tr_loss, dtype=torch.float32))  # bit for bit
    assert fresh._total_loss_scalar == 36.123456789 and fresh._globalstep_last_logged == 5
    assert fresh._initial_global_step == 0 and fresh.current_flos == 12345.0
    assert start is not None and 29.0 < time.time() - start < 60.0  # the training time so far carried over


def test_header_room_is_sized_from_the_schedule_and_a_history_over_it_keeps_its_newest_entries():
    from deadpool_ext.integrations import transformers_trainer as tt

    assert tt.expected_log_entries(40, 1, None) == (42, 0)
    assert tt.expected_log_entries(100, 10, 50, epochs=2) == (13, 4)
    assert tt.late_headroom(42, 0) == tt.FIXED_BYTES + 42 * tt.TRAIN_ENTRY_BYTES
    assert tt.late_headroom(10**9, 0) == tt.MAX_HEADROOM
    assert tt.fit_history([10, 20, 30], 60) == 0 and tt.fit_history([10, 20, 30], 50) == 1
    assert tt.fit_history([10, 20, 30], 5) == 3
    history = [{"loss": 1.0 + i, "step": i} for i in range(1, 201)]
    t = _trainer(200, history, tr_loss=0.0, total=0.0, flos=0.0)
    capture = tt.StepEnd(4096)
    assert not capture.dropped_warned
    section = capture.capture(t, time.time())
    again = capture.capture(t, time.time())
    kept = section["log_history"]
    assert kept and kept[-1]["step"] == 200 and section["log_history_dropped"] == 200 - len(kept)
    assert again["log_history_dropped"] == section["log_history_dropped"] and capture.dropped_warned  # said once
    assert late_mod.encoded_nbytes(late_mod.encode(section)) <= 4096


def test_the_patch_posts_after_each_step_and_restores_the_loop_and_start_time(monkeypatch):
    from transformers import trainer as tm

    from deadpool_ext import patches
    from deadpool_ext.patches import transformers_trainer_resume as rp

    seen: dict = {}
    monkeypatch.setattr(tm.Trainer, "_prepare_for_training", lambda self, m, dl, r: ("model", dl))
    monkeypatch.setattr(tm.Trainer, "_run_epoch", lambda self, **kw: seen.setdefault("run", kw))
    monkeypatch.setattr(tm.Trainer, "_finalize_training", lambda self, trial, n, start: seen.setdefault("fin", start))
    monkeypatch.setattr(tm.Trainer, "_maybe_log_save_evaluate", lambda self, *a, **k: seen.setdefault("log", a))
    ends: list = []
    p = patches.get("transformers_trainer_resume")
    saved = (p._resume, p._step_end)
    p._resume = p._step_end = None

    def resume(trainer):
        setattr(trainer, rp.LOOP_ATTR, {"tr_loss": 0.5, "total_loss_scalar": 3.25, "globalstep_last_logged": 4,
                                        "initial_global_step": 0, "current_flos": 7.0, "elapsed_s": 100.0})
        return 4

    p.set_resume(resume)
    p.set_step_end(lambda trainer, start: ends.append((trainer.state.global_step, start)))
    p.apply()
    try:
        t = types.SimpleNamespace(state=types.SimpleNamespace(global_step=0),
                                  args=types.SimpleNamespace(gradient_accumulation_steps=2),
                                  _tr_loss=torch.tensor(0.0), _total_loss_scalar=0.0, _globalstep_last_logged=0,
                                  _initial_global_step=4, current_flos=0.0)
        tm.Trainer._prepare_for_training(t, 10, "dl", None)
        tm.Trainer._run_epoch(t, epoch=0, num_update_steps_per_epoch=10, epochs_trained=0,
                              steps_trained_in_current_epoch=0, resume_from_checkpoint=None, start_time=time.time())
        assert float(t._tr_loss) == 0.5 and t._total_loss_scalar == 3.25 and t._initial_global_step == 0
        assert t._globalstep_last_logged == 4 and t.current_flos == 7.0
        assert 99.0 < time.time() - seen["run"]["start_time"] < 130.0
        assert seen["run"]["steps_trained_in_current_epoch"] == 8
        tm.Trainer._maybe_log_save_evaluate(t, "tr", None, "model", None, 0, None, 123.0)
        assert ends == [(4, 123.0)]
        tm.Trainer._finalize_training(t, None, 10, time.time())
        assert seen["fin"] == seen["run"]["start_time"]  # train_runtime covers the steps that count, not one attempt
    finally:
        p.revert()
        p._resume, p._step_end = saved
