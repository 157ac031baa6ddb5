"""What can go wrong (the fault catalogue), where it can go wrong (the layouts), and the primitive actions a
fault expands to. Plain data: nothing here starts a process."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Fault(str, enum.Enum):
    """One entry of the catalogue. A trial injects exactly one of these (some are two primitive actions)."""

    WORKER = "worker"                    # SIGKILL or SIGSTOP one worker process at a step boundary
    NODE = "node"                        # SIGKILL or SIGSTOP every process of one node at once
    SPARE = "spare"                      # SIGKILL or SIGSTOP an idle spare, then lose a worker: the next spare steps in
    IN_SNAPSHOT = "in_snapshot"          # SIGKILL a worker while its tier-1 slot is being written (slot torn)
    IN_REPLICATION = "in_replication"    # SIGKILL the source or the holder while a replica is in transit
    IN_RECOVERY = "in_recovery"          # lose a worker, then SIGKILL the spare taking its ranks during the rebuild
    CORRUPT_TIER1 = "corrupt_tier1"      # lose a node, flip bytes in a survivor's tier-1 slot(s) before the restore
    CORRUPT_TIER2 = "corrupt_tier2"      # lose a node, flip bytes in the newest replica of its state
    CORRUPT_TIER3 = "corrupt_tier3"      # flip bytes in the newest published base, lose every node, relaunch --load
    TIER3_FULL = "tier3_full"            # the --save file system fills after the first base; lose all, relaunch
    IN_PERSIST = "in_persist"            # lose every node while a base is being written; relaunch --load


FAULTS: tuple[Fault, ...] = tuple(Fault)

# Faults whose recovery is a relaunch from tier 3 (every node lost): the trial is two jobs.
TIER3_FAULTS = frozenset({Fault.CORRUPT_TIER3, Fault.TIER3_FULL, Fault.IN_PERSIST})


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """A parallel layout the chaos suite trains under ``deadpool-run`` (all nodes simulated on this host)."""

    name: str
    """Key used on the command line (``--layouts``)."""
    framework: str
    """``deepspeed`` (scripts/pretrain_gpt.py) or ``megatron`` (scripts/pretrain_gpt_megatron.py)."""
    nnodes: int
    """Active nodes; replicas go round a ring: node i's ranks are held by node (i + 1) mod nnodes."""
    nproc_per_node: int
    zero_stage: int = 0
    """ZeRO stage of the DeepSpeed config (0 for Megatron)."""
    tp: int = 1
    """Megatron tensor-parallel size."""
    iters: int = 10
    """Optimizer steps per trial."""
    faults: frozenset[Fault] = field(default_factory=lambda: frozenset(FAULTS))
    """Catalogue entries this layout can take (see docs/chaos.md for what is left out and why)."""

    def nodes(self) -> list[str]:
        return [f"node{i}" for i in range(self.nnodes)]

    def workers(self, node: str) -> list[str]:
        return [f"{node}.{j}" for j in range(self.nproc_per_node)]

    def rank(self, worker: str) -> int:
        """Global rank of an active worker in generation 0 (ranks are dealt node by node)."""
        node, local = worker.split(".")
        return int(node[len("node"):]) * self.nproc_per_node + int(local)

    def holder_node(self, node: str) -> str:
        """The node holding the tier-2 replicas of ``node``'s ranks (ring placement, replication factor 1)."""
        return f"node{(int(node[len('node'):]) + 1) % self.nnodes}"


_DS: dict[str, Any] = dict(framework="deepspeed", nnodes=3, nproc_per_node=1, iters=10)
LAYOUTS: dict[str, Layout] = {
    "zero1": Layout(name="zero1", zero_stage=1, **_DS),
    "zero2": Layout(name="zero2", zero_stage=2, **_DS),
    "zero3": Layout(name="zero3", zero_stage=3, **_DS),
    # Megatron's tier 3 is written synchronously and its --load refuses a corrupt newest base instead of falling
    # back to the previous one, so the relaunch faults are DeepSpeed-only (docs/chaos.md).
    "megatron": Layout(name="megatron", framework="megatron", nnodes=2, nproc_per_node=2, tp=2, iters=8,
                       faults=frozenset(FAULTS) - TIER3_FAULTS),
}
DEFAULT_LAYOUTS: tuple[str, ...] = ("zero1", "zero2", "zero3", "megatron")


@dataclass(frozen=True, slots=True, kw_only=True)
class Trigger:
    """When an action fires.

    kind:
      ``step``            metrics (global rank 0) reached step ``value``
      ``assignment``      the launcher published generation ``value`` (timeline)
      ``slot_write``      after step ``value``: the next time a slot of rank ``rank`` is invalidated (MAGIC zeroed:
                          its copy has begun and it is not sealed yet)
      ``replica_write``   after step ``value``: the next time a holder's replica buffer of rank ``rank`` is zeroed
                          (the transfer has begun)
      ``base_published``  ``latest`` in the --save directory names a base of step >= ``value``
      ``base_writing``    a base of step >= ``value`` exists in the --save directory without its commit record
      ``now``             right after the previous action
    """

    kind: str
    value: int = 0
    rank: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """A primitive fault.

    op:
      ``signal``   send ``sig`` to every process of ``target`` (a worker id like ``node1.0``, or a node like
                   ``node1`` / ``spare0``: all its workers)
      ``corrupt``  flip bytes in tier ``tier``: 1 = the slot(s) of rank ``rank`` (``which`` newest|all),
                   2 = the replica buffers of rank ``rank`` (newest), 3 = a file of the newest published base
      ``fill``     fill the --save file system (tier 3 storage full)
      ``kill_job`` SIGKILL the launcher and every process under it (every node lost)
    """

    op: str
    trigger: Trigger
    target: str = ""
    sig: str = ""
    tier: int = 0
    rank: int = -1
    which: str = ""

    def describe(self) -> str:
        t = self.trigger
        when = {"step": f"at step {t.value}", "assignment": f"after assignment {t.value}",
                "slot_write": f"while rank {t.rank}'s slot is written (after step {t.value})",
                "replica_write": f"while rank {t.rank}'s replica is in transit (after step {t.value})",
                "base_published": f"once base >= {t.value} is published",
                "base_writing": f"while base >= {t.value} is being written", "now": "then"}[t.kind]
        what = {"signal": f"{self.sig} {self.target}",
                "corrupt": f"corrupt tier {self.tier}" + (f" rank {self.rank} ({self.which})" if self.tier < 3 else ""),
                "fill": "fill tier-3 storage", "kill_job": "kill every node"}[self.op]
        return f"{what} {when}"
