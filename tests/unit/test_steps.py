"""resilient_steps without processes: the data position recorded at every optimizer step, and after a restore
(a restart: a new ResilientSteps; an in-place recovery: the same one rewound) the next batch is the one an
uninterrupted run hands out. A stand-in runtime plays the snapshot (it keeps the client state of each step) and
the restore (it hands one back); the loaders are real: DistributedSampler, a seeded shuffling DataLoader, and
torchdata's StatefulDataLoader (positioned like a DataLoader: see the module's docstring)."""
from __future__ import annotations

import json
import types

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from deadpool_ext.integrations.steps import resilient_steps

N, BATCH = 20, 2  # 10 batches per epoch


class Engine:
    def __init__(self) -> None:
        self.global_steps = 0
        self.deadpool: Runtime | None = None

    def step(self) -> None:
        self.global_steps += 1
        if self.deadpool is not None:
            self.deadpool.snapshot(self.global_steps)


class Runtime:
    """The runtime surface resilient_steps uses; snapshots are the JSON of the client state at each step."""

    def __init__(self, engine: Engine, snapshots: dict[int, str] | None = None, restore: int | None = None,
                 rewind: int | None = None) -> None:
        self.engine, self.snapshots = engine, snapshots if snapshots is not None else {}
        self.restore, self.rewind = restore, rewind
        self._client_get = self._client_set = None
        self.in_place = True
        self.loaders = types.SimpleNamespace(claim=lambda owner: None)  # the runtime's loader tracker (unused here)

    def set_client_state(self, get, put) -> None:
        self._client_get, self._client_set = get, put

    def snapshot(self, step: int) -> None:
        self.snapshots[step] = json.dumps(self._client_get())  # what crosses the snapshot: JSON

    def _load(self, step: int) -> int:
        self.engine.global_steps = step
        self._client_set(json.loads(self.snapshots[step]))
        return step

    def resume(self) -> int:
        return self._load(self.restore) if self.restore else 0

    def handle_failure(self, exc: BaseException, *, same_objects: bool = False) -> Engine | None:
        if not (self.in_place and isinstance(exc, RuntimeError)):  # the stand-in's "a peer was lost"
            return None
        self._load(self.rewind)
        return self.engine

    def step_counter(self) -> int:
        return self.engine.global_steps

    drain_fails = 0
    trained: list[int] = []

    def drain(self) -> None:  # the last step's snapshot: its failure (a peer lost meanwhile) is recovered
        if self.drain_fails:
            self.drain_fails -= 1
            raise RuntimeError("the last snapshot's replication lost a peer")

    def mark_trained(self) -> None:
        self.trained = [*self.trained, self.engine.global_steps]


def loaders():
    data = torch.arange(N)
    return {
        "distributed_sampler": lambda: DataLoader(data, batch_size=BATCH, drop_last=True,
                                                  sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3)),
        "seeded_shuffle": lambda: DataLoader(data, batch_size=BATCH, shuffle=True,
                                             generator=torch.Generator().manual_seed(5)),
        "stateful": lambda: pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader(
            data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)),
    }


def run(make_loader, steps: int, runtime_of=None, fail_at: int | None = None):
    """Train ``steps`` steps (one batch each); returns (batches by step, engine, runtime)."""
    engine = Engine()
    rt = runtime_of(engine) if runtime_of else Runtime(engine)
    engine.deadpool = rt
    seen: dict[int, list[int]] = {}
    failed = False
    for step in resilient_steps(engine, make_loader(), max_steps=steps):
        with step as batch:
            if fail_at is not None and not failed and engine.global_steps == fail_at:
                failed = True
                raise RuntimeError("peer lost")  # mid-step, before the optimizer step
            seen[engine.global_steps + 1] = batch.tolist()
            engine.step()
    return seen, engine, rt


@pytest.mark.parametrize("kind", sorted(loaders()))
@pytest.mark.parametrize("restored", [3, 10, 13])  # mid epoch 0, the end of epoch 0, mid epoch 1
def test_a_restart_continues_with_the_batch_an_uninterrupted_run_sees(kind, restored):
    make = loaders()[kind]
    ref, _, rt = run(make, 25)
    again, engine, _ = run(make, 25, lambda e: Runtime(e, rt.snapshots, restore=restored))
    assert sorted(again) == list(range(restored + 1, 26)) and engine.global_steps == 25
    assert again == {s: ref[s] for s in again}, (kind, restored)


@pytest.mark.parametrize("kind", sorted(loaders()))
def test_an_in_place_recovery_rewinds_the_same_loop(kind):
    make = loaders()[kind]
    ref, _, _ = run(make, 16)
    seen, engine, rt = run(make, 16, lambda e: Runtime(e, rewind=11), fail_at=12)  # fails in step 13
    assert seen == ref and engine.global_steps == 16


def test_without_the_extension_it_is_a_plain_loop():
    engine = Engine()
    out = []
    for step in resilient_steps(engine, DataLoader(torch.arange(N), batch_size=BATCH), max_steps=12):
        with step as batch:
            out.append(batch[0].item())
            engine.step()
    assert engine.global_steps == 12 and out[:10] == list(range(0, N, BATCH)) and out[10:] == [0, 2]


def test_an_unrecoverable_error_propagates():
    engine = Engine()
    engine.deadpool = Runtime(engine)
    with pytest.raises(ValueError, match="bad batch"):
        for step in resilient_steps(engine, DataLoader(torch.arange(N), batch_size=BATCH), max_steps=3):
            with step:
                raise ValueError("bad batch")


def test_max_steps_is_checked():
    with pytest.raises(ValueError, match="max_steps"):
        resilient_steps(Engine(), [], max_steps=-1)


def test_the_loops_end_is_told_once_its_last_snapshot_drained():
    """After the last step resilient_steps drains the snapshot inside the recovery scope (a peer lost meanwhile is
    recovered and the steps after the restored one redone), and only then tells the launcher its loop ended
    (``mark_trained``: a node lost afterwards fails nothing)."""
    make = loaders()["seeded_shuffle"]
    ref, _, clean = run(make, 6)
    assert clean.trained == [6]

    def failing(engine):
        rt = Runtime(engine, rewind=4)
        rt.drain_fails = 1
        return rt

    seen, engine, rt = run(make, 6, failing)
    assert rt.trained == [6] and engine.global_steps == 6 and seen == ref  # steps 5 and 6 redone, same batches
