"""Per-phase times derived from :class:`~deadpool_ext.sim.params.Params`: bytes over bandwidths, plus the fixed
software costs. Pure arithmetic, one place, so every policy prices the same phase the same way.

State is assumed fully sharded (ZeRO-3 / FSDP-like): each node holds ``state / nodes`` bytes and each GPU
``state / gpus``. Every node moves its share in parallel, so a phase takes one node's bytes over that node's
bandwidth - for persistent storage the smaller of the node's cap and its share of the aggregate bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

from .params import GB, Params


@dataclass(frozen=True, kw_only=True, slots=True)
class Derived:
    """Times in seconds for one cluster size; see the module docstring for how they are computed."""

    iteration_s: float
    nodes: int
    spares: int
    node_bytes: float
    gpu_bytes: float
    d2h_s: float
    """One GPU's share copied into pinned host memory."""
    replicate_s: float
    """One node's share sent to its peer (replication factor 1)."""
    storage_write_s: float
    storage_read_s: float
    peer_fetch_s: float
    """A replacement node fetching the lost node's share from the peer that holds it."""
    interference_s: float
    """Step time added by one full in-memory snapshot while training runs ((ratio - 1) x iteration)."""
    persist_interference_s: float
    """Step time added by one background write of the full state to storage."""
    detect_s: float
    restart_s: float
    """Whole-job relaunch up to loading state: scheduler + start-up."""
    startup_s: float
    """Process start-up alone (no scheduler): what the survivors pay to restart at a new world size (shrink and
    grow, :mod:`deadpool_ext.sim.elastic`)."""
    hotswap_fixed_s: float
    """A swap whose spare built its engine for the failed node's ranks before the failure."""
    hotswap_unready_s: float
    """A swap whose spare built for another node's ranks, or none (it builds after the assignment)."""
    restore_fixed_s: float
    replay_s_per_diff: float
    diff_fraction: float
    failure_rate_per_s: float
    """Rate of interruptions of the whole job (per-GPU rate x GPUs)."""
    node_lost_fraction: float
    outage_rate_per_s: float
    node_repair_s: float
    node_reboot_s: float
    host_memory_bytes: float
    no_spare_policy: str
    """``fail``, ``wait`` or ``shrink``: what the engine does when a node is needed and the pool is empty."""
    shrink_unit_nodes: int
    """Nodes per data-parallel replica (the unit a shrink removes)."""

    @property
    def snapshot_background_s(self) -> float:
        """Time a full snapshot spends off the critical path: device-to-host copy, then the peer replica."""
        return self.d2h_s + self.replicate_s

    @property
    def built_ahead_fraction(self) -> float:
        """The share of nodes some spare built its engine for: each spare shadows one distinct node
        (``cluster/membership.py`` ``shadowed_node``), so a failure hits one of them with this probability."""
        return min(self.spares, self.nodes) / self.nodes if self.nodes > 0 else 0.0

    @property
    def hotswap_s(self) -> float:
        """A swap's agree + rebuild in expectation over which node fails (built ahead for or not)."""
        f = self.built_ahead_fraction
        return f * self.hotswap_fixed_s + (1.0 - f) * self.hotswap_unready_s

    @property
    def mtbf_s(self) -> float:
        rate = self.failure_rate_per_s + self.outage_rate_per_s
        return float("inf") if rate <= 0 else 1.0 / rate


def derive(p: Params) -> Derived:
    c, w, b, k, f = p.cluster, p.workload, p.bandwidth, p.costs, p.failure
    nodes = c.nodes
    node_bytes = w.state_bytes / nodes
    gpu_bytes = w.state_bytes / c.gpus
    write_bw = min(b.node_storage_gbs, b.storage_write_gbs / nodes) * GB
    read_bw = min(b.node_storage_gbs, b.storage_read_gbs / nodes) * GB
    return Derived(
        iteration_s=w.iteration_s, nodes=nodes, spares=c.spares, node_bytes=node_bytes, gpu_bytes=gpu_bytes,
        d2h_s=gpu_bytes / (b.d2h_gbs * GB), replicate_s=node_bytes / (b.peer_network_gbs * GB),
        storage_write_s=node_bytes / write_bw, storage_read_s=node_bytes / read_bw,
        peer_fetch_s=node_bytes / (b.peer_network_gbs * GB),
        interference_s=(k.snapshot_overhead_ratio - 1.0) * w.iteration_s,
        persist_interference_s=(k.persist_overhead_ratio - 1.0) * w.iteration_s, detect_s=k.detect_s,
        restart_s=k.scheduler_s + k.startup_s, startup_s=k.startup_s, hotswap_fixed_s=k.hotswap_fixed_s,
        hotswap_unready_s=k.hotswap_unready_s,
        restore_fixed_s=k.restore_fixed_s, replay_s_per_diff=k.replay_s_per_diff, diff_fraction=w.diff_fraction,
        failure_rate_per_s=f.rate_per_gpu_hour * c.gpus / 3600.0, node_lost_fraction=f.node_lost_fraction,
        outage_rate_per_s=f.cluster_outage_per_day / 86_400.0, node_repair_s=c.node_repair_h * 3600.0,
        node_reboot_s=c.node_reboot_s, host_memory_bytes=c.host_memory_gb * GB,
        no_spare_policy=c.no_spare_policy, shrink_unit_nodes=c.shrink_unit_nodes)
