"""The numerical canary's pure decisions (recovery/canary.py), its config, the quarantine marks in memory
(snapshot/quarantine.py) and on tier-3 storage (persist/layout.py), the poison fault's parsing, and the watch's
check and rollback on a stand-in runtime (integrations/canary.py), without processes."""
from __future__ import annotations

import math
import os

import pytest

from deadpool_ext.chaos.poison import Poison
from deadpool_ext.config import ConfigError, DeadpoolConfig
from deadpool_ext.recovery import canary as rules
from deadpool_ext.recovery.canary import Bounds, Rollback, Stop, after_failure, judge, learn, older_versions


def test_learn_keeps_the_newest_window_of_finite_values():
    b = Bounds()
    for i in range(5):
        b = learn(b, float(i), 10.0 + i, window=3)
    b = learn(b, math.nan, None, window=3)
    b = learn(b, math.inf, -math.inf, window=3)
    assert b == Bounds(losses=(2.0, 3.0, 4.0), grad_norms=(12.0, 13.0, 14.0))


def test_bounds_json_round_trip_and_strict_reading():
    b = Bounds(losses=(1.5, 2.0), grad_norms=(0.25,))
    assert Bounds.from_json(b.to_json()) == b
    for bad in (None, [], {"losses": [1.0]}, {"losses": [1.0], "grad_norms": [], "x": 1},
                {"losses": ["1"], "grad_norms": []}, {"losses": [True], "grad_norms": []},
                {"losses": [float("nan")], "grad_norms": []}, {"losses": [1.0] * (rules.MAX_VALUES + 1),
                                                                "grad_norms": []}):
        assert Bounds.from_json(bad) is None, bad


def test_judge():
    b = Bounds(losses=(2.0, 3.0), grad_norms=(1.0, 0.5))
    assert judge(b, 3.0, 1.0, factor=10).ok
    assert judge(b, 29.9, 9.9, factor=10).ok
    assert judge(b, None, None, factor=10).ok  # nothing measured: nothing to check
    assert not judge(b, 30.5, 1.0, factor=10).ok
    assert not judge(b, 3.0, 10.5, factor=10).ok
    assert not judge(b, math.nan, 1.0, factor=10).ok
    assert not judge(b, 3.0, math.inf, factor=10).ok
    assert judge(b, -29.0, 1.0, factor=10).ok and not judge(b, -31.0, 1.0, factor=10).ok  # magnitudes
    # no recent values (a version taken before any step was learned): finite is enough
    assert judge(Bounds(), 1e9, 1e9, factor=10).ok and not judge(Bounds(), math.nan, None, factor=10).ok


def test_after_failure_rolls_back_then_stops():
    assert after_failure(6, (), 2, "loss nan", 7) == Rollback(6, (6,))
    assert after_failure(5, (6,), 2, "loss nan", 6) == Rollback(5, (5, 6))
    stop = after_failure(4, (5, 6), 2, "loss nan", 5)
    assert isinstance(stop, Stop) and stop.version == 4 and "\n" not in stop.line
    assert isinstance(after_failure(6, (), 0, "loss nan", 7), Stop)  # max_rollbacks 0: the first failure stops
    assert after_failure(6, (6,), 1, "x", 7) == Rollback(6, (6,))  # the same version counted once


def test_older_versions():
    assert older_versions([5, 6, 4, 7], 6, (4,)) == [5]
    assert older_versions([6], 6, ()) == []


def test_config_section():
    cfg = DeadpoolConfig.from_dict({"canary": {"factor": 4, "steps": 2}})
    assert cfg.canary.factor == 4.0 and cfg.canary.steps == 2 and cfg.canary.enabled
    assert DeadpoolConfig.from_dict({}).canary.max_rollbacks == 2
    for bad, key in (({"facter": 3}, "deadpool.canary.facter"), ({"factor": 1}, "deadpool.canary.factor"),
                     ({"factor": float("inf")}, "deadpool.canary.factor"), ({"steps": 0}, "deadpool.canary.steps"),
                     ({"max_rollbacks": -1}, "deadpool.canary.max_rollbacks"),
                     ({"enabled": 1}, "deadpool.canary.enabled")):
        with pytest.raises(ConfigError) as err:
            DeadpoolConfig.from_dict({"canary": bad})
        assert err.value.key == key, (bad, err.value.key)


def test_poison_spec():
    p = Poison.parse("step=6,scale=16,marker=/tmp/x")
    assert p == Poison(6, 16.0, "/tmp/x") and Poison.parse(p.render()) == p
    for bad in ("step=0,marker=/x", "marker=/x", "step=1,marker=/x,rank=1", "step=a,marker=/x"):
        with pytest.raises(ValueError):
            Poison.parse(bad)


# -- the quarantine marks ------------------------------------------------------------------------------------------

