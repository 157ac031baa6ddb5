"""How a sealed snapshot blob moves from one rank's memory into another's: the extension point of tier 2.

Deciding *which* blob goes *where* is not a transport's business (``replicate.peer`` and
``cluster.placement`` do that); a transport only moves bytes, so a second one (NCCL, RDMA, a TCP side
channel) is a new file implementing :class:`Transport`, with nothing else changed.

The one guarantee every implementation gives, whatever it runs on: a receiver never holds a buffer that
looks complete but is not. The receiver's MAGIC (``format.MAGIC_SLICE``) is cleared before anything arrives,
the body (``[BODY_START:nbytes]``) travels first, and the MAGIC is written into the receiving buffer only after
the whole body and the sender's MAGIC have arrived. An interrupted transfer leaves a torn buffer, which every
reader refuses.

Call order (every rank of the job, the same rounds in the same order on every rank):

1. ``Transport(...)``: on all ranks (an implementation may build communicators: collective).
2. ``exchange(sends, receives)``: one round; every rank posts what it sends and what it receives in this
   round (possibly nothing) and returns when all of its own transfers are complete. A rank's sends must match
   its peers' receives of the same round (same peer, same byte count).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlobSend:
    peer: int
    """Global rank that receives."""
    blob: torch.Tensor
    """uint8 view of a sealed blob (exactly its length): body and MAGIC are read from here."""


@dataclass(frozen=True, slots=True)
class BlobReceive:
    peer: int
    """Global rank that sends."""
    into: torch.Tensor
    """uint8 buffer, at least ``nbytes`` long, whose first ``nbytes`` become the blob."""
    nbytes: int
    """Length of the sender's blob (ranks' blobs differ in size: partitions and headers)."""


class Transport(ABC):
    """Moves blobs between ranks (see the module docstring for the guarantee and the call order)."""

    @abstractmethod
    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive]) -> None:
        """Complete one round of transfers: every ``sends`` blob reaches its peer, every ``receives`` buffer is
        filled from its peer, MAGIC last. Raises (e.g. ``RuntimeError``) when a peer is gone; a receiving
        buffer is then left torn, never complete-looking."""
