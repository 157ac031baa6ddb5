"""Small collectives over torch.distributed that carry JSON, not pickle.

``all_gather_object`` unpickles what peers send; control messages here are plain JSON in uint8 tensors so a
misbehaving peer cannot make a rank execute code.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def allgather_json(obj: Any, group: Any = None) -> list[Any]:
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(o[: int(s.item())].tolist())) for o, s in zip(out, sizes)]
