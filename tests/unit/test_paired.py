"""Paired comparisons (benchmarks/paired.py): every "X against peer Y" verdict comes from per-round pairs in one
job, with a bootstrap interval on the ratio of ratios; a tie never reads as a win."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import paired  # noqa: E402


def _blocks(rounds: list[dict[str, float]], steps: int = 8, warmup: dict[str, float] | None = None) -> list[dict]:
    out = []
    if warmup:
        out += [{"round": -1, "mode": m, "warmup": True, "steps": steps, "window_s": w} for m, w in warmup.items()]
    for r, windows in enumerate(rounds):
        out += [{"round": r, "mode": m, "warmup": False, "steps": steps, "window_s": w} for m, w in windows.items()]
    return out


def test_verdict_needs_the_whole_interval_on_one_side_of_one():
    assert paired.verdict((0.90, 0.99)) == paired.BETTER
    assert paired.verdict((1.01, 1.10)) == paired.WORSE
    assert paired.verdict((0.95, 1.03)) == paired.NO_DIFFERENCE
    assert paired.verdict((0.95, 1.0)) == paired.NO_DIFFERENCE
    assert paired.verdict(None) == paired.NO_DIFFERENCE


def test_a_tie_round_by_round_is_not_a_win_even_when_the_medians_favour_x():
    # X and Y alternate which is faster; X's own median ratio to `none` lands below Y's (1.04 vs 1.06), the old
    # comparison of X's interval with Y's point estimate called that a win
    rounds = []
    for r in range(10):
        x, y = (1.02, 1.06) if r % 2 else (1.06, 1.02)
        if r < 2:
            x = 1.0
        rounds.append({"none": 10.0, "deadpool": 10.0 * x, "dlrover_flash": 10.0 * y})
    c = paired.compare_blocks(_blocks(rounds), "deadpool", "dlrover_flash")
    assert len(c.ratios) == 10
    assert c.verdict == paired.NO_DIFFERENCE
    assert c.ci is not None and c.ci[0] < 1.0 < c.ci[1]
    assert c.no_worse


def test_better_and_worse_when_every_round_agrees():
    rounds = [{"none": 10.0 + r, "deadpool": (10.0 + r) * 1.05, "peer": (10.0 + r) * (1.10 + 0.01 * (r % 3))}
              for r in range(10)]
    better = paired.compare_blocks(_blocks(rounds), "deadpool", "peer")
    assert better.verdict == paired.BETTER and better.x_faster_rounds == 10
    worse = paired.compare_blocks(_blocks(rounds), "peer", "deadpool")
    assert worse.verdict == paired.WORSE and not worse.no_worse
    assert "by " in paired.sentence(worse.to_dict())


def test_the_baseline_cancels_within_a_round():
    # the machine drifts 3x from round to round; the pair within a round stays 0.9
    rounds = [{"none": base, "deadpool": base * 0.99, "peer": base * 1.1} for base in (1.0, 3.0, 1.5, 2.0, 0.7)]
    c = paired.compare_blocks(_blocks(rounds), "deadpool", "peer")
    assert all(abs(v - 0.9) < 1e-12 for v in c.ratios)
    assert c.verdict == paired.BETTER


def test_warmup_and_rounds_missing_a_side_are_left_out():
    rounds = [{"none": 10.0, "deadpool": 11.0, "peer": 12.0}, {"none": 10.0, "deadpool": 11.0},
              {"deadpool": 11.0, "peer": 12.0}, {"none": 10.0, "deadpool": 10.0, "peer": 12.5}]
    blocks = _blocks(rounds, warmup={"none": 1.0, "deadpool": 100.0, "peer": 1.0})
    assert paired.round_pairs(blocks, "deadpool", "peer") == pytest.approx([11.0 / 12.0, 10.0 / 12.5])


@pytest.mark.parametrize("rounds", [1, 2])
def test_under_three_rounds_there_is_no_interval_and_no_verdict(rounds):
    c = paired.compare_blocks(_blocks([{"none": 10.0, "deadpool": 10.0, "peer": 20.0}] * rounds), "deadpool", "peer")
    assert c.ci is None and c.verdict == paired.NO_DIFFERENCE and not c.no_worse
    assert "no interval: under 3 rounds" in paired.sentence(c.to_dict())
