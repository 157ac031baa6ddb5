"""The numerical canary after a restore (issue 46, part 2), end to end: a version whose checksums are valid but whose
values are poisoned (the chaos harness's ``poison`` fault, before sealing) is restored after a torchrun restart,
caught within 3 steps, quarantined, and the older version restored instead; the losses from that fallback equal,
bit for bit, those of a run that restored the older version directly."""
from __future__ import annotations

import os

import pytest

from deadpool_ext.chaos import at_step
from deadpool_ext.chaos.at_step import StepFault
from deadpool_ext.chaos.poison import ENV as POISON_ENV
from deadpool_ext.chaos.poison import Poison
from deadpool_ext.launcher.contract import TIMELINE
from deadpool_ext.recovery.timeline import read_events
from tests.integration.helpers import memory_tier_config, pretrain, restore_of

pytestmark = pytest.mark.slow
ITERS = 10
POISONED = 6


def _events(path: str, name: str) -> list[dict]:
    return [e for e in read_events(path) if e.get("event") == name] if os.path.exists(path) else []


def test_poisoned_restore_is_caught_and_rolled_back(tmp_path, shm_root):
    # Inline snapshots: the version of the step a rank is killed after is sealed, replicated and committed on every
    # rank before the kill, so the restart restores exactly that (poisoned) version, the previous one in the other
    # slot.
    cfg = memory_tier_config(tmp_path, 1, shm_root, snapshot={"interval": 1, "background": False})

    def run(name: str, kill_after: int, poison: bool) -> tuple[object, dict[int, float], str]:
        timeline = os.path.join(str(tmp_path), f"{name}.timeline")
        env = {at_step.ENV: StepFault("kill", kill_after, 1, os.path.join(str(tmp_path), f"{name}.fault")).render(),
               TIMELINE: timeline}
        if poison:
            env[POISON_ENV] = Poison(POISONED, 16.0, os.path.join(str(tmp_path), f"{name}.poison")).render()
        res, metrics, _ = pretrain(tmp_path, cfg, iters=ITERS, max_restarts=1, name=name,
                                   env=at_step.harness_env(env))
        assert res.returncode == 0, res.output[-4000:]
        return res, metrics, timeline

    res, poisoned, timeline = run("poisoned", POISONED, True)
    failed = _events(timeline, "canary_failed")
    rollbacks = _events(timeline, "canary_rollback")
    armed = _events(timeline, "canary_armed")
    # Every rank restored the poisoned step, caught it within 3 steps, quarantined it and restored the one before.
    assert sorted(e["rank"] for e in failed) == [0, 1], failed
    assert all(e["version"] == POISONED and POISONED < e["step"] <= POISONED + 3 for e in failed), failed
    assert sorted((e["rank"], e["version"], e["restored_version"]) for e in rollbacks) == [
        (0, POISONED, POISONED - 1), (1, POISONED, POISONED - 1)], rollbacks
    assert all(e["marked"] >= 1 for e in rollbacks), rollbacks  # own slot and the replica held, on every rank
    passed = _events(timeline, "canary_passed")
    assert sorted((e["rank"], e["version"]) for e in passed) == [(0, POISONED - 1), (1, POISONED - 1)], passed
    assert restore_of(res)["version"] == POISONED - 1
    assert not _events(timeline, "canary_stop")
    t0 = min(e["time"] for e in armed if e["version"] == POISONED)
    steps = max(e["step"] for e in failed) - POISONED
    print(f"canary: detected {steps} step(s) after the restore of step {POISONED}, rolled back to step "
          f"{POISONED - 1} {max(e['time'] for e in rollbacks) - t0:.2f} s after the restore")

    # The run that restored the older version directly (killed after it; nothing poisoned).
    _, direct, dtimeline = run("direct", POISONED - 1, False)
    assert [e["version"] for e in _events(dtimeline, "canary_passed")] == [POISONED - 1] * 2
    assert sorted(poisoned) == sorted(direct) == list(range(1, ITERS + 1))
    assert poisoned == direct  # bit for bit: every step, the fallback's included
