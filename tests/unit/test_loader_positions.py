"""The data position of a script's own DataLoaders (issue 43, part 2), in one process: a loader iterated, its
position recorded as a snapshot records it, a "restarted" process (new tracker, the script's seed again) restored
from it: the batches that follow are the uninterrupted run's. Also the pure parts: the record's JSON and the epoch
rule, and the pure decisions of DeepSpeed's own resume calls (client-state rebasing) and of the in-place redo."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from deadpool_ext import patches
from deadpool_ext.integrations.deepspeed.checkpoint_calls import follows, newest_saved, rebase
from deadpool_ext.integrations.deepspeed.pipe_redo import BatchRecord, batch_redo_plan
from deadpool_ext.integrations.deepspeed.redo import (
    Micro,
    StepRecord,
    apply_accessor,
    loss_accessor,
    redo_plan,
    step_call_done,
)
from deadpool_ext.integrations.loaders import LoaderPositions, Position, next_epoch


@pytest.fixture
def tracked():
    patch = patches.get("torch_dataloader_position")
    was_applied, was = patch.applied, patch.tracker
    patch.apply()
    yield patch
    patch.set_tracker(was)
    if not was_applied:
        patch.revert()


def _epochs(loader: DataLoader, n: int) -> list[torch.Tensor]:
    """What a training loop draws: ``n`` batches, epoch after epoch (``set_epoch`` from its own count, from 0), with
    global-RNG draws after each (the step's dropout)."""
    sampler = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
    batches: list[torch.Tensor] = []
    epoch, it = 0, None
    while len(batches) < n:
        if it is None:
            if sampler is not None:
                sampler.set_epoch(epoch)
            it = iter(loader)
        try:
            batches.append(next(it))
        except StopIteration:
            it, epoch = None, epoch + 1
            continue
        torch.rand(3)
    return batches


def _loader(kind: str) -> DataLoader:
    data = TensorDataset(torch.arange(40).view(20, 2))
    if kind == "global":
        return DataLoader(data, batch_size=3, shuffle=True,
                          collate_fn=lambda b: torch.stack([x[0] for x in b]) + torch.randint(0, 2, (1,)))
    if kind == "generator":
        return DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5),
                          collate_fn=lambda b: torch.stack([x[0] for x in b]))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    return DataLoader(data, batch_size=2, sampler=sampler, collate_fn=lambda b: torch.stack([x[0] for x in b]))


@pytest.mark.parametrize("kind", ["global", "generator", "distributed"])
@pytest.mark.parametrize("done", [4, 6, 7, 13])  # mid-epoch, an epoch's end, the next epoch
def test_a_restored_loader_hands_out_the_uninterrupted_runs_batches(tracked, kind, done):
    """The uninterrupted run: ``done`` batches, a snapshot (the position and the RNG), 8 more. The restarted one:
    the script's seed, a new loader, the position and RNG restored, then 8 batches: the same, bit for bit."""
    def run(stop_at: int | None):
        torch.manual_seed(0)
        t = LoaderPositions(settle_rng=lambda: None)
        tracked.set_tracker(t)
        loader = _loader(kind)
        batches = _epochs(loader, stop_at if stop_at is not None else done + 8)
        return batches, t.position(), torch.get_rng_state()

    full, _, _ = run(None)
    _, pos, rng = run(done)
    # the restarted process: seeded again, a new tracker, the snapshot's position and RNG restored
    torch.manual_seed(0)
    t = LoaderPositions(settle_rng=lambda: None)
    tracked.set_tracker(t)
    loader = _loader(kind)
    torch.set_rng_state(rng)
    t.restore(pos)
    assert t.apply_restored() == 1
    after = _epochs(loader, 8)  # the script counts its epochs from 0 again
    assert all(torch.equal(a, b) for a, b in zip(after, full[done:done + 8], strict=True))


