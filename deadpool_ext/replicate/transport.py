"""How a sealed snapshot blob moves from one rank's memory into another's: the extension point of tier 2.

Deciding *which* blob goes *where* is not a transport's business (``replicate.peer`` and
``cluster.placement`` do that); a transport only moves bytes, so a second one (NCCL, RDMA, a TCP side
channel) is a new file implementing :class:`Transport`, with nothing else changed.

The one guarantee every implementation gives, whatever it runs on: a receiver never holds a buffer that
looks complete but is not. The receiver's MAGIC (``format.MAGIC_SLICE``) is cleared before anything arrives,
the body (``[BODY_START:nbytes]``) travels first, then a trailer (:meth:`Transport.trailer`: the sender's MAGIC
and an HMAC tag, ``replicate/auth.py``), and the MAGIC is written into the receiving buffer only after the
whole body and the trailer have arrived and the tag is accepted (:meth:`Transport.accept`). An interrupted
transfer leaves a torn buffer, and so does a blob whose tag the key refuses; every reader refuses a torn buffer.

Call order (every rank of the job, the same rounds in the same order on every rank):

1. ``Transport(...)``: on all ranks (an implementation may build communicators: collective).
2. ``exchange(sends, receives, chunk_bytes=None)``: one round; every rank posts what it sends and what it
   receives in this round (possibly nothing) and returns when all of its own transfers are complete, with the
   peers whose blob it refused (tag does not match the key). A rank's sends must match its peers' receives of the
   same round (same peer, same byte count, same ``chunk_bytes``). With ``chunk_bytes`` a body travels in pieces
   of at most that many bytes, and a receive's ``progress`` is called on the calling thread, in order, with the
   blob offset up to which its bytes are final, while later pieces are still arriving: the receiver checks what
   has arrived during the rest of the transfer (``snapshot.format.StreamVerifier``, at a restore's fetch).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..snapshot.format import BODY_START, MAGIC_LEN, MAGIC_SLICE
from .auth import TAG_LEN, UNSIGNED, BlobSigner

TRAILER_LEN = MAGIC_LEN + TAG_LEN
"""What follows a blob's body on the wire: its MAGIC, then its tag (zeros without a key)."""

log = logging.getLogger("deadpool_ext")

FETCH_CHUNK_BYTES = 16 << 20
"""A fetched replica travels in pieces of this size, so the receiver verifies each piece's tensors while the next
ones arrive (replicas sent at every snapshot travel whole: nobody checks them then)."""


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
    progress: Callable[[int], None] | None = None
    """Called with ``n`` once bytes ``[0, n)`` of ``into`` are final, as pieces arrive (``chunk_bytes``)."""


def pieces(start: int, end: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """The ``[a, b)`` byte ranges a body ``[start, end)`` travels in: one without ``chunk_bytes`` (also when empty),
    else consecutive pieces of at most ``chunk_bytes``. Sender and receiver compute the same list."""
    if not chunk_bytes or end - start <= chunk_bytes:
        return [(start, end)]
    return [(a, min(a + chunk_bytes, end)) for a in range(start, end, chunk_bytes)]


class TransportClosed(RuntimeError):
    """A transfer of a replaced transport; it stops before its next message (see :attr:`Transport.closed`)."""


class Transport(ABC):
    """Moves blobs between ranks (see the module docstring for the guarantee and the call order).

    ``rank`` is this process's global rank (bound into the tags it sends); ``signer`` the key's
    :class:`~deadpool_ext.replicate.auth.BlobSigner` (unsigned by default). Implementations frame every transfer
    with :meth:`trailer` and finish every receive with :meth:`accept`; the signing is theirs for free."""

    def __init__(self, rank: int, signer: BlobSigner = UNSIGNED) -> None:
        self.rank = rank
        self.signer = signer
        self.refused_total = 0
        self.closed = False
        """Set when the replicator that owns this transport is replaced (in-place hot-swap): a transfer still in
        flight on the dead generation's communicator must not go on to a next message, which would go out on the
        group's new communicator. Implementations check it between messages (:meth:`check_open`)."""

    def check_open(self) -> None:
        if self.closed:
            raise TransportClosed(f"tier 2: rank {self.rank}'s transport was closed (a hot-swap replaced it) while a "
                                  "transfer was in flight; abandoned")

    def trailer(self, send: BlobSend) -> torch.Tensor:
        """The ``TRAILER_LEN`` bytes to send after ``send``'s body: its MAGIC and its tag."""
        magic = send.blob[MAGIC_SLICE]
        tag = self.signer.tag(self.rank, send.blob[BODY_START:], magic)
        return torch.cat([magic.clone(), torch.frombuffer(bytearray(tag), dtype=torch.uint8)])

    def accept(self, receive: BlobReceive, trailer: torch.Tensor) -> bool:
        """Finish ``receive`` once its body and ``trailer`` are in: write the MAGIC if the tag is accepted (True);
        otherwise leave the buffer torn, log it and return False."""
        magic, tag = trailer[:MAGIC_LEN], bytes(trailer[MAGIC_LEN:TRAILER_LEN].numpy())
        if not self.signer.check(receive.peer, receive.into[BODY_START:receive.nbytes], magic, tag):
            self.refused_total += 1
            log.warning("tier 2: rank %d refused a snapshot blob from rank %d: its tag does not match the checkpoint "
                        "key (unsigned, altered on the way, or signed with another key); the buffer stays torn and "
                        "is never used", self.rank, receive.peer)
            return False
        receive.into[MAGIC_SLICE].copy_(magic)
        return True

    @abstractmethod
    def exchange(self, sends: Sequence[BlobSend], receives: Sequence[BlobReceive],
                 chunk_bytes: int | None = None) -> set[int]:
        """Complete one round of transfers: every ``sends`` blob reaches its peer, every ``receives`` buffer is
        filled from its peer, MAGIC last. Returns the peers whose blob was refused (:meth:`accept`), their
        buffers left torn. Raises (e.g. ``RuntimeError``) when a peer is gone; a receiving buffer is then left
        torn, never complete-looking. ``chunk_bytes``: bodies in pieces (:func:`pieces`), each receive's
        ``progress`` called as its pieces land (module docstring)."""
