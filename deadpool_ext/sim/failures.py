"""The failure process: seeded traces of (time, kind, node), independent of what the job does.

Interruptions arrive as a Poisson process at ``rate_per_gpu_hour x GPUs``; each hits one node chosen uniformly
and is a node loss (hardware: the node and its host memory are gone) with probability ``node_lost_fraction``,
else transient (the processes die, the node and its memory survive). Cluster-wide outages, which lose every
node's memory, are a second, independent Poisson process.

A trace depends only on the seed, the trial number and the failure parameters, never on the policy: every policy
is run against the same traces (common random numbers), so differences between policies are not sampling noise.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from .costs import Derived


class FailureKind(enum.Enum):
    TRANSIENT = "transient"
    """Processes die; the node and its host memory (tier 1) survive."""
    NODE_LOST = "node_lost"
    """The node is gone with its memory; its state survives only as a peer replica or in storage."""
    CLUSTER = "cluster"
    """Every node's memory is lost; only persistent storage survives."""


@dataclass(frozen=True, slots=True)
class Failure:
    time_s: float
    kind: FailureKind
    node: int
    """Logical node slot hit (0..nodes-1); -1 for a cluster outage."""


def _stream(seed: int, trial: int, name: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random, independent of PYTHONHASHSEED: reproducible
    # everywhere, and one stream per process so switching outages on or off leaves node failures unchanged.
    return random.Random(f"deadpool-sim:{seed}:{trial}:{name}")


def _poisson_times(rng: random.Random, rate_per_s: float, horizon_s: float) -> list[float]:
    times: list[float] = []
    if rate_per_s <= 0:
        return times
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def sample_trace(d: Derived, horizon_s: float, *, seed: int, trial: int) -> list[Failure]:
    """All failures of one trial, sorted by time."""
    rng = _stream(seed, trial, "node")
    out = []
    for t in _poisson_times(rng, d.failure_rate_per_s, horizon_s):
        kind = FailureKind.NODE_LOST if rng.random() < d.node_lost_fraction else FailureKind.TRANSIENT
        out.append(Failure(t, kind, rng.randrange(d.nodes)))
    out += [Failure(t, FailureKind.CLUSTER, -1)
            for t in _poisson_times(_stream(seed, trial, "outage"), d.outage_rate_per_s, horizon_s)]
    out.sort(key=lambda f: f.time_s)
    return out
