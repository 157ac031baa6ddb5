"""Typed parameters of the large-cluster simulator, with their defaults and where each default comes from.

Five sections, one dataclass each, gathered in :class:`Params`:

* :class:`FailureModel` - how often things break and what a failure takes with it;
* :class:`Cluster`      - GPUs, nodes, the spare pool and how fast broken nodes come back;
* :class:`Workload`     - model size, bytes of training state per parameter, iteration time;
* :class:`Bandwidth`    - storage, network and device-to-host bandwidths that scale the measured phases;
* :class:`Costs`        - fixed software costs (detection, restart, hot-swap rebuild) and the snapshot
                          interference measured by this project's benchmarks;

plus :class:`SimConfig` (horizon, trials, seed). Every value is checked in ``__post_init__``; a bad one raises
:class:`SimParamError` naming ``section.key``, what is allowed and what was given. ``Params.from_dict`` rejects
unknown sections and keys (a typo must not silently fall back to a default).

Units: seconds, hours or days as the field name says; bandwidths in GB/s (10^9 bytes per second).
Sources are in ``docs/simulator.md`` and, per field, in :data:`SOURCES`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Llama 3 report (arXiv:2407.21783, section 3.3.4): 419 unexpected interruptions in a 54-day snapshot of
# pre-training on 16,384 H100 GPUs (about one every 3 hours), ~78% attributed to hardware.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24.0 * LLAMA3_GPUS)

GB = 1e9

NO_SPARE_POLICIES = ("fail", "wait", "shrink")
"""What the job does when it needs a node and the spare pool is empty (the launcher's ``--no-spare-policy``)."""


class SimParamError(ValueError):
    """A simulator parameter is missing, unknown or out of range; the message names ``section.key``."""


def _num(section: str, name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, integer: bool = False) -> None:
    """Check one number; the message says which key, what is allowed and what was given."""
    key = f"{section}.{name}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SimParamError(f"{key}: expected a number, got {value!r}")
    if integer and int(value) != value:
        raise SimParamError(f"{key}: expected an integer, got {value!r}")
    if not math.isfinite(value):
        raise SimParamError(f"{key}: must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise SimParamError(f"{key}: must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise SimParamError(f"{key}: must be <= {hi}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureModel:
    """Failure process: Poisson arrivals per GPU, a kind per failure, and rare cluster-wide outages."""

    rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR
    """Unexpected job interruptions per GPU-hour (Llama 3: 419 / (54 d x 24 h x 16,384) = 1.97e-5)."""
    node_lost_fraction: float = 0.78
    """Share of interruptions that take a node out (its memory is lost, it must be replaced): Llama 3 attributes
    ~78% to confirmed or suspected hardware. The rest are transient (software, NCCL timeouts): the processes die,
    the node and its host memory survive."""
    cluster_outage_per_day: float = 1.0 / 30.0
    """Events that lose every node's memory at once (power, network fabric, a bad software push). Assumption: no
    paper here gives a rate; one per 30 days exercises the persistent tier. Set 0 to switch off."""

    def __post_init__(self) -> None:
        _num("failure", "rate_per_gpu_hour", self.rate_per_gpu_hour, lo=0.0, hi=1.0)
        _num("failure", "node_lost_fraction", self.node_lost_fraction, lo=0.0, hi=1.0)
        _num("failure", "cluster_outage_per_day", self.cluster_outage_per_day, lo=0.0, hi=100.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """GPUs, nodes and the pool of spare nodes shared by every policy (hot for hot-swap, free for restarts)."""

    gpus: int = LLAMA3_GPUS
    """GPUs in the training job (512 to 16,384 in the issue; anything from 2 nodes up is accepted)."""
    gpus_per_node: int = 8
    """GPUs per node, one failure domain (Llama 3: 8 H100 per Grand Teton server)."""
    spare_nodes: int | None = None
    """Nodes in the spare pool; None: ceil(spare_fraction x nodes)."""
    spare_fraction: float = 0.01
    """Pool size relative to the job when ``spare_nodes`` is None (assumption: 1%, at least one node)."""
    node_repair_h: float = 24.0
    """Hours until a lost node is repaired and back in the pool (assumption)."""
    node_reboot_s: float = 600.0
    """Seconds until a node that only had a transient fault is back in the pool (hot-swap fences it; assumption)."""
    host_memory_gb: float = 2048.0
    """Host memory per node (GB) for the feasibility check of in-memory tiers (DGX H100: 2 TB)."""
    no_spare_policy: str = "wait"
    """When the job needs a node and the pool is empty (deadpool-run ``--no-spare-policy``): ``wait`` for the
    next repaired one; ``fail``: the job stops for the rest of the horizon and keeps only what the persistent tier
    holds; ``shrink``: the survivors go on with fewer data-parallel replicas (throughput in proportion) and grow
    back when a node returns. Default ``wait``: what the results before shrink existed were computed with."""
    shrink_unit_nodes: int = 1
    """Nodes per data-parallel replica, the unit a shrink removes: 1 = fully sharded data parallel (a node holds
    whole data-parallel ranks); with tensor x pipeline parallel spanning r nodes, losing one node idles its
    replica, whose r - 1 healthy nodes join the spare pool. ``nodes`` must be a multiple."""

    def __post_init__(self) -> None:
        _num("cluster", "gpus_per_node", self.gpus_per_node, lo=1, hi=1024, integer=True)
        _num("cluster", "gpus", self.gpus, lo=1, hi=10_000_000, integer=True)
        if self.gpus % self.gpus_per_node:
            raise SimParamError(f"cluster.gpus: must be a multiple of cluster.gpus_per_node ({self.gpus_per_node}), "
                                f"got {self.gpus}")
        if self.gpus // self.gpus_per_node < 2:
            raise SimParamError(f"cluster.gpus: need at least 2 nodes (peer replicas live on another node), got "
                                f"{self.gpus} GPUs = {self.gpus // self.gpus_per_node} node(s)")
        if self.spare_nodes is not None:
            _num("cluster", "spare_nodes", self.spare_nodes, lo=0, hi=1_000_000, integer=True)
        _num("cluster", "spare_fraction", self.spare_fraction, lo=0.0, hi=1.0)
        _num("cluster", "node_repair_h", self.node_repair_h, lo=0.0, hi=24.0 * 365)
        _num("cluster", "node_reboot_s", self.node_reboot_s, lo=0.0, hi=86_400.0 * 30)
        _num("cluster", "host_memory_gb", self.host_memory_gb, lo=0.0, lo_open=True)
        if self.no_spare_policy not in NO_SPARE_POLICIES:
            raise SimParamError(f"cluster.no_spare_policy: must be one of {', '.join(NO_SPARE_POLICIES)}, got "
                                f"{self.no_spare_policy!r}")
        _num("cluster", "shrink_unit_nodes", self.shrink_unit_nodes, lo=1, hi=1_000_000, integer=True)
        if self.nodes % self.shrink_unit_nodes or self.nodes // self.shrink_unit_nodes < 2:
            raise SimParamError(f"cluster.shrink_unit_nodes: must divide the {self.nodes} nodes into at least 2 "
                                f"replicas, got {self.shrink_unit_nodes}")

    @property
    def nodes(self) -> int:
        return int(self.gpus) // int(self.gpus_per_node)

    @property
    def spares(self) -> int:
        if self.spare_nodes is not None:
            return int(self.spare_nodes)
        return max(1, math.ceil(self.spare_fraction * self.nodes)) if self.spare_fraction > 0 else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """The training job: model size, bytes of state per parameter, time per iteration (weak scaling: the same
    iteration time at every cluster size)."""

    params_b: float = 405.0
    """Parameters, in billions (Llama 3 405B)."""
    state_bytes_per_param: float = 14.0
    """Checkpointed bytes per parameter: bf16 weights (2) + fp32 master (4) + Adam moments (8)."""
    iteration_s: float = 6.0
    """Seconds per iteration. Default from Llama 3's figures: 6 x 405e9 x 16M tokens / (16,384 x 400 TFLOP/s)."""
    diff_fraction: float = 2.0 / 14.0
    """Size of one TierCheck differential relative to a base (assumption: a bf16 gradient-sized delta, 2 of 14 B)."""

    def __post_init__(self) -> None:
        _num("workload", "params_b", self.params_b, lo=0.0, lo_open=True, hi=1e6)
        _num("workload", "state_bytes_per_param", self.state_bytes_per_param, lo=0.0, lo_open=True, hi=1e3)
        _num("workload", "iteration_s", self.iteration_s, lo=0.0, lo_open=True, hi=86_400.0)
        _num("workload", "diff_fraction", self.diff_fraction, lo=0.0, lo_open=True, hi=1.0)

    @property
    def state_bytes(self) -> float:
        return self.params_b * 1e9 * self.state_bytes_per_param


@dataclass(frozen=True, kw_only=True, slots=True)
class Bandwidth:
    """Bandwidths that turn bytes into seconds (GB/s = 10^9 B/s)."""

    storage_write_gbs: float = 2000.0
    """Aggregate persistent-storage write bandwidth (Llama 3: Tectonic sustains 2 TB/s)."""
    storage_read_gbs: float = 2000.0
    """Aggregate read bandwidth (assumption: as write; Llama 3 gives a 7 TB/s peak)."""
    node_storage_gbs: float = 25.0
    """Per-node cap on storage traffic (assumption: a 200 Gb/s front-end NIC)."""
    peer_network_gbs: float = 25.0
    """Per-node bandwidth for snapshot replicas and peer fetches (assumption: the same NIC)."""
    d2h_gbs: float = 25.0
    """Device-to-host copy per GPU into pinned memory (assumption: PCIe 5 x16 in practice;
    ``benchmarks/gpu_check.sh`` measures it)."""

    def __post_init__(self) -> None:
        for name in ("storage_write_gbs", "storage_read_gbs", "node_storage_gbs", "peer_network_gbs", "d2h_gbs"):
            _num("bandwidth", name, getattr(self, name), lo=0.0, lo_open=True, hi=1e7)


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Fixed software costs. Defaults are this project's measurements (the current results named in
    benchmarks/results/INDEX.md; :mod:`deadpool_ext.sim.calibration` re-reads them at every run and overrides these
    when the files are present) or stated assumptions. Measured values as of 2026-11-30 (recovery_small.json:
    GPT small, 3 CPU ranks; snapshot_overhead*.json: 4 CPU ranks)."""

    detect_s: float = 10.0
    """Failure to detection, every policy alike (assumption: heartbeat/collective timeouts at scale; a SIGKILL
    was seen in 0.14 s by deadpool-run and 0.72 s by torchrun here, recovery_small.json)."""
    scheduler_s: float = 60.0
    """Relaunching a whole job: allocation, containers, process start (assumption)."""
    startup_s: float = 9.74
    """Process start-up to first step, loading state included (measured: recovery_nodes.json, GPT small, baseline
    startup_and_load_s)."""
    hotswap_fixed_s: float = 0.13
    """Hot-swap agree + communicator and engine rebuild on the default path, the in-place swap, when the failed node
    is one a spare built its engine ahead for (measured: recovery_nodes.json, GPT small, hot-swap agree_s +
    rebuild_s). Detection and the recomputed iteration are charged separately."""
    hotswap_unready_s: float = 0.13
    """The same when no spare built for the failed node (measured: recovery_nodes.json, the other nodes' runs: a
    data-parallel spare relabels its engine in place, issue 44; a spare that starts its script again, as a
    pipeline engine's does for another stage, costs seconds: 3.18 s from its warm parent in megatron_nodes_pp2.json,
    set it with ``--set costs.hotswap_unready_s=...``). A spare builds for the node it shadows, so a swap
    costs, in expectation, ``min(spares, nodes) / nodes`` of the first and the rest of this
    (``Derived.hotswap_s``)."""
    restore_fixed_s: float = 0.27
    """Fixed part of restoring from memory (measured: recovery_nodes.json, GPT small, restore_s); bytes / bandwidth
    come on top."""
    snapshot_overhead_ratio: float = 1.08
    """Failure-free window ratio with an in-memory snapshot every iteration, counted whole: a window of steps ends
    when its last snapshot is committed (the snapshot_overhead results on 2 CPU cores; `deadpool simulate` prints
    the file and interval it calibrates from). The DeadPool paper reports 1.0 on GPUs."""
    persist_overhead_ratio: float = 1.11
    """Failure-free window ratio with a background persistent checkpoint every iteration, counted whole (DCP
    async_save of the same tensors in the snapshot_overhead results, 2 CPU cores); charged per background write
    to storage, by every policy."""
    replay_s_per_diff: float = 0.2
    """TierCheck: seconds to replay one differential during recovery (fused replay; assumption)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "scheduler_s", "startup_s", "hotswap_fixed_s", "restore_fixed_s",
                     "replay_s_per_diff"):
            _num("costs", name, getattr(self, name), lo=0.0, hi=86_400.0)
        # below 1 only by a measurement's noise: taken as measured (the calibration prints its interval)
        _num("costs", "snapshot_overhead_ratio", self.snapshot_overhead_ratio, lo=0.9, hi=10.0)
        _num("costs", "persist_overhead_ratio", self.persist_overhead_ratio, lo=0.9, hi=10.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Monte Carlo settings: simulated wall-clock horizon per trial, number of trials, seed."""

    horizon_days: float = 30.0
    """Wall-clock length of one simulated run."""
    trials: int = 20
    """Independent failure traces per configuration (the same traces for every policy: common random numbers)."""
    seed: int = 0
    """Seed of the failure traces; equal seeds give identical results."""

    def __post_init__(self) -> None:
        _num("sim", "horizon_days", self.horizon_days, lo=0.0, lo_open=True, hi=3650.0)
        _num("sim", "trials", self.trials, lo=1, hi=100_000, integer=True)
        _num("sim", "seed", self.seed, lo=0, integer=True)


SECTIONS: dict[str, type] = {"failure": FailureModel, "cluster": Cluster, "workload": Workload,
                             "bandwidth": Bandwidth, "costs": Costs, "sim": SimConfig}


@dataclass(frozen=True, kw_only=True, slots=True)
class Params:
    """Everything one simulation needs. Build from a nested dict with :meth:`from_dict`; change a few keys with
    :meth:`with_overrides` (``{"cluster.gpus": 512}``)."""

    failure: FailureModel = field(default_factory=FailureModel)
    cluster: Cluster = field(default_factory=Cluster)
    workload: Workload = field(default_factory=Workload)
    bandwidth: Bandwidth = field(default_factory=Bandwidth)
    costs: Costs = field(default_factory=Costs)
    sim: SimConfig = field(default_factory=SimConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Params:
        """Nested ``{section: {key: value}}``; missing keys keep their defaults, unknown ones are errors."""
        return cls().with_nested(data)

    def with_nested(self, data: Mapping[str, Any]) -> Params:
        if not isinstance(data, Mapping):
            raise SimParamError(f"parameters must be a JSON object of sections, got {type(data).__name__}")
        flat: dict[str, Any] = {}
        for section, values in data.items():
            if section not in SECTIONS:
                raise SimParamError(f"unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
            if not isinstance(values, Mapping):
                raise SimParamError(f"{section}: expected an object of keys, got {values!r}")
            for key, value in values.items():
                flat[f"{section}.{key}"] = value
        return self.with_overrides(flat)

    def with_overrides(self, flat: Mapping[str, Any]) -> Params:
        """Replace ``section.key`` values; validation runs again on every section touched."""
        changes: dict[str, dict[str, Any]] = {}
        for dotted, value in flat.items():
            section, _, key = dotted.partition(".")
            if section not in SECTIONS:
                raise SimParamError(f"unknown parameter {dotted!r}: section must be one of {', '.join(SECTIONS)}")
            names = [f.name for f in dataclasses.fields(SECTIONS[section])]
            if key not in names:
                raise SimParamError(f"unknown parameter {dotted!r}; {section} has: {', '.join(names)}")
            changes.setdefault(section, {})[key] = value
        kwargs = {name: (dataclasses.replace(getattr(self, name), **changes[name]) if name in changes
                         else getattr(self, name)) for name in SECTIONS}
        return Params(**kwargs)


def parse_value(text: str) -> Any:
    """A command-line value: int, float, ``none``/``null`` or the literal string."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text
