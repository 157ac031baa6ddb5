"""Tier 2 over gloo point-to-point on the snapshot side group (CPU and GPU jobs alike: snapshot traffic never
shares a communicator with training collectives, which may be NCCL)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..snapshot.format import BODY_START, MAGIC_SLICE
from .auth import UNSIGNED, BlobSigner
from .transport import TRAILER_LEN, BlobReceive, BlobSend, Transport


class GlooTransport(Transport):
    """One ``batch_isend_irecv`` per round: for each transfer the body, then the trailer (MAGIC and tag) as its
    own message, so the receiver can check the tag and write the MAGIC only after the body is in."""

    def __init__(self, group: Any, signer: BlobSigner = UNSIGNED, rank: int | None = None) -> None:
        super().__init__(dist.get_rank() if rank is None else rank, signer)
        self.group = group

    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive]) -> set[int]:
        ops = []
        for s in sends:
            ops.append(dist.P2POp(dist.isend, s.blob[BODY_START:], s.peer, self.group))
            ops.append(dist.P2POp(dist.isend, self.trailer(s), s.peer, self.group))
        trailers = []
        for r in receives:
            r.into[MAGIC_SLICE].zero_()
            trailer = torch.zeros(TRAILER_LEN, dtype=torch.uint8)
            trailers.append(trailer)
            ops.append(dist.P2POp(dist.irecv, r.into[BODY_START:r.nbytes], r.peer, self.group))
            ops.append(dist.P2POp(dist.irecv, trailer, r.peer, self.group))
        if not ops:
            return set()
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return {r.peer for r, trailer in zip(receives, trailers) if not self.accept(r, trailer)}
