"""Issue 43, parts 4 and 5, the pure decisions: a config built in code gets the same fast paths as a file on the
command line (``rebuild/fastpaths.py``: the runner's reading, the attach's record, what a spare and a later
generation make of them, each with its real reason), the record's schema, a spare that saw no config waiting for
the record or its assignment (``rebuild/spare.py``), the caller's ``args`` left whole by the DeepSpeed attach and
the pipeline engine's data-parallel size (``integrations/deepspeed``). End to end: tests/integration/
test_code_config_fast_paths.py."""
from __future__ import annotations

import argparse
import json

import pytest

from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.launcher import keys, values
from deadpool_ext.rebuild import fastpaths
from deadpool_ext.rebuild.fastpaths import FastPaths


def _cfg(**hot_swap) -> DeadpoolConfig:
    return DeadpoolConfig.from_dict({"hot_swap": hot_swap})


# -- the runner, before the script -----------------------------------------------------------------------------
def test_no_config_visible_assumes_the_sections_defaults_unconfirmed():
    fast = fastpaths.before_script([], [], None)
    assert fast == FastPaths(True, True, None, known=False)


@pytest.mark.parametrize("hot_swap,expected", [
    ({}, FastPaths(True, True)),
    ({"in_place": False}, FastPaths(False, False, "hot_swap.in_place is false in ds.json")),
    ({"spare_build_ahead": False}, FastPaths(True, False, "hot_swap.spare_build_ahead is false in ds.json")),
    ({"enabled": False}, FastPaths(False, False, "hot_swap.enabled is false in ds.json")),
])
def test_a_deepspeed_config_on_the_command_line_says_which_key_turned_a_fast_path_off(hot_swap, expected):
    assert fastpaths.before_script(["ds.json"], ["ds.json"], _cfg(**hot_swap)) == expected


def test_a_section_only_config_is_megatron_core_which_swaps_in_place_and_builds_ahead_too():
    assert fastpaths.before_script([], ["dp.json"], _cfg()) == FastPaths(True, True)
    off = fastpaths.before_script([], ["dp.json"], _cfg(spare_build_ahead=False))
    assert off == FastPaths(True, False, "hot_swap.spare_build_ahead is false in dp.json")


# -- the attach's record, and what spares and later generations make of it ---------------------------------------
def test_the_attach_names_the_code_built_config_or_the_framework():
    assert fastpaths.at_attach(_cfg(), swaps_in_place=True, framework="DeepSpeed") == FastPaths(True, True)
    off = fastpaths.at_attach(_cfg(in_place=False), swaps_in_place=True, framework="DeepSpeed")
    assert off.why_not == "hot_swap.in_place is false in the config the script passed to its engine"
    assert fastpaths.at_attach(_cfg(), swaps_in_place=True, framework="Megatron-Core") == FastPaths(True, True)
    other = fastpaths.at_attach(_cfg(), swaps_in_place=False, framework="SomeFramework")
    assert other.why_not == "every rank rebuilds (SomeFramework has no in-place swap)" and not other.in_place


def test_the_record_round_trips_through_its_schema():
    fast = fastpaths.at_attach(_cfg(spare_build_ahead=False), swaps_in_place=True, framework="DeepSpeed")
    raw = json.dumps(keys.fast_paths_value(fast.in_place, fast.build_ahead, fast.why_not)).encode()
    job = values.fast_paths(keys.JOB_FAST_PATHS, raw)
    assert fastpaths.from_record(job) == fast
    on = values.fast_paths(keys.JOB_FAST_PATHS, json.dumps(keys.fast_paths_value(True, True, None)).encode())
    assert fastpaths.from_record(on) == FastPaths(True, True, None)
    assert keys.BY_NAME[keys.JOB_FAST_PATHS].schema is values.fast_paths


@pytest.mark.parametrize("raw,why", [
    (b'{"in_place": 1, "build_ahead": true, "why": ""}', "'in_place' must be true or false"),
    (b'{"in_place": true, "why": ""}', "'build_ahead' must be true or false"),
    (b'{"in_place": true, "build_ahead": true, "why": "", "rank": 0}', "unknown field(s)"),
    (b'{"in_place": true, "build_ahead": true, "why": 3}', "'why' must be a string"),
    (b'[true, true]', "must be a JSON object"),
])
def test_a_malformed_record_is_refused_in_one_line_naming_the_key(raw, why):
    with pytest.raises(values.BadValue) as err:
        values.fast_paths(keys.JOB_FAST_PATHS, raw)
    line = str(err.value)
    assert "\n" not in line and line.startswith("store key 'config/fast_paths': ") and why in line, line


