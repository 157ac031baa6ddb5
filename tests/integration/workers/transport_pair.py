"""Two ranks, one Transport implementation (argv[1]), the contract every one must meet (argv[2]: the cases,
comma-separated, run in that order, each on a new group with a new transport; ``torn`` ends the run, as rank 0
leaves):

- ``both_ways``: one round, each rank sends its blob to the other and receives the other's (blobs of different
  sizes, the receiving buffer larger than the blob and prefilled with an older valid blob); both arrive intact.
- ``torn``: rank 0 leaves without sending; rank 1's receive fails and leaves its buffer torn (MAGIC zero),
  never complete-looking, although it held a valid blob before.
- ``signed``: both ranks sign with the same key: both blobs arrive intact and accepted.
- ``pieces``: one round both ways with ``chunk_bytes`` (a fetch at a restore): each receive's progress is called
  with growing offsets up to the blob's length while later pieces are in flight, and a ``StreamVerifier`` fed by it
  checks the blob; ``pieces_corrupt``: rank 0 sends a blob whose bytes no longer match its checksums, and rank 1's
  verifier names the tensor.
- ``forged``: rank 0 signs with another key; ``unsigned``: rank 0 has no key. Rank 1 (with the key) refuses the
  blob: ``exchange`` names rank 0 and the buffer is left torn although it held a valid blob before; rank 0
  (the receiver of rank 1's blob, with its own key or none) refuses or accepts as its key says.

Writes ``<case>.rank<r>.json`` into argv[3].
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool_ext.replicate.auth import BlobSigner
from deadpool_ext.replicate.gloo import GlooTransport
from deadpool_ext.replicate.transport import BlobReceive, BlobSend
from deadpool_ext.snapshot import format as fmt
from deadpool_ext.snapshot.slots import probe_slot, serialize

IMPLEMENTATIONS = {"gloo": lambda group, signer: GlooTransport(group, signer)}
KEY, OTHER = b"k" * 32, b"o" * 32


def signer_for(case: str, rank: int) -> BlobSigner:
    if case == "signed" or (case in ("forged", "unsigned") and rank == 1):
        return BlobSigner(KEY)
    return BlobSigner({"forged": OTHER}.get(case))


def probe(t: torch.Tensor) -> tuple:
    return probe_slot(memoryview(t.numpy()), verify=True)


def blob(rank: int, n: int) -> torch.Tensor:
    obj = {"w": torch.arange(n, dtype=torch.float32) + 1000 * rank, "step": rank}
    return torch.frombuffer(bytearray(serialize(obj, {"rank": rank, "version": 7})), dtype=torch.uint8)


def main(impl: str, cases: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    for case in cases.split(","):
        run(impl, case, out_dir)
    os._exit(0)  # skip destroying a group whose peer is gone


def run(impl: str, case: str, out_dir: str) -> None:
    rank = dist.get_rank()
    transport = IMPLEMENTATIONS[impl](dist.new_group(backend="gloo", timeout=timedelta(seconds=20)),
                                      signer_for(case, dist.get_rank()))
    mine, theirs = blob(rank, 100 + 900 * rank), blob(1 - rank, 100 + 900 * (1 - rank))
    into = torch.zeros(theirs.numel() + 4096, dtype=torch.uint8)
    old = blob(9, 10)
    into[:old.numel()].copy_(old)
    out: dict = {"rank": rank, "old_valid": probe(into)[0] is not None}
    if case in ("both_ways", "signed", "forged", "unsigned"):
        refused = transport.exchange([BlobSend(1 - rank, mine)], [BlobReceive(1 - rank, into, theirs.numel())])
        meta, why = probe(into)
        out.update(intact=bool(torch.equal(into[:theirs.numel()], theirs)), meta=meta, why=why,
                   refused=sorted(refused), magic_zero=not any(bytes(into[fmt.MAGIC_SLICE])),
                   body_arrived=bool(torch.equal(into[fmt.BODY_START:theirs.numel()], theirs[fmt.BODY_START:])))
    elif case in ("pieces", "pieces_corrupt"):
        if case == "pieces_corrupt" and rank == 0:
            mine[-5] ^= 0xFF  # the last tensor's bytes, after the checksums were written
        seen: list[int] = []
        check = fmt.StreamVerifier(memoryview(into[:theirs.numel()].numpy()))

        def progress(upto: int) -> None:
            seen.append(upto)
            check.advance(upto)

        transport.exchange([BlobSend(1 - rank, mine)], [BlobReceive(1 - rank, into, theirs.numel(), progress)],
                           chunk_bytes=512)
        out.update(seen=seen, nbytes=theirs.numel(), hashed_early=check.hashed_early, problem=check.finish(),
                   intact=bool(torch.equal(into[:theirs.numel()], theirs)))
    elif case == "closed":
        # Rank 1's transport is closed (a hot-swap replaced it) while its round is in flight: the bodies complete,
        # the trailer is not awaited, the buffer stays torn; rank 0 (sending only) completes its round.
        try:
            if rank == 0:
                transport.exchange([BlobSend(1, mine)], [])
            else:
                transport.closed = True
                transport.exchange([], [BlobReceive(0, into, theirs.numel())])
            out["raised"] = None
        except RuntimeError as exc:
            out["raised"] = type(exc).__name__
        meta, why = probe(into)
        out.update(magic_zero=not any(bytes(into[fmt.MAGIC_SLICE])), meta=meta, why=why,
                   body_arrived=bool(torch.equal(into[fmt.BODY_START:theirs.numel()], theirs[fmt.BODY_START:])))
    elif case == "torn":
        if rank == 0:
            dist.barrier()
            os._exit(0)  # gone before sending anything
        dist.barrier()
        try:
            transport.exchange([], [BlobReceive(0, into, theirs.numel())])
            out["raised"] = None
        except RuntimeError as exc:
            out["raised"] = type(exc).__name__
        meta, why = probe(into)
        out.update(magic_zero=not any(bytes(into[fmt.MAGIC_SLICE])), meta=meta, why=why)
    with open(os.path.join(out_dir, f"{case}.rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