def _blob(directory: str, name: str, version: int, rank: int) -> None:
    import torch

    from deadpool_ext.memory.shm import ShmSegment
    from deadpool_ext.snapshot.slots import blob_nbytes, write_blob

    obj = {"tensors": {"w": torch.full((4,), float(version))}, "state": {}}
    meta = {"version": version, "rank": rank, "world_size": 2}
    seg = ShmSegment.create(name, blob_nbytes(obj, meta), root=directory)
    try:
        write_blob(seg.buf, obj, meta)
    finally:
        seg.close()


def _version_of(directory: str, name: str) -> int | None:
    from deadpool_ext.memory.shm import ShmSegment
    from deadpool_ext.snapshot.slots import probe_slot

    seg = ShmSegment.open(name, root=directory)
    try:
        meta, _ = probe_slot(seg.buf, verify=True)
    finally:
        seg.close()
    return None if meta is None else int(meta["version"])


def test_mark_bad_marks_own_slots_and_held_replicas_of_the_version_only(tmp_path):
    from deadpool_ext.snapshot.quarantine import mark_bad, read_record, write_record

    d = str(tmp_path)
    files = {"deadpool.j.snap.r1.0": 6, "deadpool.j.snap.r1.1": 5, "deadpool.j.replica.r0.h1b0": 6,
             "deadpool.j.replica.r0.h1b1": 5, "deadpool.j.snap.r0.0": 6, "deadpool.j.replica.r1.h0b0": 6,
             "deadpool.other.snap.r1.0": 6, "deadpool.j.diff.r1.3": 7, "deadpool.j.diff.r1.2": 4}
    for name, v in files.items():
        _blob(d, name, v, 1)
    marked = mark_bad(d, "j", 1, 6)
    assert marked == ["deadpool.j.diff.r1.3", "deadpool.j.replica.r0.h1b0", "deadpool.j.snap.r1.0"]
    after = {name: _version_of(d, name) for name in files}
    assert after == {**files, "deadpool.j.snap.r1.0": None, "deadpool.j.replica.r0.h1b0": None,
                     "deadpool.j.diff.r1.3": None}  # a newer version (taken from the failed one) too
    from deadpool_ext.memory.shm import ShmSegment
    from deadpool_ext.snapshot.slots import probe_slot

    seg = ShmSegment.open("deadpool.j.snap.r1.0", root=d)
    try:
        assert probe_slot(seg.buf, verify=True) == (None, "quarantined by the numerical canary")
    finally:
        seg.close()
    assert read_record(d, "j", 1) == ()
    write_record(d, "j", 1, (6, 5, 6))
    assert read_record(d, "j", 1) == (5, 6) and read_record(d, "j", 0) == ()
    with open(os.path.join(d, "deadpool.j.quarantine.r0.json"), "w") as fh:
        fh.write('{"versions": ["6"]}')
    assert read_record(d, "j", 0) == ()  # a malformed record counts nothing


def test_quarantined_tier3_base_is_not_a_load_candidate(tmp_path, monkeypatch):
    from deadpool_ext.persist import layout
    from deadpool_ext.persist.storage import open_storage

    storage = open_storage(str(tmp_path))
    versions = [layout.VersionInfo(v, layout.version_tag(v), {"total_bytes": 1}) for v in (4, 6)]
    monkeypatch.setattr(layout, "list_versions", lambda storage, key=None: versions)
    monkeypatch.setattr(layout, "read_latest", lambda storage: None)
    os.makedirs(tmp_path / "global_step4")
    assert layout.quarantine_base(storage, 5, why="test") == []  # no base of step 5 or newer: nothing marked
    os.makedirs(tmp_path / "global_step6")
    assert layout.quarantine_base(storage, 6, why="test") == [6]
    refused: list = []
    assert [v.version for v in layout.load_candidates(storage, refused=refused)] == [4]
    assert [v.version for v in refused] == [6] and "quarantined" in refused[0].problem


# -- the watch on a stand-in runtime --------------------------------------------------------------------------------

class _Runtime:
    """What the watch reads of a runtime: no snapshots (a one-rank world: no agreement to make)."""

    snapshots = None

    def __init__(self) -> None:
        self.persist = type("P", (), {"enabled_steps": True})()


