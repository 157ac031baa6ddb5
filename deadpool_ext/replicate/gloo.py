"""Tier 2 over gloo point-to-point on the snapshot side group (CPU and GPU jobs alike: snapshot traffic never
shares a communicator with training collectives, which may be NCCL)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..snapshot.format import BODY_START, MAGIC_SLICE
from .auth import UNSIGNED, BlobSigner
from .transport import TRAILER_LEN, BlobReceive, BlobSend, Transport, pieces


class GlooTransport(Transport):
    """Point-to-point per round: every body (in pieces with ``chunk_bytes``), then every trailer (MAGIC and tag) as
    its own message, so the receiver can check the tag and write the MAGIC only after the body is in. The sender's
    tags are computed while the bodies are in flight (with a key; without one the trailers are ready at once); a
    receive's ``progress`` is called as each of its pieces completes, while the later ones are in flight (gloo
    receives on its own threads)."""

    def __init__(self, group: Any, signer: BlobSigner = UNSIGNED, rank: int | None = None) -> None:
        super().__init__(dist.get_rank() if rank is None else rank, signer)
        self.group = group

    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive],
                 chunk_bytes: int | None = None) -> set[int]:
        if not sends and not receives:
            return set()
        # Posted one by one, in this order on every rank (what batch_isend_irecv does for gloo), so that the
        # works below are known piece by piece; pieces of one pair travel in order on one tag.
        bodies = [_post(dist.isend, s.blob[a:b], s.peer, self.group)
                  for s in sends for a, b in pieces(BODY_START, len(s.blob), chunk_bytes)]
        trailers = [torch.zeros(TRAILER_LEN, dtype=torch.uint8) for _ in receives]
        landed: list[tuple[Any, BlobReceive, int]] = []
        for r in receives:
            r.into[MAGIC_SLICE].zero_()
            landed += [(_post(dist.irecv, r.into[a:b], r.peer, self.group), r, b)
                       for a, b in pieces(BODY_START, r.nbytes, chunk_bytes)]
        # Every rank posts its bodies before its trailers, so the two rounds match message for message.
        tails = [(s.peer, self.trailer(s)) for s in sends]  # tags computed while the bodies are in flight
        for work, r, upto in landed:
            work.wait()
            if r.progress is not None:
                r.progress(upto)
        for work in bodies:
            work.wait()
        self.check_open()  # a hot-swap replaced this transport meanwhile: the group now has a new communicator
        works = [_post(dist.isend, t, peer, self.group) for peer, t in tails]
        works += [_post(dist.irecv, t, r.peer, self.group) for r, t in zip(receives, trailers)]
        for work in works:
            work.wait()
        return {r.peer for r, trailer in zip(receives, trailers) if not self.accept(r, trailer)}


def _post(op: Any, tensor: torch.Tensor, peer: int, group: Any) -> Any:
    """One point-to-point message posted on ``group``; its work (torch returns none to a rank outside the group)."""
    work = op(tensor, peer, group)
    if work is None:
        raise RuntimeError(f"tier 2: rank {dist.get_rank()} is not in the snapshot side group it sends on")
    return work