@pytest.mark.parametrize("done", [5, 7])  # mid-epoch, the epoch's end
def test_an_iterator_made_before_the_restore_is_positioned_in_place(tracked, done):
    """DeepSpeed's own loader: the pipeline engine's ``RepeatingLoader`` iterates it inside ``deepspeed.initialize``,
    before the script's ``load_checkpoint``. That iterator, not drawn from yet, is positioned in place at the restore
    (the object the engine holds hands out the uninterrupted run's next batches); one drawn from is left alone."""
    def fresh():
        torch.manual_seed(0)
        t = LoaderPositions(settle_rng=lambda: None)
        tracked.set_tracker(t)
        loader = _loader("global")
        return t, loader, iter(loader)

    t, loader, it = fresh()
    full = [next(it) for _ in range(done)]
    pos, rng = t.position(), torch.get_rng_state()
    rest = list(it)
    if not rest:  # the epoch ended: the next epoch's iterator
        rest = list(iter(loader))
    t, loader, it = fresh()  # the restarted process: its engine made the iterator already
    torch.set_rng_state(rng)
    t.restore(pos)
    assert t.apply_restored() == 1
    got = list(it) or list(iter(loader))
    assert len(got) == len(rest) and all(torch.equal(a, b) for a, b in zip(got, rest, strict=True)), full
    t, loader, it = fresh()
    next(it)  # drawn from before the restore: left alone, the next iterator is positioned
    t.restore(pos)
    t.apply_restored()
    assert t._pending


def test_a_claimed_tracker_records_and_positions_nothing(tracked):
    t = LoaderPositions()
    tracked.set_tracker(t)
    t.claim("resilient_steps")
    next(iter(_loader("generator")))
    assert t.position() is None
    t.restore({"loaders": [{"iters": 1, "drawn": 3}]})
    assert t.apply_restored() == 0


