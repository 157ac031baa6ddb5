"""A spare built ahead of any failure (``rebuild/spare.py``): which ranks it builds for, how the coordinator prefers
it, what its heartbeat may say, and when its assignment lets it join (pure parts; the end-to-end swap is
tests/integration/test_hot_swap.py)."""
from __future__ import annotations

import json

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import (
    fits,
    initial_assignment,
    prepared_rank,
    replace_failed,
    shadowed_node,
    spares_ready,
)
from deadpool_ext.launcher import values
from deadpool_ext.launcher.hangs import prepared_spares
from deadpool_ext.rebuild.spare import BuiltAhead, matches, takeover


def _job(nodes=3, spares=2, nproc=1):
    workers = [Worker(f"{n}.{i}", n, i) for n in [f"node{k}" for k in range(nodes)] + [f"spare{k}" for k in
                                                                                        range(spares)]
               for i in range(nproc)]
    a = initial_assignment(workers, [f"node{k}" for k in range(nodes)], [f"spare{k}" for k in range(spares)])
    return workers, a


def test_the_ith_spare_shadows_the_node_after_the_ith():
    _, a = _job(nodes=3, spares=4)
    assert [shadowed_node(a, f"spare{i}") for i in range(4)] == ["node1", "node2", "node0", "node1"]
    assert shadowed_node(a, "node0") is None


def test_each_process_of_a_spare_takes_the_rank_of_its_local_index():
    _, a = _job(nodes=2, spares=1, nproc=2)
    assert [prepared_rank(a, "spare0", i) for i in range(3)] == [2, 3, None]


def test_the_spare_built_for_the_failed_nodes_ranks_is_preferred():
    workers, a = _job(nodes=3, spares=2)
    prepared = {"spare0.0": (1, 3), "spare1.0": (2, 3)}
    new = replace_failed(a, workers, {"node2"}, prepared=prepared)
    assert new.replaced == {"node2": "spare1"} and new.spares == ("spare0",)
    assert new.ranks["spare1.0"] == 2
    # none built for it: the next in order, as before
    assert replace_failed(a, workers, {"node0"}, prepared=prepared).replaced == {"node0": "spare0"}
    assert replace_failed(a, workers, {"node2"}).replaced == {"node2": "spare0"}


def test_two_failed_nodes_each_get_the_spare_built_for_them():
    workers, a = _job(nodes=3, spares=2)
    new = replace_failed(a, workers, {"node1", "node2"}, prepared={"spare0.0": (2, 3), "spare1.0": (1, 3)})
    assert new.replaced == {"node1": "spare1", "node2": "spare0"}


def test_a_spare_built_for_another_world_size_does_not_fit():
    workers, a = _job(nodes=3, spares=1)
    spare = [w for w in workers if w.node == "spare0"]
    assert fits(a, "node1", spare, {"spare0.0": (1, 3)})
    assert not fits(a, "node1", spare, {"spare0.0": (1, 4)})
    assert not fits(a, "node1", spare, {})


def test_the_coordinator_reads_prepared_from_heartbeats_and_says_which_spare_was_ready():
    workers, a = _job(nodes=3, spares=2)
    beats = {"spare0.0": {"t": 1.0, "prepared": [1, 3]}, "node0.0": {"t": 1.0}}
    prepared = prepared_spares(beats)
    assert prepared == {"spare0.0": (1, 3)}
    new = replace_failed(a, workers, {"node1", "node2"}, prepared=prepared)
    assert spares_ready(a, new, workers, prepared) == {"node1": True, "node2": False}


def _beat(**extra):
    return json.dumps({"t": 1.0, "step": -1, "step_at": 0.0, "coll": False, "still_s": 0.0, **extra}).encode()


def test_a_heartbeat_names_at_most_a_rank_and_a_world_size():
    assert values.heartbeat("hb/spare0.0", _beat(prepared=[1, 3]))["prepared"] == [1, 3]
    assert "prepared" not in values.heartbeat("hb/node0.0", _beat())
    for bad in ([1], [1, 0], [-1, 3], ["1", 3], [1, 3, 5], {"rank": 1}, [1, 1 << 40]):
        with pytest.raises(values.BadValue, match="prepared"):
            values.heartbeat("hb/spare0.0", _beat(prepared=bad))