def test_a_spare_waits_for_the_record_only_when_it_saw_no_config():
    seen = FastPaths(False, False, "hot_swap.in_place is false in ds.json")
    assert fastpaths.for_spare(seen, None) is seen
    unknown = fastpaths.before_script([], [], None)
    assert fastpaths.for_spare(unknown, None) is None
    job = values.JobFastPaths(True, False, "hot_swap.spare_build_ahead is false in the config ...")
    assert fastpaths.for_spare(unknown, job) == FastPaths(True, False, job.why)


def test_groups_are_swappable_as_the_section_says_or_by_default_in_the_first_generation():
    unknown = fastpaths.before_script([], [], None)
    assert fastpaths.groups_in_place(unknown, None, 0)          # every rank builds: the defaults
    assert not fastpaths.groups_in_place(unknown, None, 2)      # nobody attached: no survivor keeps an engine
    assert not fastpaths.groups_in_place(unknown, values.JobFastPaths(False, False, "x"), 0)
    assert fastpaths.groups_in_place(unknown, values.JobFastPaths(True, False, "x"), 3)
    assert not fastpaths.groups_in_place(FastPaths(False, False, "x"), values.JobFastPaths(True, True, ""), 0)


# -- a spare that saw no config (rebuild/spare.py build_ahead, up to the point where it would build) -------------
class _Membership:
    """The two reads a waiting spare makes: the published assignment, the job's record (each a script of answers)."""

    def __init__(self, published, records):
        self._published, self._records = list(published), list(records)

    def published(self):
        return self._published.pop(0) if len(self._published) > 1 else self._published[0]

    def job_fast_paths(self):
        return self._records.pop(0) if len(self._records) > 1 else self._records[0]


def _published(with_spare_assigned: bool = False):
    from deadpool_ext.cluster.assignment import Worker
    from deadpool_ext.cluster.membership import initial_assignment, replace_failed

    workers = [Worker("node0.0", "node0", 0), Worker("node1.0", "node1", 0), Worker("spare0.0", "spare0", 0)]
    a = initial_assignment(workers, ["node0", "node1"], ["spare0"])
    return values.Published(replace_failed(a, workers, {"node1"}) if with_spare_assigned else a)


def test_a_spare_that_saw_no_config_waits_for_the_record_and_keeps_off_what_it_turns_off():
    from deadpool_ext.rebuild.context import context
    from deadpool_ext.rebuild.spare import build_ahead

    m = _Membership([_published()], [None, None, values.JobFastPaths(False, False, "hot_swap.in_place is false")])
    polls = []
    unknown = fastpaths.before_script([], [], None)
    assert not build_ahead(m, "spare0.0", "spare0", 60.0, fast=unknown, while_waiting=lambda: polls.append(1),
                           poll_s=0.0)
    assert len(polls) == 2                  # it waited, making its slots meanwhile, until the record came
    assert context().spare.built is None and context().progress.prepared is None


def test_a_spare_assigned_before_any_rank_attached_takes_the_plain_path():
    from deadpool_ext.rebuild.spare import build_ahead

    m = _Membership([_published(), _published(with_spare_assigned=True)], [None])
    assert not build_ahead(m, "spare0.0", "spare0", 60.0, fast=fastpaths.before_script([], [], None), poll_s=0.0)


# -- the DeepSpeed attach: the caller's args, the pipeline's data-parallel size ----------------------------------
def test_the_attach_never_changes_the_callers_args():
    """Bug (a): ``initialize()`` set the caller's ``args.deepspeed_config = None``, so a rebuild factory that passed
    the same ``args`` again got no config."""
    from deadpool_ext.integrations.deepspeed import args_without_config

    ns = argparse.Namespace(deepspeed_config="ds.json", local_rank=0)
    a, kw = args_without_config((ns, "model"), {})
    assert ns.deepspeed_config == "ds.json" and a[0] is not ns and a[0].deepspeed_config is None and a[1] == "model"
    a, kw = args_without_config((), {"args": ns, "model": "m"})
    assert ns.deepspeed_config == "ds.json" and kw["args"].deepspeed_config is None and kw["model"] == "m"
    plain = argparse.Namespace(local_rank=0)
    assert args_without_config((plain,), {}) == ((plain,), {})


