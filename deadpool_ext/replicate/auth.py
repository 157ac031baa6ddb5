"""Authentic replicas: an HMAC-SHA256 tag on every snapshot blob that crosses the peer channel.

A blob's xxh3 checksums (``snapshot/format.py``) catch accidents, not forgery: whoever can write into the
snapshot side group's connections can send a blob whose checksums match its forged content. With a key (the
job's checkpoint key, ``persist.key_env``, default ``DEADPOOL_CHECKPOINT_KEY``; the same on every rank),
every blob is sent with a tag over

    DOMAIN | sender's global rank (u64 LE) | body ``[BODY_START:len]`` | MAGIC

and a receiver writes the MAGIC (the mark that makes a buffer a complete blob) only if the tag matches: a
refused blob stays torn, so every reader skips it, and a restore falls back to the next copy or tier (logged).
The tag binds the sender's rank, so a blob forwarded in another rank's name is refused too; the blob's own
header (inside the signed body) names its source rank, version and world size, which the restore checks.

Without a key nothing is computed (the tag travels as zeros, so the framing is one and the same): the step path
pays for signing only when a key is set, and then in the background worker, at about 1 GB/s per core
(``benchmarks/results/peer_sign.md``). Not covered: replaying an older blob of the same rank signed with the same
key (the restore agrees on one version across ranks and takes the newest common one).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

import torch

TAG_LEN = 32
DOMAIN = b"deadpool-peer-blob-v1\n"
_FINGERPRINT_MSG = b"deadpool-key-fingerprint-v1"


def _mv(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy."""
    return t.numpy().data.cast("B")


class BlobSigner:
    """Computes and checks tags with one key (``None``: off; every call is then free and every check passes)."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def fingerprint(self) -> str | None:
        """A short public digest of the key (never the key): ranks compare it to agree they share one."""
        if self.key is None:
            return None
        return hmac.new(self.key, _FINGERPRINT_MSG, hashlib.sha256).hexdigest()[:16]

    def tag(self, sender: int, body: torch.Tensor, magic: torch.Tensor) -> bytes:
        """The tag of a blob sent by global rank ``sender`` (zeros without a key)."""
        if self.key is None:
            return bytes(TAG_LEN)
        h = hmac.new(self.key, DOMAIN + struct.pack("<Q", sender), hashlib.sha256)
        h.update(_mv(body))
        h.update(_mv(magic))
        return h.digest()

    def check(self, sender: int, body: torch.Tensor, magic: torch.Tensor, tag: bytes) -> bool:
        """Whether ``tag`` is ``sender``'s tag over this body and MAGIC under the key (always True without one)."""
        if self.key is None:
            return True
        return hmac.compare_digest(self.tag(sender, body, magic), tag)


UNSIGNED = BlobSigner(None)
