"""``patches/torch_solo_broadcast_object.py``: while the caller's predicate says the groups are local (a hot-swap
spare's solo set-up), ``broadcast_object_list`` keeps the caller's objects and communicates nothing; otherwise it
is torch's own (here: no process group exists, so torch's refuses)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from deadpool_ext import patches


@pytest.fixture
def solo_patch():
    p = patches.get("torch_solo_broadcast_object")
    state = {"local": True}
    p.set_local(lambda: state["local"])
    p.apply()
    yield state
    p.revert()


def test_objects_stay_as_passed_while_local_and_torch_decides_otherwise(solo_patch):
    objs = ["/runs/lightning_logs", {"k": 1}]
    assert dist.broadcast_object_list(objs, src=0) is None
    assert objs == ["/runs/lightning_logs", {"k": 1}]
    solo_patch["local"] = False
    assert not dist.is_initialized()
    with pytest.raises((ValueError, RuntimeError)):
        dist.broadcast_object_list(objs, src=0)


def test_revert_restores_torchs_function(solo_patch):
    p = patches.get("torch_solo_broadcast_object")
    original = dist.broadcast_object_list.__wrapped__
    p.revert()
    assert dist.broadcast_object_list is original
    p.apply()  # the fixture reverts again
