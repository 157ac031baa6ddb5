"""Tier 2 over gloo point-to-point on the snapshot side group (CPU and GPU jobs alike: snapshot traffic never
shares a communicator with training collectives, which may be NCCL)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..snapshot.format import BODY_START, MAGIC_LEN, MAGIC_SLICE
from .transport import BlobReceive, BlobSend, Transport


class GlooTransport(Transport):
    """One ``batch_isend_irecv`` per round: for each transfer the body, then the 8-byte MAGIC as its own
    message, so the receiver can write it only after the body is in."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive]) -> None:
        ops = []
        for s in sends:
            ops.append(dist.P2POp(dist.isend, s.blob[BODY_START:], s.peer, self.group))
            ops.append(dist.P2POp(dist.isend, s.blob[MAGIC_SLICE].clone(), s.peer, self.group))
        magics = []
        for r in receives:
            r.into[MAGIC_SLICE].zero_()
            magic = torch.zeros(MAGIC_LEN, dtype=torch.uint8)
            magics.append(magic)
            ops.append(dist.P2POp(dist.irecv, r.into[BODY_START:r.nbytes], r.peer, self.group))
            ops.append(dist.P2POp(dist.irecv, magic, r.peer, self.group))
        if not ops:
            return
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        for r, magic in zip(receives, magics):
            r.into[MAGIC_SLICE].copy_(magic)
