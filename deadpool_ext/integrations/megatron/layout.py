"""TP/PP/DP layout arithmetic, pure (no torch.distributed): which coordinates a global rank holds.

Megatron-Core's default rank order is ``tp-cp-ep-dp-pp`` (``initialize_model_parallel(order=...)``): tensor
parallel ranks are adjacent, then data parallel, then pipeline stages. With context and expert parallelism
at 1 (what this integration supports) the global rank is::

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

So the coordinates of a rank are a function of the rank alone. deadpool-run gives a spare the failed
worker's global rank (``cluster.membership.replace_failed``), hence the spare takes exactly the failed
rank's (tp, pp, dp) coordinates; :func:`coordinates` is also checked against ``parallel_state`` at runtime.

Tensor parallel groups should sit inside a node (they exchange every layer): :func:`tp_groups_within_nodes`
says whether the launcher's node size allows it.
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A TP/PP layout that does not fit the world; the message says what would."""


@dataclass(frozen=True, slots=True)
class Layout:
    world_size: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for name, value in (("world size", self.world_size), ("--tensor-model-parallel-size", self.tp),
                            ("--pipeline-model-parallel-size", self.pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % (self.tp * self.pp):
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tensor-parallel x pipeline-parallel = "
                f"{self.tp} x {self.pp} = {self.tp * self.pp}; use a world size that is a multiple of it "
                f"(data-parallel size = world / (tp x pp))")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True, slots=True)
class Coordinates:
    tp: int
    pp: int
    dp: int


def coordinates(rank: int, layout: Layout) -> Coordinates:
    """(tp, pp, dp) rank of global ``rank`` in Megatron-Core's default ``tp-cp-ep-dp-pp`` order."""
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} is outside a world of {layout.world_size}")
    return Coordinates(tp=rank % layout.tp, dp=(rank // layout.tp) % layout.dp, pp=rank // (layout.tp * layout.dp))


def rank_of(c: Coordinates, layout: Layout) -> int:
    return c.tp + layout.tp * c.dp + layout.tp * layout.dp * c.pp


def tp_groups_within_nodes(layout: Layout, nproc_per_node: int) -> bool:
    """True when every tensor-parallel group lies on one node (tp divides the node size)."""
    return nproc_per_node % layout.tp == 0
