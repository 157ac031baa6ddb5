"""Paired comparisons of two modes measured in the same job: the one rule every "X against peer Y" verdict follows.

Each round of an overhead job runs a window of every mode side by side. For each round, the ratio of ratios
``(X / none) / (Y / none)`` (the baseline cancels, and with it the machine's drift during that round); the figure
is the median over rounds, with a percentile-bootstrap 90% interval of that median over the rounds. The verdict:

- "better": the interval's upper end is below 1.0 (X costs less than Y, beyond the round-to-round noise);
- "worse": its lower end is above 1.0;
- "no difference measured": anything else, including too few rounds for an interval.

Comparing X's interval with Y's point estimate (what the analysis did before) ignores Y's own spread: two modes
that tie round by round read as a win whenever X's median happens to land below Y's.

Pure: no I/O, nothing imported beyond ``common``'s statistics. Used by ``overhead_analyse.py`` (the per-job
analysis), ``overhead_render.py`` and ``headlines.py`` (what they print), ``gpu_check_analyse.py``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common import bootstrap_median_ci, median

BETTER, WORSE, NO_DIFFERENCE = "better", "worse", "no difference measured"
LEVEL = 0.90
MIN_ROUNDS = 3
"""Fewer pairs give no interval, so no verdict: a bootstrap over two values is only their range."""


@dataclass(frozen=True, slots=True)
class Comparison:
    """X against Y, paired round by round in one job."""

    x: str
    y: str
    ratios: tuple[float, ...]
    """Per round, (X / base) / (Y / base): below 1.0, X cost less than Y in that round."""
    median: float | None
    ci: tuple[float, float] | None
    """The percentile-bootstrap interval of the median over rounds, at :data:`LEVEL`; None under
    :data:`MIN_ROUNDS` rounds."""
    verdict: str
    """:data:`BETTER`, :data:`WORSE` or :data:`NO_DIFFERENCE`."""
    x_faster_rounds: int
    """Rounds in which X's ratio was below Y's."""

    @property
    def no_worse(self) -> bool:
        """The interval reaches down to 1.0 or below: X is not measured worse than Y."""
        return self.ci is not None and self.ci[0] <= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y, "ratios": list(self.ratios), "median": self.median,
                "ci90": list(self.ci) if self.ci else None, "verdict": self.verdict,
                "x_faster_rounds": self.x_faster_rounds, "rounds": len(self.ratios), "no_worse": self.no_worse}


def verdict(ci: Sequence[float] | None) -> str:
    """"better" when the interval lies below 1.0, "worse" when above, else "no difference measured"."""
    if not ci or len(ci) != 2:
        return NO_DIFFERENCE
    lo, hi = ci
    if hi < 1.0:
        return BETTER
    if lo > 1.0:
        return WORSE
    return NO_DIFFERENCE


def compare_ratios(x: str, y: str, ratios: Iterable[float], *, resamples: int = 2000, seed: int = 0) -> Comparison:
    """The comparison from per-round ratios of ratios already paired (one value per round)."""
    vals = tuple(float(r) for r in ratios)
    ci = bootstrap_median_ci(list(vals), level=LEVEL, resamples=resamples, seed=seed) \
        if len(vals) >= MIN_ROUNDS else None
    ci_t = (float(ci[0]), float(ci[1])) if ci and ci[0] is not None and ci[1] is not None else None
    return Comparison(x=x, y=y, ratios=vals, median=median(vals), ci=ci_t, verdict=verdict(ci_t),
                      x_faster_rounds=sum(1 for v in vals if v < 1.0))


def _per_step(key: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda b: float(b[key]) / max(1, int(b.get("steps") or 1))


def round_pairs(blocks: Iterable[Mapping[str, Any]], x: str, y: str, *, base: str = "none",
                key: str = "window_s") -> list[float]:
    """Per measured round holding a block of ``x``, ``y`` and ``base``: ``(x / base) / (y / base)`` of ``key`` per
    step. ``blocks``: the job's blocks (``round``, ``mode``, ``warmup``, ``steps``, ``key``); warm-up blocks and
    rounds missing either side are left out."""
    per: dict[Any, dict[str, float]] = {}
    value = _per_step(key)
    for b in blocks:
        if b.get("warmup"):
            continue
        per.setdefault(b["round"], {})[b["mode"]] = value(b)
    out = []
    for r in sorted(per, key=lambda k: (str(type(k)), k)):
        m = per[r]
        if x in m and y in m and base in m and m[base] > 0 and m[y] > 0:
            out.append((m[x] / m[base]) / (m[y] / m[base]))
    return out


def compare_blocks(blocks: Iterable[Mapping[str, Any]], x: str, y: str, *, base: str = "none",
                   key: str = "window_s") -> Comparison:
    """X against Y from one job's blocks, paired round by round (:func:`round_pairs`)."""
    return compare_ratios(x, y, round_pairs(list(blocks), x, y, base=base, key=key))


def sentence(c: Mapping[str, Any], *, x_label: str | None = None, y_label: str | None = None) -> str:
    """One line for a rendered table or headline: ``X / Y paired per round 1.001 (90% CI 0.953-1.030; X faster
    in 5 of 10 rounds): no difference measured``; a "worse" one says by how much at least."""
    x, y = x_label or c["x"], y_label or c["y"]
    ci = c.get("ci90")
    med = c.get("median")
    ci_text = f"90% CI {ci[0]:.3f}-{ci[1]:.3f}; " if ci else f"no interval: under {MIN_ROUNDS} rounds; "
    text = (f"{x} / {y}, paired per round, {med:.3f} ({ci_text}{x} faster in {c['x_faster_rounds']} of "
            f"{c['rounds']} rounds): **{c['verdict']}**" if med is not None else
            f"{x} / {y}: no round measured both: **{c['verdict']}**")
    if c["verdict"] == WORSE and ci:
        text += f" (by {100 * (ci[0] - 1):.1f}% at least, {100 * (med - 1):.1f}% at the median)"
    elif c["verdict"] == BETTER and ci:
        text += f" (by {100 * (1 - ci[1]):.1f}% at least, {100 * (1 - med):.1f}% at the median)"
    return text


__all__ = ["BETTER", "Comparison", "LEVEL", "MIN_ROUNDS", "NO_DIFFERENCE", "WORSE", "compare_blocks", "compare_ratios",
           "round_pairs", "sentence", "verdict"]
