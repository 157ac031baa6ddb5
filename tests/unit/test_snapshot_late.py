"""A framework's state posted after its step, sealed with the step's snapshot (``snapshot/late.py``; issue 30,
part 3: the HF Trainer's bookkeeping), on a real SnapshotManager in a gloo world of one: each version is sealed with
the state posted after its step (a history larger than the header's usual slack fits in the room reserved for it),
a step that failed before its post is never sealed, an unposted step is sealed without it at the next snapshot,
and a restore hands the restored version's state back. The LateState rules without a manager.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

from deadpool_ext.snapshot import late as late_mod
from deadpool_ext.snapshot.late import LateDropped, LateState
from deadpool_ext.testing.memory_job import Adapter, manager, world_of_one


def _steps(m, a, steps, post=None) -> None:
    for step in steps:
        m.before_optimizer_step()
        a.w.fill_(step)
        a.steps = step
        m.after_step()
        if post is not None and post(step) is not None:
            assert m.late.post(step, post(step))


def _history(step: int) -> dict:
    return {"log_history": [{"loss": 7.0 + i / 3, "step": i, "eval_note": "x" * 240} for i in range(1, step + 1)],
            "loop": {"tr_loss": float("nan") if step == 2 else 0.0}}


def test_each_version_is_sealed_with_the_state_posted_after_its_step(tmp_path):
    got: list = []
    with world_of_one():
        a = Adapter()
        m = manager(str(tmp_path), a)
        assert m.restore_latest() is None
        assert m.arm_late(got.append, 64 << 10)
        # 40 entries, ~11 KB of JSON: over the 8 KiB of slack a header keeps for changing digits
        _steps(m, a, range(1, 41), post=_history)
        m.wait_idle()
        assert m.store.header_reserved > (64 << 10) and m.committed_version == 40
        m.close()
        b = Adapter()
        m2 = manager(str(tmp_path), b)
        m2.arm_late(got.append, 64 << 10)
        assert m2.restore_latest() == 40 and b.steps == 40
        parts, total = m2.stats()["restore_parts"], m2.stats()["restore_s"]   # where the restore's seconds went
        assert set(parts) == {"plan_s", "obtain_s", "apply_s"} and min(parts.values()) >= 0
        assert abs(sum(parts.values()) - total) < 1e-3, (parts, total)
        m2.close()
    section = got[-1]
    assert section["log_history"] == _history(40)["log_history"]


def test_a_step_that_failed_before_its_post_is_never_sealed(tmp_path):
    got: list = []
    with world_of_one():
        a = Adapter()
        m = manager(str(tmp_path), a)
        m.arm_late(got.append, 16 << 10)
        _steps(m, a, (1, 2), post=_history)
        m.wait_idle()
        _steps(m, a, (3,))          # step 3's snapshot is copied; the step fails before the Trainer posts
        m.quiesce()
        m.wait_idle()
        assert m.store.latest is not None and m.store.latest[0] == 2 and m.committed_version == 2
        assert m.timings.unsealed == [3]  # copied, then dropped unsealed
        m.close()
        b = Adapter()
        m2 = manager(str(tmp_path), b)
        m2.arm_late(got.append, 16 << 10)
        assert m2.restore_latest() == 2 and b.steps == 2
        m2.close()
    assert [e["step"] for e in got[-1]["log_history"]] == [1, 2]
    assert math.isnan(got[-1]["loop"]["tr_loss"])  # non-finite floats round-trip (the skeleton's encoding)


def test_an_unposted_step_is_sealed_without_the_state_at_the_next_snapshot(tmp_path):
    got: list = []
    with world_of_one():
        a = Adapter()
        m = manager(str(tmp_path), a)
        m.arm_late(got.append, 16 << 10)
        _steps(m, a, (1,))       # the framework's step-end hook never ran
        _steps(m, a, (2,))
        m.late.drop()
        m.wait_idle()
        # step 1 kept (the engine stays protected), 2 dropped
        assert m.store.latest is not None and m.store.latest[0] == 1
        assert list(m.late.sealed_without) == [(1, "cancelled")] and m.timings.unsealed == [2]
        m.close()
        m2 = manager(str(tmp_path), Adapter())
        m2.arm_late(got.append, 16 << 10)
        assert m2.restore_latest() == 1
        m2.close()
    assert got == [None]


def test_late_state_rules():
    late = LateState(lambda v: None, 1024, timeout_s=0.2)
    s1 = late.begin(1)
    assert not late.post(2, {"x": 1})                 # another version: ignored
    assert late.post(1, {"x": (1, 2)})
    assert not late.post(1, {"x": 3})                 # the first post is what was whole
    assert late_mod.decode(late.wait(s1, lambda: False)) == {"x": (1, 2)}
    s2 = late.begin(2)
    assert late.wait(s2, lambda: False) is None        # not posted within the deadline: sealed without
    s3 = late.begin(3)
    with pytest.raises(LateDropped, match="replaced at a hot-swap"):
        late.wait(s3, lambda: True)
    late.drop()
    with pytest.raises(LateDropped, match="dropped"):
        late.wait(s3, lambda: False)
    s4 = late.begin(4)
    threading.Timer(0.05, lambda: late.post(4, {"y": 1})).start()
    assert late_mod.decode(late.wait(s4, lambda: False)) == {"y": 1}
    with pytest.raises(ValueError, match="tensors"):
        late_mod.encode({"t": torch.zeros(1)})