def test_batches_from_no_dataloader_and_unknown_samplers_are_named(tracked):
    t = LoaderPositions()
    assert len(t.unsure_lines(steps_done=1)) == 1 and "no torch DataLoader" in t.unsure_lines(steps_done=1)[0]

    class OwnSampler(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    tracked.set_tracker(t)
    next(iter(DataLoader(list(range(4)), sampler=OwnSampler())))
    lines = t.unsure_lines(steps_done=1)
    assert len(lines) == 1 and "OwnSampler" in lines[0]


def test_a_malformed_position_is_dropped_and_the_loader_starts_over():
    t = LoaderPositions()
    t.restore({"loaders": [{"iters": -1}]})
    assert t.apply_restored() == 0
    with pytest.raises(ValueError, match="'drawn'"):
        Position.from_json({"iters": 1, "drawn": "3"})


def test_the_first_epoch_after_a_restore():
    mid = Position(iters=3, drawn=2, epoch=2)
    assert next_epoch(mid, 0) == (2, 2)        # mid-epoch: the recorded epoch; the script's later epochs shifted by 2
    ended = Position(iters=3, drawn=5, exhausted=True, epoch=2, epoch_step=1)
    assert next_epoch(ended, 0) == (3, 3)
    assert next_epoch(Position(iters=1, epoch=None), None) == (None, 0)
    assert next_epoch(Position(iters=2, epoch=0, exhausted=True, epoch_step=0), 0) == (0, 0)  # never set_epoch


def test_client_state_step_keys_follow_the_engines_counters():
    at = {"global_steps": 6, "micro_steps": 12, "global_samples": 48}
    saved = {"step": 5, "epoch": 6, "micro_step": 12, "samples_seen": 48, "flag": True, "name": "x", "iters": 30}
    assert follows(saved, at) == {"step": ("global_steps", -1), "micro_step": ("micro_steps", 0),
                                  "samples_seen": ("global_samples", 0)}
    now = {"global_steps": 9, "micro_steps": 18, "global_samples": 72}
    out, moved = rebase(saved, at, now)
    assert out == {**saved, "step": 8, "micro_step": 18, "samples_seen": 72} and moved == ["micro_step", "samples_seen",
                                                                                            "step"]


def test_the_loss_a_plain_loop_backs_is_found_in_the_forwards_output():
    loss = torch.tensor(1.0)
    assert loss_accessor(loss, loss) == ("self", None)
    assert loss_accessor((torch.tensor(2.0), loss), loss) == ("item", 1)
    out = {"logits": torch.ones(2), "loss": loss}
    assert apply_accessor(out, loss_accessor(out, loss)) is loss
    assert loss_accessor(torch.ones(2), loss)[0] == "none"  # criterion(engine(x), y): the script's own code


def test_what_the_recorded_calls_can_redo():
    def micro(loss):
        return Micro(args=(), kwargs={}, rng=torch.get_rng_state(), loss=loss)

    recs = [StepRecord(after=4, micros=[micro(("key", "loss"))]), StepRecord(after=5, micros=[micro(None)])]
    assert redo_plan(recs, 4) is None and redo_plan(recs, 5) is None
    assert "older than the oldest step recorded" in redo_plan(recs, 3)
    recs[1].micros[0].loss = ("none", "computed by the script")
    assert "computed by the script" in redo_plan(recs, 4)
    assert redo_plan([], 4) == "nothing was recorded"


def test_a_restore_rebases_the_client_state_of_the_newest_save_at_or_before_its_step():
    """A save at step N follows the snapshot of step N: restored to 2, the record published by the save at 2 wins
    over the snapshot's (none, or the save at 0); restored to 3 after saves at 2 and 4 (the save at 4 rolled back),
    the one at 2; every record newer: the oldest of them."""
    at = lambda n: {"saved": {"step": n}, "at": {"global_steps": n}}  # noqa: E731
    assert newest_saved([at(0), at(2)], 2) == at(2)
    assert newest_saved([at(4), at(2)], 3) == at(2)
    assert newest_saved([at(6), at(4)], 3) == at(4)
    assert newest_saved([], 3) is None
    saved = newest_saved([at(2)], 2)
    assert saved is not None and rebase(saved["saved"], saved["at"], {"global_steps": 2}) == ({"step": 2}, ["step"])


def test_a_step_call_that_failed_after_its_optimizer_step_is_not_made_again():
    """engine.step() began at step 9: failed with the counter at 10 (in its snapshot's replica exchange) and step 10
    restored: done, not made again (it would step on no gradients); step 9 restored, or the counter unmoved (a
    failure inside the optimizer step): redone."""
    assert step_call_done(9, 10, 10)
    assert not step_call_done(9, 10, 9)
    assert not step_call_done(9, 9, 9)


def test_what_the_recorded_train_batch_calls_can_redo():
    recs = [BatchRecord(after=4, rng=torch.get_rng_state()), BatchRecord(after=5, rng=torch.get_rng_state())]
    assert batch_redo_plan(recs, 4) is None and batch_redo_plan(recs, 5) is None
    assert "older than the oldest step recorded" in batch_redo_plan(recs, 3)
    assert batch_redo_plan([], 4) == "nothing was recorded"
    # the interrupted call: redone when its step is not restored; its step restored, only if it had its loss
    failed = BatchRecord(after=6, rng=torch.get_rng_state())
    assert batch_redo_plan(recs, 5, failed) is None and batch_redo_plan([], 6, failed) is None
    assert "interrupted before it had the step's loss" in batch_redo_plan([], 7, failed)
    failed.done = True
    assert batch_redo_plan([], 7, failed) is None
    assert "older than the oldest" in batch_redo_plan([], 5, failed)


def test_a_loops_counters_are_its_step_like_int_variables_not_its_settings():
    """What a survivor publishes before the script's first save (checkpoint_calls.script_counters): the step-like
    ints of the script's own frames, innermost first; sizes and limits, bools and private names left out."""
    import inspect

    from deadpool_ext.integrations.deepspeed.checkpoint_calls import script_counters

    def loop():
        step, micro_step, batch_size, max_steps, save_interval, _iter = 3, 7, 4, 10, 5, 1
        done_steps = True
        got = script_counters(inspect.currentframe())
        del step, micro_step, batch_size, max_steps, save_interval, _iter, done_steps  # read through the frame
        return got

    got = loop()
    assert got["step"] == 3 and got["micro_step"] == 7, got
    assert not {"batch_size", "max_steps", "save_interval", "_iter", "done_steps"} & set(got), got
