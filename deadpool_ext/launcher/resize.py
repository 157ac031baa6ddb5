"""Elastic grow: a node dropped by a shrink comes back and the job grows to it (docs/elastic.md).

Call order, through the store (so it works on one host and across hosts alike):

1. the coordinator, publishing a shrink, writes ``dropped/<node>`` (``decide.NoteDropped``);
2. the launcher of that node's host, ``--repair-after-s`` later (the stand-in for a repaired machine on this
   test bed; 0: never), clears what the node's dead processes left in the store (exit, done, heartbeat, fence
   records), starts its processes again as spares and writes ``repaired/<node>`` (:func:`repair_tick`, each turn
   of every launcher);
3. the coordinator, on a turn with no failure, grows the shrunk world by one repaired (or joined: ``join.py``)
   node whose processes all live and beat, once the shrunk world has formed: every one of its ranks finished a
   step since it was published (``hangs.not_formed``; a grow published while the survivors still rebuild the
   shrunk world would abandon that rebuild half done). The rule is ``decide.py``'s (``_Turn.grow``). Everyone
   keeps their rank, the node's processes take the next ones. The survivors get the new generation's notice like
   any other (the step in flight is redone), every rank rebuilds on the larger world and the restore reshards
   from memory.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

from . import keys, values
from .local import LocalNodes


def repair_tick(nodes: LocalNodes, reads: values.StoreValues, wait_s: float, event: Callable[..., None]) -> None:
    """Start again every local node a shrink dropped ``wait_s`` ago or earlier (0: never)."""
    if not wait_s:
        return
    for node, dropped_at in reads.items(keys.DROPPED, values.record_time).items():
        if node not in nodes.local or time.time() - dropped_at < wait_s:
            continue
        nodes.restart(node, reads.store)
        reads.store.set_json(keys.repaired(node), keys.repaired_value())
        event(event="repaired", node=node)
        print(f"deadpool-run: node {node} repaired (--repair-after-s {wait_s:g}): its processes started again, "
              "waiting to join the job", file=sys.stderr, flush=True)


__all__ = ["repair_tick"]