def test_initialize_hands_deepspeed_a_copy_and_the_callers_args_keep_their_config():
    """The same through ``initialize()`` itself (DeepSpeed stood in by a function that records its call and, as
    DeepSpeed does, aligns ``args.local_rank``): a factory that calls it again with the same ``args`` gets the
    config again."""
    from types import SimpleNamespace

    from deadpool_ext.integrations.deepspeed import initialize

    calls = []

    def deepspeed_initialize(*args, config=None, **kwargs):
        ns = kwargs["args"]
        calls.append((ns.deepspeed_config, config))
        ns.local_rank = 1
        return SimpleNamespace(), None, None, None

    from deadpool_ext import patches

    quiet = patches.get("deepspeed_zero3_quiet_init")
    was = quiet.applied
    ns = argparse.Namespace(deepspeed_config={"train_batch_size": 2}, local_rank=-1)
    try:
        for _ in range(2):   # the first build, then a rebuild factory's call with the same args
            initialize(args=ns, model=object(), _ds_initialize=deepspeed_initialize)
    finally:
        if not was:
            quiet.revert()  # initialize() applies it for the engine it builds; other tests check it unapplied
    assert calls == [(None, {"train_batch_size": 2})] * 2
    assert ns.deepspeed_config == {"train_batch_size": 2} and ns.local_rank == 1


class _Topo:
    def __init__(self, **dims):
        self.dims = dims

    def get_dim(self, axis):
        return self.dims.get(axis, 0)


class _Pipe:
    def __init__(self, **dims):
        self._topo = _Topo(**dims)

    def topology(self):
        return self._topo


def test_a_pipelines_data_parallel_size_leaves_out_its_stages_and_model_parallel_ranks():
    """Bug (b): the global batch was rescaled by the whole world, not the data-parallel size."""
    from deadpool_ext.integrations.deepspeed.batch import BatchShape, data_parallel_size, parallel_dims, rescale

    assert parallel_dims(_Pipe(pipe=2, data=1)) == (2, 1)
    assert parallel_dims(_Pipe(pipe=2, model=2, data=2)) == (2, 2)
    assert parallel_dims(object()) == (1, 1)
    assert data_parallel_size(2, 2) == 1 and data_parallel_size(8, 2, 2) == 2 and data_parallel_size(4) == 4
    with pytest.raises(ValueError, match="a world of 3 ranks does not split into 2 pipeline stage"):
        data_parallel_size(3, 2)
    # a 2-stage pipeline on 2 ranks rebuilt in the same world: the config is the one the script passed
    first = BatchShape(global_batch=4, micro=2, accumulation=2, dp=1)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    assert rescale(cfg, first, data_parallel_size(2, *parallel_dims(_Pipe(pipe=2, data=1))), False) is cfg


# -- a spare that dies at start-up: a WARNING with its cause, not only an INFO event (part 5) ---------------------
def test_a_spare_whose_build_ahead_fails_writes_its_cause(tmp_path, monkeypatch):
    from deadpool_ext.launcher.contract import TIMELINE, reset_worker_env
    from deadpool_ext.rebuild.context import context
    from deadpool_ext.rebuild.spare import BuiltAhead, start_up_failure_said
    from deadpool_ext.recovery.timeline import read_events

    timeline = tmp_path / "t.jsonl"
    monkeypatch.setenv(TIMELINE, str(timeline))
    reset_worker_env()

    class M:
        worker_id = "spare0.0"

    ctx = context()
    monkeypatch.setattr(ctx, "membership", M())
    monkeypatch.setattr(ctx.spare, "built", BuiltAhead(rank=1, world_size=2, generation=0, node="node1",
                                                       timeout_s=60.0))
    try:
        with pytest.raises(RuntimeError), start_up_failure_said():
            raise RuntimeError("recv cannot be computed locally")
        with start_up_failure_said():   # nothing failed: nothing said
            pass
    finally:
        reset_worker_env()
    [ev] = read_events(str(timeline))
    assert (ev["event"], ev["worker"], ev["rank"], ev["error"]) == ("spare_failed", "spare0.0", 1, "RuntimeError")
