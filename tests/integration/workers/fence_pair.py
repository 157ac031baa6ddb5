"""Two gloo ranks: rank 0 blocks in recv from rank 1; rank 1 stays alive and cuts its generation's sockets.

Prints one JSON line per rank. Used by tests/integration/test_fence.py."""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool_ext.rebuild.fence import GenerationFence


def main() -> None:
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fence = GenerationFence()
    fence.begin(0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=45))
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        try:
            dist.recv(torch.zeros(4), src=1)
            outcome = "received"
        except RuntimeError as exc:
            outcome = "error: " + " ".join(str(exc).split())[:200]
        print(json.dumps({"rank": 0, "blocked_s": time.perf_counter() - t0, "outcome": outcome}), flush=True)
        os._exit(0)
    time.sleep(1.0)
    n = fence.cut(0, "test") if mode == "cut" else 0
    print(json.dumps({"rank": 1, "cut": n, "sockets_left": len(fence.sockets())}), flush=True)
    time.sleep(6.0)  # alive: only the cut, not a process exit, can release rank 0
    os._exit(0)


if __name__ == "__main__":
    main()
