"""Shrink and grow: what a change in the number of data-parallel replicas costs (``cluster.no_spare_policy``
``shrink``).

When the job needs a node and the spare pool is empty, the survivors go on with fewer data-parallel replicas
instead of waiting. The global batch is kept by raising gradient accumulation, so in the data-parallel-bound
model an iteration takes ``replicas / live`` times as long: throughput is in proportion to the live replicas.
When a repaired node returns, the job grows back at the next step boundary. Both events restart the survivors'
processes at the new world size and reshard the training state from the in-memory snapshots (peer memory, no
storage read); a restart from storage (memory lost) reshards as it reads, at the cost of the read.

Pure functions over :class:`~deadpool_ext.sim.policies.Restore` and :class:`~deadpool_ext.sim.costs.Derived`, so
the policies stay what they were (which version survives, what a recovery costs) and the engine
(:mod:`deadpool_ext.sim.engine`) keeps the pool, which replicas are out, and time.
"""
from __future__ import annotations

from .costs import Derived
from .policies import Restore

GROW = "grow"
"""``Restore.source`` of a planned grow: the survivors' live state, not a checkpoint (not counted as a restore)."""


def replicas(d: Derived) -> int:
    """Data-parallel replicas of the full-size job (``nodes / shrink_unit_nodes``)."""
    return d.nodes // d.shrink_unit_nodes


def iteration_s(d: Derived, live: int) -> float:
    """Time per iteration with ``live`` of the replicas: the same global batch through fewer of them."""
    return d.iteration_s * replicas(d) / live


def reshard_s(d: Derived, live: int) -> float:
    """Moving the state onto ``live`` replicas: the fixed restore cost, then each node fetches up to its whole
    new shard from peers (shards are contiguous ranges that shift, so a node at the far end of the range needs
    nearly all of it); the shard is ``replicas / live`` times a full-size node's share."""
    return d.restore_fixed_s + d.peer_fetch_s * replicas(d) / live


def shrink(plan: Restore, d: Derived, live: int) -> Restore:
    """A failure recovery that also changes the world size (to ``live`` replicas). The policy's choice of version
    and source stands; the survivors restart their processes (at least ``startup_s``: a whole-job restart
    already pays more, a hot-swap's in-process rebuild is replaced), and a restore from memory becomes a reshard
    from peer memory. Detection and the rollback are the policy's, as for a hot-swap."""
    phases = dict(plan.phases)
    phases["restart"] = max(phases.get("restart", 0.0), d.startup_s)
    if plan.source != "storage":
        phases["load"] = max(phases.get("load", 0.0), reshard_s(d, live))
    return Restore(plan.version, plan.source, phases)


def grow(d: Derived, version: int, live: int) -> Restore:
    """A planned grow to ``live`` replicas at the boundary after iteration ``version``: nothing to detect (the
    repaired node registers), the survivors copy the live state of that step to host memory, restart at the
    larger world size and reshard from peer memory. Only the iteration in flight is lost."""
    return Restore(version, GROW, {"restart": d.startup_s, "load": d.d2h_s + reshard_s(d, live)})
