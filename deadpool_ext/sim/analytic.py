"""Closed-form checkpoint-interval results the simulator is checked against.

* Young (1974), "A first order approximation to the optimum checkpoint interval": ``W = sqrt(2 delta M)``.
* Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22:
  ``W = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta`` for ``delta < 2M``, else ``M``.

``delta``: time one checkpoint costs the job; ``M``: mean time between failures; ``W``: compute time between
checkpoints. The first-order expected waste per unit of wall time, used to compare against simulated goodput,
is ``delta / W + (W / 2 + R) / M`` with ``R`` the restart time.
"""
from __future__ import annotations

import math


def young_interval(delta_s: float, mtbf_s: float) -> float:
    if delta_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need delta >= 0 and M > 0, got delta={delta_s}, M={mtbf_s}")
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    if delta_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need delta >= 0 and M > 0, got delta={delta_s}, M={mtbf_s}")
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def first_order_waste(interval_s: float, delta_s: float, mtbf_s: float, restart_s: float) -> float:
    """Fraction of wall time lost to checkpoints, rework and restarts (Young's first-order model)."""
    if interval_s <= 0:
        raise ValueError(f"interval must be > 0, got {interval_s}")
    return delta_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s
