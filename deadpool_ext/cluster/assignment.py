"""The records of membership: a job's processes (:class:`Worker`) and who holds which rank in one generation
(:class:`Assignment`, the value of the store's ``assignment`` key, with its JSON form). Data and its accessors
only; what changes an assignment is :mod:`deadpool_ext.cluster.membership`'s (pure) decisions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Worker:
    worker_id: str
    node: str
    local_index: int  # position of the process within its node


@dataclass(frozen=True, slots=True)
class Assignment:
    generation: int
    world_size: int
    ranks: dict[str, int]
    """worker id -> global rank, for every active worker."""
    nodes: dict[str, str]
    """worker id -> node, for every active worker."""
    spares: tuple[str, ...] = ()
    """spare nodes still available, in the order they will be used."""
    replaced: dict[str, str] = field(default_factory=dict)
    """failed node -> spare node that took its ranks in this generation."""
    master_port: int = 0
    """Port of this generation's c10d store (a fresh one per generation, served by the launcher)."""
    master_addr: str = "127.0.0.1"
    """Address of that store: the coordinating launcher's --host."""
    shrunk: tuple[str, ...] = ()
    """Nodes this generation dropped without a replacement (elastic shrink): the world is smaller."""
    grown: tuple[str, ...] = ()
    """Nodes this generation added to a shrunk world (elastic grow): the world is larger."""

    @property
    def resized(self) -> bool:
        """This generation has another world size than the one before (every rank rebuilds, none solo)."""
        return bool(self.shrunk or self.grown)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "world_size": self.world_size, "ranks": self.ranks,
                "nodes": self.nodes, "spares": list(self.spares), "replaced": self.replaced,
                "master_port": self.master_port, "master_addr": self.master_addr,
                **({"shrunk": list(self.shrunk)} if self.shrunk else {}),
                **({"grown": list(self.grown)} if self.grown else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Assignment:
        return cls(generation=int(d["generation"]), world_size=int(d["world_size"]),
                   ranks={k: int(v) for k, v in d["ranks"].items()}, nodes=dict(d["nodes"]),
                   spares=tuple(d.get("spares", ())), replaced=dict(d.get("replaced", {})),
                   master_port=int(d.get("master_port", 0)), master_addr=str(d.get("master_addr", "127.0.0.1")),
                   shrunk=tuple(str(n) for n in d.get("shrunk", ())),
                   grown=tuple(str(n) for n in d.get("grown", ())))

    def node_ranks(self, node: str) -> list[int]:
        return sorted(r for w, r in self.ranks.items() if self.nodes[w] == node)

    def active_nodes(self) -> list[str]:
        """The generation's nodes, ordered by their lowest rank (a node's index here is its ``GROUP_RANK``)."""
        lowest: dict[str, int] = {}
        for w, r in self.ranks.items():
            lowest[self.nodes[w]] = min(r, lowest.get(self.nodes[w], r))
        return sorted(lowest, key=lambda n: lowest[n])


__all__ = ["Assignment", "Worker"]
