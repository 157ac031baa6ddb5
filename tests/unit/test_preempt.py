"""Preemption without loss (issue 46, part 3): the drain's rules (``preempt/decide.py``), its store messages, the
launcher's reading of a drain (``launcher/drain.py``), the worker's state and SIGTERM handler, and the tier-3
writer's promise that a version whose budget runs out is never published as complete. No processes."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from deadpool_ext.config import DEFAULT_GRACE_S, ConfigError, DeadpoolConfig
from deadpool_ext.launcher import keys, values
from deadpool_ext.launcher.decide import Observation
from deadpool_ext.launcher.drain import drained_observation, local_workers_exited
from deadpool_ext.persist.layout import COMMIT, list_versions, read_commit
from deadpool_ext.persist.storage import open_storage
from deadpool_ext.persist.throttle import Throttle
from deadpool_ext.persist.writer import BaseJob, BaseWriter, CapturedFile
from deadpool_ext.preempt import decide, messages
from deadpool_ext.preempt.state import DrainState

# -- the budget ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,job,seconds,source", [
    (None, None, DEFAULT_GRACE_S, "the default"),
    (None, 12.0, 12.0, "deadpool.preemption.grace_s"),
    (8.0, 12.0, 8.0, "--preempt-grace-s"),          # the flag wins, for the workers too (handed to them)
    (float("nan"), 12.0, 12.0, "deadpool.preemption.grace_s"),
    (0.0, None, DEFAULT_GRACE_S, "the default"),
])
def test_the_budget_has_one_resolution(flag, job, seconds, source):
    assert decide.resolve_grace(flag, job) == decide.Grace(seconds, source)


def test_the_default_budget_leaves_room_before_the_usual_sigkill():
    assert DEFAULT_GRACE_S < 30  # Slurm KillWait and Kubernetes terminationGracePeriodSeconds default to 30 s
    assert decide.worker_deadline(100.0, 25.0) == 100.0 + 25.0 - decide.EXIT_MARGIN_S
    assert decide.worker_deadline(100.0, 5.0) == pytest.approx(104.5)   # a tenth of a short budget
    assert decide.launcher_deadline(100.0, 25.0) == 125.0


def test_the_section_takes_the_budget_and_refuses_a_bad_one():
    assert DeadpoolConfig.from_dict({"preemption": {"grace_s": 10}}).preemption.grace_s == 10.0
    for bad in ({"grace_s": 0}, {"grace_s": -1}, {"enabled": "yes"}, {"grace": 3}):
        with pytest.raises(ConfigError) as err:
            DeadpoolConfig.from_dict({"preemption": bad})
        assert err.value.key is not None and err.value.key.startswith("deadpool.preemption.")


@pytest.mark.parametrize("left,need,rate,verdict", [
    (10.0, None, None, "unknown"),        # nothing measured yet: tried, the deadline guards it
    (10.0, 100 << 20, 50 << 20, "fits"),  # 2 s
    (1.0, 100 << 20, 50 << 20, "short"),
    (0.0, None, None, "short"),
    (-3.0, 1, 1, "short"),
])
def test_budget_verdict(left, need, rate, verdict):
    assert decide.budget_verdict(left, need, rate).verdict == verdict


def test_what_to_persist():
    fits = decide.budget_verdict(10.0, 1 << 20, 100 << 20)
    assert decide.plan_persist(12, url=None, newest_base=None, budget=fits).action == "none"
    assert decide.plan_persist(12, url="/c", newest_base=12, budget=fits).action == "have"
    assert decide.plan_persist(12, url="/c", newest_base=10, budget=fits).action == "write"
    short = decide.plan_persist(12, url="/c", newest_base=10, budget=decide.budget_verdict(0.5, 1 << 30, 1 << 20))
    assert short.action == "none" and "too short" in short.why
    assert decide.plan_persist(12, url="/c", newest_base=None,
                               budget=decide.budget_verdict(5.0, None, None)).action == "write"


def test_which_step_is_safe_and_the_exit_status():
    assert decide.safe_step(12, 10) == 12
    assert decide.safe_step(None, 10) == 10
    assert decide.safe_step(None, None) is None
    assert decide.exit_status(finished=False, stopped=False) == decide.PREEMPTED_EXIT == 75
    assert decide.exit_status(finished=True, stopped=False) == 0
    assert decide.exit_status(finished=False, stopped=True) == 1
    assert decide.PREEMPTED_EXIT not in (0, 1, 2, 3, 4, 70, 143)


def test_the_final_line_says_which_step_is_safe_and_where():
    g = decide.Grace(25.0, "the default")
    ok = decide.final_line(decide.Outcome(17, 17, 17, "/ckpt/run", 3.2, ""), g, "SIGTERM to the launcher of host 0")
    assert "step 17 is safe" in ok and "/ckpt/run/global_step17" in ok and "--load /ckpt/run" in ok
    assert "Exit status 75" in ok and "\n" not in ok
    short = decide.final_line(decide.Outcome(17, None, 10, "/ckpt/run", 25.0, "the budget was too short"), g, "x")
    assert "Step 10 is safe" in short and "steps 11-17 are lost" in short and "too short" in short
    none = decide.final_line(decide.Outcome(17, None, None, None, 0.1, "no tier 3"), g, "x")
    assert "step 0" in none
    assert "no rank reported a drain" in decide.final_line(None, g, "x")


# -- the store's messages --------------------------------------------------------------------------------------------

def _raw(v: object) -> bytes:
    return json.dumps(v).encode()


def test_what_each_writer_builds_its_readers_decode():
    req = messages.DrainRequest(5.0, "SIGTERM to worker node1.0")
    assert messages.drain_request(keys.DRAIN, _raw(req.to_json())) == req
    out = messages.DrainOutcome(step=17, persisted=17, safe=17, url="/c", seconds=1.5, why="", nbytes=9)
    back = messages.drain_outcome(keys.DRAINED, _raw(out.to_json()))
    assert (back.step, back.persisted, back.safe, back.url, back.seconds, back.nbytes) == (17, 17, 17, "/c", 1.5, 9)
    assert messages.grace_seconds(keys.JOB_GRACE, _raw(25.0)) == 25.0
    assert keys.BY_NAME[keys.DRAIN].schema is messages.drain_request
    assert keys.BY_NAME[keys.DRAINED].schema is messages.drain_outcome
    assert keys.BY_NAME[keys.JOB_GRACE].schema is messages.grace_seconds


@pytest.mark.parametrize("key,decoder,raw", [
    (keys.DRAIN, messages.drain_request, b'{"requested_at": 1.0, "by": "x", "extra": 1}'),
    (keys.DRAIN, messages.drain_request, b'{"requested_at": "soon", "by": "x"}'),
    (keys.DRAIN, messages.drain_request, b"\x80\x04pickle"),
    (keys.DRAINED, messages.drain_outcome, b'{"step": -1, "persisted": null, "safe": null, "url": null, '
                                           b'"seconds": 1, "why": ""}'),
    (keys.DRAINED, messages.drain_outcome, b'{"step": 1, "persisted": true, "safe": null, "url": null, '
                                           b'"seconds": 1, "why": ""}'),
    (keys.JOB_GRACE, messages.grace_seconds, b"0"),
    (keys.JOB_GRACE, messages.grace_seconds, b"1e400"),
])
def test_a_malformed_drain_value_is_refused_naming_its_key(key, decoder, raw):
    with pytest.raises(values.BadValue) as err:
        decoder(key, raw)
    assert str(err.value).startswith(f"store key '{key}': ")


# -- the launcher's reading of a drain --------------------------------------------------------------------------------

def test_a_drained_worker_is_done_and_a_spares_exit_no_failure():
    obs = Observation(now=1.0, exits={"node0.0": 75, "node1.0": -9, "spare0.0": -15}, done=frozenset({"node2.0"}))
    seen = drained_observation(obs, ("node0.0", "node1.0", "node2.0"), draining=True)
    assert dict(seen.exits) == {"node1.0": -9}       # a real failure during the drain is still one
    assert seen.done == frozenset({"node0.0", "node2.0"})
    before = drained_observation(obs, ("node0.0", "node1.0", "node2.0"), draining=False)
    assert dict(before.exits) == {"node1.0": -9, "spare0.0": -15}   # no drain seen yet: a lost spare is one
    assert before.done == frozenset({"node0.0", "node2.0"})         # exit 75 is a drain's, seen or not


def test_this_hosts_part_is_over_when_its_workers_of_the_generation_exited():
    ranks, local = ("node0.0", "node1.0"), {"node0.0", "spare0.0"}
    assert not local_workers_exited(ranks, local, {})
    assert local_workers_exited(ranks, local, {"node0.0": 75})   # the spare is not waited for


# -- a worker's state -------------------------------------------------------------------------------------------------

def test_the_first_request_wins_and_a_drained_process_ends_with_75():
    st = DrainState()
    assert st.deadline() is None
    assert st.request(10.0, "SIGTERM to worker node1.0")
    assert not st.request(11.0, "SIGTERM to the launcher of host 0")
    assert (st.requested_at, st.by) == (10.0, "SIGTERM to worker node1.0")
    assert st.deadline() == decide.worker_deadline(10.0, st.grace_s)
    st.exit_if_due()   # nothing drained yet: the call goes on
    st.outcome = decide.Outcome(3, 3, 3, "/c", 0.5, "")
    with pytest.raises(SystemExit) as end:
        st.exit_if_due()
    assert end.value.code == decide.PREEMPTED_EXIT


def test_agreement_alone_in_a_world_of_one():
    from deadpool_ext.preempt.worker import agree

    st = DrainState()
    assert agree(st, torch.device("cpu")) is None
    st.request(50.0, "x")
    got = agree(st, torch.device("cpu"))
    assert got is not None and got.requested_at == 50.0 and got.deadline == st.deadline()


def test_a_real_sigterm_to_an_armed_process_requests_a_drain_instead_of_ending_it():
    from deadpool_ext.config import PreemptionConfig
    from deadpool_ext.preempt.worker import install
    from deadpool_ext.rebuild.context import context

    before = signal.getsignal(signal.SIGTERM)
    st = context().drain
    saved = (st.requested_at, st.by, st.armed)
    try:
        install(PreemptionConfig(grace_s=7.0), rank=0)
        assert st.armed and st.grace_s == 7.0
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while st.requested_at is None and time.time() < deadline:
            time.sleep(0.01)
        assert st.requested and st.by.startswith("SIGTERM to worker")
    finally:
        signal.signal(signal.SIGTERM, before)
        st.requested_at, st.by, st.armed = saved


# -- never published as complete when the budget runs out ------------------------------------------------------------

def _job(version: int, deadline: float) -> BaseJob:
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    return BaseJob(version=version, tag=f"global_step{version}", rank=0, world_size=1, coordinator=True,
                   files=[CapturedFile("mp_rank_00_model_states.pt", state, 1 << 20)],
                   layout={"world_size": 1, "dp_world_size": 1, "zero_stage": 0, "global_steps": version,
                           "global_samples": version}, deadline=deadline)


def test_a_drain_write_past_its_deadline_is_never_published(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    writer = BaseWriter(storage, Throttle(0.0, False))
    ok = _job(5, time.time() + 60)
    writer.submit(ok)
    assert writer.wait_idle(60)
    assert ok.result["published"] and "verify_s" in ok.result   # read back verified before it counts
    late = _job(9, time.time() - 1)                               # the budget is already spent
    writer.submit(late)
    assert writer.wait_idle(60)
    writer.close(5)
    assert late.result["ok"] is False and "deadline" in late.result["error"]
    assert read_commit(storage, "global_step9") is None and not storage.exists(f"global_step9/{COMMIT}")
    complete = [v.version for v in list_versions(storage) if v.commit is not None]
    assert complete == [5]   # the step a --load resumes from: the verified one, never the late one
