"""One rank of the two-rank gloo job of tests/security/test_network.py (run as a script, not collected).

Usage: python _peer_job.py RANK STORE_PORT OUT_DIR. Rank 0 is honest and records what each scenario did in
OUT_DIR/rank0.json; rank 1 plays the peer: honest in the first scenarios, then it speaks the wire protocol
of ``all_gather_object`` / ``broadcast_object_list`` (sizes as int64, then the padded bytes), which is also
the protocol of the JSON collectives, with a pickle that creates a marker file when unpickled.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))   # unpickling opens (creates) the marker file


def _evil_bytes(marker: str) -> bytes:
    return pickle.dumps(_Payload(marker))


def _send_gather(payload: bytes, announced: int | None = None) -> None:
    """Rank 1's half of an all_gather_object / allgather_json, with `payload` as its message."""
    n = len(payload) if announced is None else announced
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.int64))
    if announced is not None:
        return   # the honest rank refuses the size; nothing more is exchanged
    longest = int(max(s.item() for s in sizes))
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(2)]
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.all_gather(out, mine)


def _send_broadcast(payload: bytes, announced: int | None = None) -> None:
    """Rank 1 as the source of a broadcast_object_list([obj], src=1) / broadcast_json(obj, src=1)."""
    dist.broadcast(torch.tensor([len(payload) if announced is None else announced], dtype=torch.int64), src=1)
    if announced is None:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone(), src=1)


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    from deadpool_ext.distributed import destroy_groups_at_exit
    destroy_groups_at_exit()  # leave while the interpreter is whole (pytorch/pytorch#179291)
    from deadpool_ext.cluster.comm import CommError, broadcast_json
    from deadpool_ext.snapshot.rng_json import gather_rng_states
    from deadpool_ext.snapshot.state import capture_rng

    results: dict[str, object] = {}

    def marker(name: str) -> str:
        return os.path.join(out_dir, f"marker-{name}")

    # 1. honest peers: every rank's state arrives exactly (compared on rank 0 with what rank 1 reports).
    torch.manual_seed(100 + rank)
    import random

    import numpy as np
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    random.gauss(0, 1)   # leaves a cached gaussian in python's state
    np.random.standard_normal()
    gathered = gather_rng_states()
    if rank == 1:
        mine = capture_rng()
        store.set("rank1_rng", json.dumps({"python": list(mine["python"][1]), "gauss": mine["python"][2],
                                            "numpy": mine["numpy"][1].tolist(), "cached": mine["numpy"][4],
                                            "torch": mine["torch"].tolist()}))
    else:
        ref = json.loads(store.get("rank1_rng"))
        g1 = gathered["1"]
        own = capture_rng()
        results["honest_gather"] = {
            "ranks": sorted(gathered),
            "rank1_exact": (list(g1["python"][1]) == ref["python"] and g1["python"][2] == ref["gauss"]
                            and g1["numpy"][1].tolist() == ref["numpy"] and g1["numpy"][4] == ref["cached"]
                            and g1["torch"].tolist() == ref["torch"]),
            "own_exact": (gathered["0"]["python"] == own["python"] and torch.equal(gathered["0"]["torch"], own["torch"])
                          and (gathered["0"]["numpy"][1] == own["numpy"][1]).all().item()),
        }
    dist.barrier()

    # 2. honest broadcast from rank 1.
    value = broadcast_json({"path": "/base/7", "layout": [1, 2, 1]} if rank == 1 else None, src=1)
    if rank == 0:
        results["honest_broadcast"] = value
    dist.barrier()

    # 3. control: the old API on the same bytes runs the payload (proves the payload is live).
    if rank == 1:
        _send_gather(_evil_bytes(marker("control")))
    else:
        got: list[object] = [None, None]
        dist.all_gather_object(got, {"honest": True})
        results["control_marker"] = os.path.exists(marker("control"))
    dist.barrier()

    # 4. the JSON gather (what rng_client_state now calls) on the same bytes.
    if rank == 1:
        _send_gather(_evil_bytes(marker("gather")))
    else:
        try:
            gather_rng_states()
            results["gather"] = "accepted"
        except ValueError as exc:
            results["gather"] = f"{type(exc).__name__}: {exc}"
        results["gather_marker"] = os.path.exists(marker("gather"))
    dist.barrier()

    # 5. broadcast_json with a pickle from the source.
    if rank == 1:
        _send_broadcast(_evil_bytes(marker("broadcast")))
    else:
        try:
            broadcast_json(None, src=1)
            results["broadcast"] = "accepted"
        except CommError as exc:
            results["broadcast"] = f"{type(exc).__name__}: {exc}"
        results["broadcast_marker"] = os.path.exists(marker("broadcast"))
    dist.barrier()

    # 6. an absurd announced size: refused before any allocation.
    if rank == 1:
        _send_gather(b"", announced=1 << 40)
    else:
        try:
            gather_rng_states()
            results["huge"] = "accepted"
        except ValueError as exc:
            results["huge"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()

    if rank == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
