"""TP/PP/DP layout arithmetic, pure (no torch.distributed): which coordinates a global rank holds.

Megatron-Core's default rank order is ``tp-cp-ep-dp-pp`` (``initialize_model_parallel(order=...)``): tensor
parallel ranks are adjacent, then data parallel, then pipeline stages. With context and expert parallelism
at 1 (what this integration supports) the global rank is::

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

So the coordinates of a rank are a function of the rank alone. deadpool-run gives a spare the failed
worker's global rank (``cluster.membership.replace_failed``), hence the spare takes exactly the failed
rank's (tp, pp, dp) coordinates; :func:`coordinates` is also checked against ``parallel_state`` at runtime.

Elastic (docs/elastic.md): a world of another size keeps tensor and pipeline parallelism and changes data
parallelism only. :func:`dp_resize` is the rule a resized generation must pass (every worker in both keeps its
tensor and pipeline coordinates), :func:`keep_global_batch` the micro-batch count that keeps the global batch.

Tensor parallel groups should sit inside a node (they exchange every layer): :func:`tp_groups_within_nodes`
says whether the launcher's node size allows it.
"""
from __future__ import annotations

from collections.abc import Mapping
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


def shard_name(c: Coordinates, layout: Layout) -> str:
    """The model-parallel shard a rank holds (its snapshots' ``ReplicatedLayout.shard``)."""
    return f"tp{c.tp}of{layout.tp}.pp{c.pp}of{layout.pp}"


def dp_resize(layout: Layout, old_ranks: Mapping[str, int], new_ranks: Mapping[str, int], new_world: int) -> Layout:
    """The layout of a resized world (elastic shrink or grow) when it changes data parallelism only: tp x pp
    divides ``new_world`` and every worker of both generations (``worker -> rank``) keeps its tensor- and
    pipeline-parallel coordinates. Else :class:`LayoutError` naming the rank that would have to move (a tensor-
    or pipeline-parallel group lost a member)."""
    if new_world % (layout.tp * layout.pp):
        lost = sorted(r for w, r in old_ranks.items() if w not in new_ranks)
        raise LayoutError(f"{new_world} ranks are not a multiple of tensor-parallel x pipeline-parallel = "
                          f"{layout.tp} x {layout.pp} (lost ranks {lost}: a tensor- or pipeline-parallel group lost "
                          "a member)")
    new = Layout(world_size=new_world, tp=layout.tp, pp=layout.pp)
    for w, r in sorted(old_ranks.items(), key=lambda kv: kv[1]):
        if w not in new_ranks:
            continue
        a, b = coordinates(r, layout), coordinates(new_ranks[w], new)
        if (a.tp, a.pp) != (b.tp, b.pp):
            lost = sorted(r for w, r in old_ranks.items() if w not in new_ranks)
            raise LayoutError(f"rank {r} at (tp {a.tp}, pp {a.pp}) would become rank {new_ranks[w]} at (tp {b.tp}, "
                              f"pp {b.pp}): the ranks lost{f' ({lost})' if lost else ''} were not whole data-parallel "
                              "replicas (a tensor- or pipeline-parallel group lost a member)")
    return new


def keep_global_batch(global_batch: int, micro: int, num_micro: int, dp: int, allow_change: bool) -> tuple[int, int]:
    """(micro-batches per iteration, global batch) at data-parallel size ``dp``: the global batch kept by the
    number of micro-batches; where it is not a multiple of ``micro x dp``, :class:`LayoutError` unless
    ``allow_change`` (then ``num_micro`` stays and the global batch changes)."""
    if global_batch % (micro * dp) == 0:
        return global_batch // (micro * dp), global_batch
    if allow_change:
        return num_micro, micro * num_micro * dp
    raise LayoutError(f"cannot keep the global batch {global_batch} at data-parallel size {dp}: it is not a multiple "
                      f"of micro batch {micro} x {dp}; set deadpool.elastic.allow_batch_change to true to continue "
                      "with another global batch, or choose --global-batch-size / --micro-batch-size that divide "
                      "every data-parallel size the job may run at")


def dp_exchange_refusal(mapping: Mapping[int, int], layout: Layout) -> str | None:
    """Why a spare built for one node's ranks cannot take another's by exchanging them (``mapping``, both ways;
    ``rebuild/regroup.py``): every rank must keep its tensor- and pipeline-parallel coordinates, so that the model
    shard it built is the one it takes and only its data-parallel replica changes. None: it can (pure)."""
    for old, new in sorted(mapping.items()):
        a, b = coordinates(old, layout), coordinates(new, layout)
        if (a.tp, a.pp) != (b.tp, b.pp):
            return (f"rank {old} is at tensor/pipeline coordinates ({a.tp}, {a.pp}), rank {new} at ({b.tp}, {b.pp}): "
                    "another model shard")
    return None
