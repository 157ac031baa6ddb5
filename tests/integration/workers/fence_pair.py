"""Two gloo ranks: rank 0 blocks in recv from rank 1; rank 1 stays alive and cuts its generation's sockets.

Rank 1 acts once rank 0 has said (through the store) that it is entering recv, and then lets it block for
BLOCK_S more, so rank 0's ``blocked_s`` >= BLOCK_S shows it was blocked when released.
Prints one JSON line per rank. Used by tests/integration/test_fence.py."""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool_ext.rebuild.notice import GenerationFence

BLOCK_S = 0.5
"""How long rank 0 has been inside recv (at least) when rank 1 cuts."""
ALIVE_S = 6.0
"""How long rank 1 stays alive after that: only the cut, not its exit, can release rank 0 sooner."""


def main() -> None:
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fence = GenerationFence()
    fence.begin(0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=45))
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()  # before the announcement: rank 1's window starts after it
        store.set("entering_recv", b"1")
        try:
            dist.recv(torch.zeros(4), src=1)
            outcome = "received"
        except RuntimeError as exc:
            outcome = "error: " + " ".join(str(exc).split())[:200]
        print(json.dumps({"rank": 0, "blocked_s": time.perf_counter() - t0, "outcome": outcome}), flush=True)
        os._exit(0)
    store.wait(["entering_recv"], timedelta(seconds=30))  # raises after 30 s: rank 0 never got to its recv
    time.sleep(BLOCK_S)  # the window rank 0 spends blocked in recv before the cut (its blocked_s >= BLOCK_S)
    n = fence.cut(0, "test") if mode == "cut" else 0
    # Connections of the generation still open and not cut (a cut one stays in the table until its peer closes
    # too, which depends on how fast rank 0 exits: not what is tested here).
    left = [inode for inode in fence.sockets().values() if inode not in fence._cut]
    print(json.dumps({"rank": 1, "cut": n, "sockets_left": len(left), "block_s": BLOCK_S}), flush=True)
    time.sleep(ALIVE_S)  # alive: only the cut, not a process exit, can release rank 0
    os._exit(0)


if __name__ == "__main__":
    main()
