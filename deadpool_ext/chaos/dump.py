"""State dumps for tests of record (installed by the harness, never by the product): with
``DEADPOOL_DUMP_STATE=<dir>`` every rank writes its partitioned training state after each memory-tier restore
(``restored.v<version>.w<dp>.r<rank>``) and, with ``DEADPOOL_DUMP_STEPS=3,5``, after those optimizer steps
(``step.v<step>.w<dp>.r<rank>``; ``dp``: the data-parallel size of the world that wrote it). Each file is a
snapshot-format blob (pickle-free): the rank's ``master.*`` and
``optim.*`` tensors and its partition layout, so a test assembles whole parameters from any data-parallel size
(:func:`gather`) and compares two runs element for element. A rank of a replicated layout (Megatron-Core:
its state is its model-parallel shard's) dumps every tensor it captures, and :func:`by_shard` gives each
shard's state, checked equal on every rank of it."""
from __future__ import annotations

import os
from typing import Any

import torch

DIR = "DEADPOOL_DUMP_STATE"
STEPS = "DEADPOOL_DUMP_STEPS"


def _write(path: str, state: Any) -> None:
    from ..snapshot.slots import serialize

    layout = state.partition_layout()
    whole = isinstance(layout, dict) and layout.get("rule") == "replicated"
    tensors = {name: t.detach().to("cpu").clone() for name, t in state.tensors()
               if whole or name.startswith(("master.", "optim."))}
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(serialize({"tensors": tensors}, {"layout": layout}))
    os.replace(tmp, path)


def _dp(state: Any) -> int:
    layout = state.partition_layout()
    return int(layout["dp"]) if layout else 0


def after_restore(rank: int, version: int, state: Any = None, **_: object) -> None:
    if state is not None:
        _write(os.path.join(os.environ[DIR], f"restored.v{version}.w{_dp(state)}.r{rank}"), state)


def after_step(step: int, rank: int, state: Any = None, **_: object) -> None:
    wanted = {int(s) for s in os.environ.get(STEPS, "").split(",") if s.strip()}
    if state is not None and step in wanted:
        _write(os.path.join(os.environ[DIR], f"step.v{step}.w{_dp(state)}.r{rank}"), state)


def install() -> bool:
    from .. import hooks

    if not os.environ.get(DIR):
        return False
    hooks.register(hooks.AFTER_RESTORE, after_restore)
    hooks.register(hooks.AFTER_STEP, after_step)
    return True


def gather(paths: list[str]) -> dict[str, dict[int, torch.Tensor]]:
    """Whole parameters from the dumps of every rank of one world: kind (``master`` or an optimizer key) ->
    parameter index -> its elements. Every element must be written exactly once."""
    from ..recovery.reshard import PartitionLayout, segments
    from ..snapshot.format import deserialize

    out: dict[str, dict[int, torch.Tensor]] = {}
    seen: dict[str, dict[int, int]] = {}
    for path in paths:
        with open(path, "rb") as fh:
            obj, meta = deserialize(fh.read())
        layout = PartitionLayout.from_json(meta["layout"])
        sizes = layout.params()
        for g, runs in enumerate(segments(layout)):
            for name, t in obj["tensors"].items():
                kind, g_s, *key = name.split(".")
                if int(g_s) != g or t.dim() != 1 or t.numel() != layout.part[g]:
                    continue
                what = kind if kind == "master" else key[0]
                for run in runs:
                    whole = out.setdefault(what, {}).setdefault(run.pid, torch.full((sizes[run.pid],), float("nan"),
                                                                                     dtype=t.dtype))
                    whole[run.start:run.start + run.length] = t[run.offset:run.offset + run.length]
                    seen.setdefault(what, {})[run.pid] = seen.get(what, {}).get(run.pid, 0) + run.length
    for what, per in seen.items():
        for pid, n in per.items():
            if n != sizes[pid]:
                raise AssertionError(f"{what} of parameter {pid}: {n} of {sizes[pid]} elements in the dumps")
    return out


def by_shard(paths: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Replicated layouts: shard -> its tensors, from the dumps of every rank of one world; the ranks of one
    shard must hold the very same tensors (the premise of the rule)."""
    from ..recovery.reshard import ReplicatedLayout
    from ..snapshot.format import deserialize

    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in paths:
        with open(path, "rb") as fh:
            obj, meta = deserialize(fh.read())
        shard = ReplicatedLayout.from_json(meta["layout"]).shard
        tensors = obj["tensors"]
        if shard in out:
            first = out[shard]
            if first.keys() != tensors.keys() or any(not torch.equal(first[k], tensors[k]) for k in first):
                raise AssertionError(f"{path}: the ranks of shard {shard} hold different state")
        else:
            out[shard] = tensors
    return out
