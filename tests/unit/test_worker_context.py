"""rebuild/context.py: the process's fault-tolerance state in one object; one source answers "which generation"."""
from __future__ import annotations

import secrets
import signal

import pytest

from deadpool_ext.cluster.assignment import Assignment
from deadpool_ext.launcher import keys
from deadpool_ext.rebuild import notice, progress, recover, worker
from deadpool_ext.rebuild.context import WorkerContext, context
from deadpool_ext.store import connect
from deadpool_ext.store.embedded import EmbeddedStoreServer

pytestmark = pytest.mark.timeout(60)


def test_a_process_starts_in_generation_zero_with_one_driver():
    ctx = WorkerContext()
    assert ctx.generation == 0 and ctx.membership is None and ctx.pending_live is None
    assert ctx.recovery is ctx.recovery
    assert recover.driver() is context().recovery
    assert notice.fence() is context().fence


def test_progress_is_the_contexts():
    before = context().progress.step
    try:
        progress.note_step(41)
        assert context().progress.step == 41 and progress.sample()["step"] == 41
    finally:
        context().progress.step = before


def test_the_generation_comes_from_the_membership_alone(monkeypatch):
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        launcher = connect(server.url, token, "ctxjob", 10.0)
        m = worker.Membership(store_url=server.url, token=token, job_id="ctxjob", worker_id="node0.0", node="node0",
                              heartbeat_s=0.2, watch_s=0.2)
        try:
            monkeypatch.setattr(context(), "membership", m)
            assert context().generation == 0 and not context().in_hot_swap and not context().is_spare
            a = Assignment(generation=2, world_size=1, ranks={"node0.0": 0}, nodes={"node0.0": "node0"})
            launcher.set_json(keys.ASSIGNMENT, a.to_json())
            assert m.join(1, timeout_s=5.0) == a
            assert context().generation == 2 and context().in_hot_swap and not context().is_spare
        finally:
            m.close()


def test_a_step_is_armed_in_the_contexts_generation(monkeypatch):
    class Assigned:
        generation, role = 5, "active"

    before = signal.getsignal(notice.SIGNAL)
    monkeypatch.setattr(context(), "membership", Assigned())
    monkeypatch.setattr(context(), "interrupts", notice.Interrupts())
    assert notice.install()
    try:
        notice.request(5, "the launcher published generation 6")
        assert context().interrupts.requested == (5, "the launcher published generation 6")
        with pytest.raises(notice.GenerationLost, match="generation 5 was abandoned"):
            with notice.stoppable(True):
                pass
        assert notice.stopped(5) and context().interrupts.stopped == 5
    finally:
        signal.signal(notice.SIGNAL, before)
        notice._installed = False


def test_one_graveyard_holds_every_dead_generations_groups():
    graveyard = WorkerContext().graveyard
    kept, buried = object(), [object()]
    graveyard.keep([kept])
    graveyard.bury(buried)
    graveyard.reap()   # the buried go (their last reference dropped off the calling thread); the kept stay
    assert graveyard.kept == [kept] and graveyard.buried == []
    graveyard.bury(buried)
    assert graveyard.take_buried() == [buried] and graveyard.buried == [] and graveyard.kept == [kept]


def test_the_first_engines_batch_shape_is_kept_in_the_context(monkeypatch):
    from deadpool_ext.integrations.deepspeed import batch

    class Engine:
        def __init__(self, dp: int) -> None:
            self.dp_world_size = dp

        def train_batch_size(self) -> int:
            return 8 * self.dp_world_size // 4

        def train_micro_batch_size_per_gpu(self) -> int:
            return 2

        def gradient_accumulation_steps(self) -> int:
            return 1

    monkeypatch.setattr(context(), "first_batch", None)
    batch.record(Engine(4))
    batch.record(Engine(2))  # a rebuilt engine on a resized world: the first one's shape stays
    assert batch.recorded() == batch.BatchShape(global_batch=8, micro=2, accumulation=1, dp=4)
    assert context().first_batch is batch.recorded()