def test_watch_learns_checks_and_raises_on_a_bad_step(monkeypatch):
    from deadpool_ext.config import CanaryConfig
    from deadpool_ext.integrations import canary as watch_mod
    from deadpool_ext.integrations.canary import CanaryRollback, CanaryWatch

    events: list[dict] = []
    monkeypatch.setattr(watch_mod, "write_event", lambda **e: events.append(e))
    rt = _Runtime()
    w = CanaryWatch(CanaryConfig(factor=4, steps=2, window=4), rank=0)
    w.grad_norm = lambda: 1.0
    for step, loss in enumerate((5.0, 4.0, 3.0), 1):
        w.observe_loss(loss)
        w.after_step(rt, step)  # type: ignore[arg-type]
    state = w.client_state()
    assert Bounds.from_json(state[rules.KEY]) == Bounds(losses=(5.0, 4.0, 3.0), grad_norms=(1.0, 1.0, 1.0))
    # a restore of step 3 (its bounds) armed: held; a good step, then a bad one
    w.restored(state)
    w.arm(rt, 3)  # type: ignore[arg-type]
    assert w.holds() and not rt.persist.enabled_steps
    w.observe_loss(3.0)
    w.after_step(rt, 4)  # type: ignore[arg-type]
    w.observe_loss(2.0)
    w.observe_loss(100.0)  # the step's loss is its micro-batches' mean: 51 > 4 x 5
    with pytest.raises(CanaryRollback) as err:
        w.after_step(rt, 5)  # type: ignore[arg-type]
    assert (err.value.version, err.value.step) == (3, 5) and not w.holds()
    assert [e["event"] for e in events] == ["canary_armed", "canary_failed"]
    # armed again, both steps pass: snapshots and tier 3 go on
    w.arm(rt, 3)  # type: ignore[arg-type]
    for step in (4, 5):
        w.observe_loss(3.0)
        w.after_step(rt, step)  # type: ignore[arg-type]
    assert not w.holds() and rt.persist.enabled_steps and events[-1]["event"] == "canary_passed"


def test_watch_off_keeps_nothing():
    from deadpool_ext.config import CanaryConfig
    from deadpool_ext.integrations.canary import CanaryWatch

    w = CanaryWatch(CanaryConfig(enabled=False), rank=0)
    w.observe_loss(float("nan"))
    w.arm(_Runtime(), 3)  # type: ignore[arg-type]
    w.after_step(_Runtime(), 4)  # type: ignore[arg-type]
    assert w.client_state() == {} and not w.holds()


class _Snapshots:
    def __init__(self, directory: str) -> None:
        self.store = type("S", (), {"dir": directory})()
        self.job_id = "j"
        self.active = True
        self.late = None

    def wait_idle(self) -> None:
        pass


class _Restoring(_Runtime):
    """A runtime whose restore gives ``versions`` in turn (0: nothing left)."""

    def __init__(self, directory: str, versions: list[int]) -> None:
        super().__init__()
        self.snapshots = _Snapshots(directory)  # type: ignore[assignment]
        self._versions = versions
        self.restored_version = 0

    def _resume(self) -> int:
        self.restored_version = self._versions.pop(0)
        return self.restored_version or 99


def test_roll_back_restores_the_next_older_version_then_the_guard_stops(tmp_path, monkeypatch):
    from deadpool_ext.config import CanaryConfig
    from deadpool_ext.integrations import canary as watch_mod
    from deadpool_ext.integrations.canary import CanaryRollback, CanaryStop, CanaryWatch
    from deadpool_ext.snapshot.quarantine import read_record

    events: list[dict] = []
    monkeypatch.setattr(watch_mod, "write_event", lambda **e: events.append(e))
    d = str(tmp_path)
    rt = _Restoring(d, [5, 4])
    w = CanaryWatch(CanaryConfig(max_rollbacks=2), rank=0)
    assert w.roll_back(rt, CanaryRollback(6, 7, "loss nan")) == 5  # type: ignore[arg-type]
    assert w.roll_back(rt, CanaryRollback(5, 6, "loss nan")) == 4  # type: ignore[arg-type]
    assert [(e["event"], e["restored_version"]) for e in events] == [("canary_rollback", 5), ("canary_rollback", 4)]
    with pytest.raises(CanaryStop) as stop:  # a third failed version: max_rollbacks 2
        w.roll_back(rt, CanaryRollback(4, 5, "loss nan"))  # type: ignore[arg-type]
    assert stop.value.code == rules.CANARY_EXIT == 6 and "\n" not in stop.value.line
    assert events[-1]["event"] == "canary_stop" and events[-1]["quarantined"] == [4, 5, 6]
    assert read_record(d, "j", 0) == (4, 5, 6)
    # a restarted process counts them: its first failure stops at once
    w2 = CanaryWatch(CanaryConfig(max_rollbacks=2), rank=0)
    w2.arm(rt, 3)  # type: ignore[arg-type]
    with pytest.raises(CanaryStop):
        w2.roll_back(_Restoring(d, [2]), CanaryRollback(3, 4, "loss nan"))  # type: ignore[arg-type]


def test_roll_back_with_nothing_older_in_memory_stops(tmp_path, monkeypatch):
    from deadpool_ext.config import CanaryConfig
    from deadpool_ext.integrations import canary as watch_mod
    from deadpool_ext.integrations.canary import CanaryRollback, CanaryStop, CanaryWatch

    events: list[dict] = []
    monkeypatch.setattr(watch_mod, "write_event", lambda **e: events.append(e))
    w = CanaryWatch(CanaryConfig(), rank=0)
    with pytest.raises(CanaryStop) as stop:
        w.roll_back(_Restoring(str(tmp_path), [0]), CanaryRollback(6, 7, "loss nan"))  # type: ignore[arg-type]
    assert stop.value.code == 6 and [e["event"] for e in events] == ["canary_stop"]