def test_only_the_ranks_and_world_it_built_for_let_a_spare_join_as_it_is():
    workers, a = _job(nodes=3, spares=1)
    built = BuiltAhead(rank=1, world_size=3, generation=0, node="node1", timeout_s=60.0)
    assert matches(replace_failed(a, workers, {"node1"}), "spare0.0", built)
    assert not matches(replace_failed(a, workers, {"node2"}), "spare0.0", built)


def test_a_spare_told_not_to_build_ahead_waits_and_touches_nothing():
    """``hot_swap.spare_build_ahead: false`` (or no in-place swap): the spare keeps the older path (waits for its
    assignment before its script), and nothing of the store or torch.distributed is touched."""
    from deadpool_ext.rebuild.context import context
    from deadpool_ext.rebuild.fastpaths import FastPaths
    from deadpool_ext.rebuild.spare import build_ahead

    class NoStore:
        def __getattr__(self, name):
            raise AssertionError(f"the store was used ({name})")

    off = FastPaths(True, False, "hot_swap.spare_build_ahead is false in ds.json")
    assert not build_ahead(NoStore(), "spare0.0", "spare0", 60.0, fast=off)
    assert context().spare.built is None and context().progress.prepared is None


def test_a_resized_generation_never_lets_a_built_spare_join_as_it_is():
    from dataclasses import replace

    workers, a = _job(nodes=3, spares=1)
    built = BuiltAhead(rank=1, world_size=3, generation=0, node="node1", timeout_s=60.0)
    new = replace_failed(a, workers, {"node1"})
    assert matches(new, "spare0.0", built)
    assert not matches(replace(new, grown=("extra0",)), "spare0.0", built)


def test_a_spare_built_for_one_rank_takes_another_of_the_same_world_in_place_unless_something_blocks_it():
    """Issue 44: the spare built for node1's rank 1 takes node2's rank 2 (or node0's rank 0) by relabelling its
    engine; only a blocker its framework or groups name, another world size or a resize start it again."""
    from dataclasses import replace

    workers, a = _job(nodes=3, spares=1)
    built = BuiltAhead(rank=1, world_size=3, generation=0, node="node1", timeout_s=60.0)
    assert takeover(replace_failed(a, workers, {"node1"}), "spare0.0", built, "anything").how == "as_built"
    for failed, rank in (("node2", 2), ("node0", 0)):
        t = takeover(replace_failed(a, workers, {failed}), "spare0.0", built, None)
        assert (t.how, t.rank, t.why) == ("relabel", rank, "")
    t = takeover(replace_failed(a, workers, {"node2"}), "spare0.0", built, "pipeline parallelism (each stage ...)")
    assert (t.how, t.rank, t.why) == ("start_again", 2, "pipeline parallelism (each stage ...)")
    other = BuiltAhead(rank=1, world_size=4, generation=0, node="node1", timeout_s=60.0)
    t = takeover(replace_failed(a, workers, {"node2"}), "spare0.0", other, None)
    assert t.how == "start_again" and t.why == "the world has 3 ranks, its engine was built for 4"
    t = takeover(replace(replace_failed(a, workers, {"node2"}), grown=("extra0",)), "spare0.0", built, None)
    assert t.how == "start_again" and "resized" in t.why


def _frames(*places):
    """Fake frames, innermost first: (file, line) each."""
    from types import SimpleNamespace

    frame = None
    for path, line in reversed(places):
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=path), f_lineno=line, f_back=frame)
    return frame


