"""overhead_analyse.py on synthetic windows (no processes): the job's window is the slowest rank's, each mode's
ratio is paired with `none` round by round, and a verdict against a peer comes from per-round pairs, so a tie
never reads as a win."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import overhead_analyse as oa  # noqa: E402
import paired  # noqa: E402

TARGETS = {"ratio": {"small": None, "medium": 1.03}, "ci_upper": {"medium": 1.05}, "cpu_ratio": {"small": 1.04}}
STEPS = 8


def _block(r: int, mode: str, window: float, *, warmup: bool = False, cpu: float | None = None) -> dict:
    b = {"round": r, "mode": mode, "warmup": warmup, "step_s": [window / STEPS] * STEPS, "block_wall_s": window,
         "drain_s": 0.0, "cpu_s": window if cpu is None else cpu, "save_s": [0.001] * STEPS,
         "wait_s": [0.0] * STEPS, "main_thread_cpu_s": window / 2, "machine_busy_fraction": 0.9,
         "memory": {"rss": 1 << 30, "children_rss": 0}}
    if mode == "deadpool":
        b["snapshots"] = {k: [0.01] * STEPS for k in ("blocking_s", "copy_s", "seal_s", "replicate_s", "commit_s",
                                                       "copy_cpu_s", "seal_cpu_s", "replicate_cpu_s",
                                                       "commit_cpu_s")}
        b["snapshot_thread_cpu_s"] = 0.1
    return b


def _result(windows: list[dict[str, float]], *, size: str = "small", ranks: int = 2,
            slow_rank_extra: float = 0.0) -> dict:
    """A job's result: ``windows[r][mode]`` is rank 0's window in round r; the last rank is slower by
    ``slow_rank_extra`` in every window (the job's window is the slowest rank's)."""
    modes = list(windows[0])
    out = []
    for i in range(ranks):
        extra = slow_rank_extra if i == ranks - 1 else 0.0
        blocks = [_block(-1, m, 1.0, warmup=True) for m in modes]
        blocks += [_block(r, m, w + extra) for r, ws in enumerate(windows) for m, w in ws.items()]
        out.append({"rank": i, "node": i, "blocks": blocks, "state_bytes": 100, "shm_bytes": 300,
                    "slot_bytes": [100, 100], "replica_bytes": 100, "replica_sources": [1 - i], "holders": [1 - i],
                    "memory_end": {"rss": 1 << 30, "hwm": 1 << 30}})
    return {"ranks": out, "schedule": {"modes": modes}, "size": size, "layout": {"replication_factor": 1}}


def _tie(rounds: int = 10) -> list[dict[str, float]]:
    """deadpool and DLRover flash alternate which is faster; deadpool's own median ratio lands below DLRover's."""
    out = []
    for r in range(rounds):
        dp, dl = (10.2, 10.6) if r % 2 else (10.6, 10.2)
        if r < 3:
            dp = 10.0
        out.append({"none": 10.0, "deadpool": dp, "dlrover_flash": dl})
    return out


def test_a_tie_with_the_peer_is_no_difference_not_a_win():
    an = oa.analyze(_result(_tie()), TARGETS)
    modes = an["modes"]
    # the medians alone would read as a win: deadpool 1.02 against DLRover's 1.04 ...
    assert modes["deadpool"]["window_ratio"] < modes["dlrover_flash"]["window_ratio"]
    # ... the pairs do not
    pc = an["paired"]["dlrover_flash"]["window"]
    assert pc["verdict"] == paired.NO_DIFFERENCE
    assert pc["rounds"] == 10
    target = an["targets"]["peer"]
    assert target["against"] == "dlrover_flash" and target["comparison"]["verdict"] == paired.NO_DIFFERENCE
    assert target["met"]  # no worse
    assert "ratio" not in an["targets"]  # no fixed bound for small


def test_worse_than_the_peer_in_every_round_is_worse_and_not_met():
    windows = [{"none": 10.0 + r, "deadpool": (10.0 + r) * 1.08, "dlrover_flash": (10.0 + r) * (1.01 + 0.005 * r)}
               for r in range(10)]
    an = oa.analyze(_result(windows, size="medium"), TARGETS)
    assert an["paired"]["dlrover_flash"]["window"]["verdict"] == paired.WORSE
    assert not an["targets"]["peer"]["met"]
    assert an["targets"]["ratio"]["target"] == 1.03 and not an["targets"]["ratio"]["met"]


def test_the_job_window_is_the_slowest_ranks_and_ratios_pair_with_none():
    windows = [{"none": 10.0, "deadpool": 11.0}, {"none": 20.0, "deadpool": 22.0}]
    an = oa.analyze(_result(windows, slow_rank_extra=1.0), TARGETS)
    measured = [b for b in an["blocks"] if not b["warmup"]]
    assert [b["window_s"] for b in measured] == [11.0, 12.0, 21.0, 23.0]
    assert an["modes"]["deadpool"]["window_ratios"] == pytest.approx([12.0 / 11.0, 23.0 / 21.0])
    # the CPU is the job's: every rank's summed
    assert measured[0]["cpu_s"] == pytest.approx(10.0 + 11.0)
    assert an["paired"] == {}  # no peer in this job


def test_memory_bound_and_no_cpu_profile_without_a_floor():
    an = oa.analyze(_result(_tie(3)), TARGETS)
    assert an["memory"]["bound_ratio"] == 3
    assert an["memory"]["max_ratio"] == 3.0
    assert an["cpu"] is None
