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
    """Two ``batch_isend_irecv`` per round: every body, then every trailer (MAGIC and tag) as its own message, so
    the receiver can check the tag and write the MAGIC only after the body is in. The sender's tags are computed
    while the bodies are in flight (with a key; without one the trailers are ready at once)."""

    def __init__(self, group: Any, signer: BlobSigner = UNSIGNED, rank: int | None = None) -> None:
        super().__init__(dist.get_rank() if rank is None else rank, signer)
        self.group = group

    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive]) -> set[int]:
        if not sends and not receives:
            return set()
        bodies = [dist.P2POp(dist.isend, s.blob[BODY_START:], s.peer, self.group) for s in sends]
        trailers = [torch.zeros(TRAILER_LEN, dtype=torch.uint8) for _ in receives]
        for r in receives:
            r.into[MAGIC_SLICE].zero_()
            bodies.append(dist.P2POp(dist.irecv, r.into[BODY_START:r.nbytes], r.peer, self.group))
        in_flight = dist.batch_isend_irecv(bodies)
        # Every rank posts its bodies before its trailers, so the two batches match message for message.
        tails = [dist.P2POp(dist.isend, self.trailer(s), s.peer, self.group) for s in sends]  # tags: bodies in flight
        tails += [dist.P2POp(dist.irecv, t, r.peer, self.group) for r, t in zip(receives, trailers)]
        for req in in_flight:
            req.wait()
        self.check_open()  # a hot-swap replaced this transport meanwhile: the group now has a new communicator
        for req in dist.batch_isend_irecv(tails):
            req.wait()
        return {r.peer for r, trailer in zip(receives, trailers) if not self.accept(r, trailer)}
