"""Two gloo ranks join generation 2 after rank 1's attempt at generation 1 failed while forming its group.

argv: rank, port, mode ("fixed" | "unfixed": the latter disables the group-name reset, as a control).
Prints one JSON line. Used by tests/integration/test_fence.py."""
import json
import sys
import time

import torch
import torch.distributed as dist

from deadpool_ext.cluster.assignment import Assignment
from deadpool_ext.rebuild import worker


def assignment(generation: int, port: int) -> Assignment:
    return Assignment(generation=generation, world_size=2, ranks={"a": 0, "b": 1}, nodes={"a": "n0", "b": "n1"},
                      master_port=port)


def main() -> None:
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if mode == "unfixed":
        worker._reset_group_names = lambda: None
    me = "a" if rank == 0 else "b"
    first = None
    if rank == 1:  # generation 1: rank 0 never comes, the rendezvous fails
        try:
            worker.init_process_group(assignment(1, port), me, "gloo", timeout_s=2.0)
            first = "formed"
        except RuntimeError as exc:
            first = "failed: " + " ".join(str(exc).split())[:120]
            worker.teardown(5.0)
    t0 = time.perf_counter()
    try:
        worker.init_process_group(assignment(2, port), me, "gloo", timeout_s=8.0)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        outcome = f"sum={t.item():g}"
    except RuntimeError as exc:
        outcome = "error: " + " ".join(str(exc).split())[:200]
    print(json.dumps({"rank": rank, "first": first, "outcome": outcome, "join_s": time.perf_counter() - t0}),
          flush=True)


if __name__ == "__main__":
    main()