def test_who_read_the_rank_is_the_first_caller_outside_torch_and_the_standard_library():
    from deadpool_ext.rebuild.rank_reads import caller_outside

    roots = (("/v/torch/", "/usr/lib/python3.11/"), ("/v/deepspeed/", "/r/deadpool_ext/"),
             ("/r/deadpool_ext/training/",))
    user = _frames(("/v/torch/distributed/c10d.py", 9), ("/v/torch/utils/data/distributed.py", 70), ("/j/train.py", 12))
    assert caller_outside(user, *roots) == "/j/train.py:12"
    ds = _frames(("/v/torch/distributed/c10d.py", 9), ("/v/deepspeed/runtime/engine.py", 5), ("/j/train.py", 30))
    assert caller_outside(ds, *roots) is None  # DeepSpeed's reads are relabelled (takeover.py)
    demo = _frames(("<frozen os>", 1), ("/usr/lib/python3.11/os.py", 3), ("/r/deadpool_ext/training/pretrain.py", 7))
    assert caller_outside(demo, *roots) == "/r/deadpool_ext/training/pretrain.py:7"  # the demo is a user's script


def test_a_script_reading_its_rank_from_the_environment_while_the_spare_builds_is_named(tmp_path, monkeypatch):
    import importlib.util
    import os

    from deadpool_ext.rebuild import rank_reads

    script = tmp_path / "train.py"
    script.write_text("import os\n\n\ndef rank():\n    return int(os.environ['RANK'])\n")
    spec = importlib.util.spec_from_file_location("train_under_test", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("RANK", "1")
    rank_reads.start()
    try:
        assert os.environ.get("LOCAL_RANK", "0") is not None  # not watched: the same on every node's process i
        assert mod.rank() == 1 and mod.rank() == 1
    finally:
        line = rank_reads.stop()
    assert line == f"the script read its rank before deepspeed.initialize returned, at {script}:5", line
    assert type(os.environ) is os._Environ and rank_reads.stop() is None


def test_reading_every_variable_is_no_read_of_the_rank(monkeypatch):
    """``os.environ.items()``, ``copy()``, ``dict(os.environ)`` (a library scanning for its own variables, a
    subprocess's environment) read RANK's value too, but nobody keeps it as a rank."""
    import os

    from deadpool_ext.rebuild import rank_reads

    monkeypatch.setenv("RANK", "1")
    rank_reads.start()
    try:
        assert dict(os.environ.items())["RANK"] == "1" and os.environ.copy()["RANK"] == "1"
        assert dict(os.environ)["RANK"] == "1"  # fsspec's config does this at import
        assert [v for k, v in os.environ.items() if k == "RANK"] == ["1"]
    finally:
        assert rank_reads.stop() is None


def test_deepspeeds_reads_are_told_apart_before_the_script_imports_it():
    """A spare's watch starts before its script imports DeepSpeed: DeepSpeed's directory is found by its spec then
    (nothing of it run), so ``deepspeed/comm/comm.py`` reading the rank inside ``deepspeed.initialize`` is not taken
    for the script's own read (it blocked every relabel of a tutorial-style script)."""
    import subprocess
    import sys

    code = ("import sys; from deadpool_ext.rebuild import rank_reads; where = rank_reads._dir_of('deepspeed'); "
            "sys.exit(3 if 'deepspeed' in sys.modules else 0 if where and where.endswith('/deepspeed/') else 4)")
    rc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode
    assert rc == 0, "3: DeepSpeed was imported to find it; 4: not found"


def test_reads_under_a_package_the_relabel_covers_block_nothing(monkeypatch):
    """Accelerate reads the rank while a Trainer script builds its arguments (``accelerate/state.py``): with the
    Trainer's relabel offered (``framework_takeover.Found.covers``), such a read blocks nothing; without it, or from the
    script itself, it still does."""
    import os

    import accelerate

    from deadpool_ext.integrations.framework_takeover import ACCELERATE_COVERS as COVERS
    from deadpool_ext.rebuild import rank_reads
    from deadpool_ext.rebuild.context import context

    inside = os.path.join(os.path.dirname(accelerate.__file__), "state.py") + ":305"
    for covers, reads, blocked in (((), [inside], True), (COVERS, [inside], False),
                                   (COVERS, [inside, "/job/train.py:9"], True)):
        rank_reads.start()
        context().rank_reads.extend(reads)
        line = rank_reads.stop(covers)
        assert (line is not None) == blocked, (covers, reads, line)


def _accelerate_job(monkeypatch):
    """Accelerate's state as a 2-rank job's rank 1 holds it, with a sharded loader, a DistributedSampler and a
    Trainer's state (the process's real shared-state dicts, restored after the test)."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from accelerate.state import AcceleratorState, PartialState
    from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler
    from transformers.trainer_callback import TrainerState

    for cls in (PartialState, AcceleratorState):
        monkeypatch.setattr(cls, "_shared_state", {"process_index": 1, "num_processes": 2})
    data = list(range(16))
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(data), 2, False), num_processes=2, process_index=1)
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    state = TrainerState(is_world_process_zero=False)
    return torch, shard, sampler, state


def test_an_hf_trainer_jobs_copies_of_the_rank_are_relabelled(monkeypatch):
    """A spare built for rank 1 and assigned rank 0: every copy of the rank Accelerate and the Trainer keep is set to
    0 (the process index, the batches each loader's shard takes, the sampler's rank, the Trainer's "world process
    zero"), and the loader then yields what one built for rank 0 yields."""
    from accelerate.data_loader import BatchSamplerShard
    from accelerate.state import AcceleratorState, PartialState
    from torch.utils.data import BatchSampler, SequentialSampler
    from transformers.trainer_callback import TrainerState

    from deadpool_ext.integrations import framework_takeover as acc

    _, shard, sampler, state = _accelerate_job(monkeypatch)
    found = acc.find()
    assert found is not None and shard in found.shards and sampler in found.samplers and state in found.trainer_states
    found.trainers = 1  # the Trainer object itself is not made here (a model, arguments, a dataset)
    assert acc.refusal(found) is None
    acc.relabel(found, 0)
    built0 = BatchSamplerShard(BatchSampler(SequentialSampler(list(range(16))), 2, False), num_processes=2,
                               process_index=0)
    assert list(shard) == list(built0) and sampler.rank == 0 and list(sampler) == list(range(0, 16, 2))
    assert PartialState._shared_state["process_index"] == AcceleratorState._shared_state["process_index"] == 0
    assert state.is_world_process_zero is True and isinstance(state, TrainerState)


def test_an_accelerate_loop_of_the_scripts_own_starts_again(monkeypatch):
    """No Trainer: the script's own loop may keep copies of the process index the watch cannot see; a datasets
    iterable sharded into a copy per process cannot be relabelled; another Accelerate version is not verified."""
    from deadpool_ext.integrations import framework_takeover as acc

    found = acc.Found(version="1.15.0")
    assert "an Accelerate loop of the script's own" in acc.refusal(found)
    found.trainers = 1
    assert acc.refusal(found) is None
    assert "sharded into a copy" in acc.refusal(acc.Found(version="1.15.0", trainers=1,
                                                          sharded_copies=["IterableDataset"]))
    assert acc.refusal(acc.Found(version="2.1.0", trainers=1)).startswith("Accelerate 2.1.0")


def test_a_lightning_jobs_copies_of_the_rank_are_relabelled(monkeypatch):
    """Lightning keeps the rank in each cluster environment (its strategy, trainer and module answer from it) and in
    ``rank_zero_only.rank`` (rank-zero logging, the loggers): a spare built for rank 1 and assigned rank 0 sets
    both, and the packages it covers include Lightning's."""
    import sys

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from deadpool_ext.integrations import framework_takeover as ft

    if "accelerate.state" in sys.modules:  # no Accelerate job in this process (another test may have made one)
        state = sys.modules["accelerate.state"]
        for cls in (state.PartialState, state.AcceleratorState):
            monkeypatch.setattr(cls, "_shared_state", {})
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    monkeypatch.setattr(utils_rank_zero_only, "rank", 1, raising=False)
    env = LightningEnvironment()
    env.set_global_rank(1)
    found = ft.find()
    assert found is not None and any(e is env for e in found.cluster_envs) and found.lightning_version
    assert "lightning" in found.covers and ft.refusal(found) is None
    ft.relabel(found, 0)
    assert env.global_rank() == 0 and rank_zero_only.rank == 0 and utils_rank_zero_only.rank == 0
    assert ft.refusal(ft.Found(lightning_version="3.1.0")).startswith("Lightning 3.1.0")
