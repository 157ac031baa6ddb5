"""The chaos planner is a pure function of (seed, trial): deterministic, covers the catalogue, refuses bad input."""
from __future__ import annotations

import pytest

from deadpool_ext.chaos.catalogue import FAULTS, LAYOUTS, TIER3_FAULTS, Fault
from deadpool_ext.chaos.check import check_trial
from deadpool_ext.chaos.plan import plan_campaign, plan_trial
from deadpool_ext.chaos.runner import JobRun, TrialRun


def test_same_seed_same_scenarios():
    a = plan_campaign(7, 30)
    b = plan_campaign(7, 30)
    assert a == b
    assert [s.to_json() for s in a] == [s.to_json() for s in b]
    assert plan_campaign(8, 30) != a


def test_a_trial_is_planned_alone_as_in_its_campaign():
    campaign = plan_campaign(3, 20)
    for t in (0, 5, 19):
        assert plan_trial(3, t) == campaign[t]


def test_consecutive_trials_cover_the_catalogue():
    for seed in range(25):
        assert {s.fault for s in plan_campaign(seed, len(FAULTS))} == set(FAULTS), seed


def test_many_seeds_cover_layouts_signals_and_variants():
    scenarios = [s for seed in range(40) for s in plan_campaign(seed, len(FAULTS))]
    assert {s.layout for s in scenarios} == set(LAYOUTS)
    sigs = {a.sig for s in scenarios if s.fault in (Fault.WORKER, Fault.NODE, Fault.SPARE) for a in s.actions[:1]}
    assert sigs == {"SIGKILL", "SIGSTOP"}
    assert {a.which for s in scenarios for a in s.actions if a.op == "corrupt" and a.tier == 1} == {"all", "newest"}
    replication_targets = {s.actions[0].target.split(".")[0] == f"node{s.actions[0].trigger.rank}"
                           for s in scenarios
                           if s.fault is Fault.IN_REPLICATION and LAYOUTS[s.layout].nproc_per_node == 1}
    assert replication_targets == {True, False}  # the source and the holder are both killed mid-transfer


def test_scenarios_respect_layouts():
    for seed in range(20):
        for s in plan_campaign(seed, 2 * len(FAULTS)):
            layout = LAYOUTS[s.layout]
            assert s.fault in layout.faults
            if layout.framework == "megatron":
                assert s.fault not in TIER3_FAULTS
            for a in s.actions:
                if a.trigger.kind in ("step", "slot_write", "replica_write"):
                    assert 2 <= a.trigger.value < s.iters, s
            if s.fault is Fault.CORRUPT_TIER1 and s.actions[1].which == "all":
                # a survivor may lose all its slots only if its replica holder survives
                survivor = f"node{s.actions[1].rank // layout.nproc_per_node}"
                assert layout.holder_node(survivor) != s.actions[0].target
            assert s.relaunch == (s.fault in TIER3_FAULTS)
            assert s.reproduce().startswith(f"deadpool chaos --seed {seed} --trial {s.trial} --layouts ")


def test_layout_and_fault_filters():
    only = plan_campaign(1, 10, layouts=["megatron"])
    assert {s.layout for s in only} == {"megatron"}
    assert not {s.fault for s in only} & TIER3_FAULTS
    sub = plan_campaign(2, 6, layouts=["zero3"], faults=[Fault.WORKER, Fault.CORRUPT_TIER2])
    assert {s.fault for s in sub} == {Fault.WORKER, Fault.CORRUPT_TIER2}
    assert "--faults worker,corrupt_tier2" in sub[0].reproduce()


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=-1, trial=0), "seed must be >= 0"),
    (dict(seed=1.5, trial=0), "seed must be an int"),
    (dict(seed=0, trial=True), "trial must be an int"),
    (dict(seed=0, trial=0, layouts=[]), "non-empty list"),
    (dict(seed=0, trial=0, layouts="zero3"), "non-empty list"),
    (dict(seed=0, trial=0, layouts=["zero4"]), r"unknown layout\(s\) \['zero4'\]"),
    (dict(seed=0, trial=0, faults=[]), "at least one"),
    (dict(seed=0, trial=0, layouts=["megatron"], faults=[Fault.TIER3_FULL]), "can run on layouts"),
])
def test_bad_arguments_are_refused_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_trial(**kwargs)
    with pytest.raises(ValueError, match="not a valid Fault"):
        plan_trial(0, 0, faults=["meteor"])
    with pytest.raises(ValueError, match="trials must be >= 1"):
        plan_campaign(0, 0)


def _run(metrics, output="", events=(), rc=0):
    return JobRun(returncode=rc, timed_out=False, elapsed_s=1.0, output=output, metrics=dict(metrics),
                  events=list(events))


def test_checker_flags_mismatch_and_unreported_corruption():
    sc = plan_trial(0, 0, layouts=["zero3"], faults=[Fault.CORRUPT_TIER1])
    base = {s: 1.0 / s for s in range(1, sc.iters + 1)}
    swap = [{"event": "assignment", "generation": 1}]
    corrupted = [{"action": "x", "fired": True}, {"action": "y", "fired": True, "corrupted": [
        {"tier": 1, "rank": 1, "index": 0, "version": 3, "file": "f", "path": "p"}]}]
    good_log = "tier 1: slot 0 of rank 1 unusable (checksum mismatch)\nrestoring step 2: 1 rank(s) from own memory, " \
               "2 from peer replicas {1: 2, 0: 1}\n"
    ok = check_trial(TrialRun(scenario=sc, first=_run(base, good_log, swap), relaunch=None, injected=corrupted,
                              workdir="."), base)
    assert ok.ok and ok.status == "passed" and ok.restores == {"tier1": 1, "tier2": 2, "tier3": 0}
    assert ok.refused["tier1"] == 1
    bad_log = "restoring step 3: 3 rank(s) from own memory, 0 from peer replicas {}\n"
    wrong = {**base, 5: 0.5}
    v = check_trial(TrialRun(scenario=sc, first=_run(wrong, bad_log, swap), relaunch=None, injected=corrupted,
                             workdir="."), base)
    assert not v.ok and v.mismatch
    assert any("never reported unusable" in p for p in v.problems)
    assert any("own (corrupt) memory" in p for p in v.problems)


def test_checker_fails_a_tier3_trial_whose_job_never_wrote_a_base():
    # Bases are due every save_interval steps: a run that finishes without one is a tier-3 failure (this is how
    # the suite caught the runtime's step hook no longer calling the persister), not a fault that "landed late".
    sc = plan_trial(0, 0, layouts=["zero2"], faults=[Fault.CORRUPT_TIER3])
    base = {s: 1.0 / s for s in range(1, sc.iters + 1)}
    run = _run(base)
    v = check_trial(TrialRun(scenario=sc, first=run, relaunch=run, workdir=".", injected=[
        {"action": "x", "fired": False, "note": "not injected: RuntimeError: job exited (rc=0) before base"}]), base)
    assert v.status == "failed" and "no tier-3 base was published" in v.problems[0]


def test_checker_requires_a_report_only_for_a_corrupt_replica_a_restore_read():
    # A survivor's replica corrupted because the lost rank's other buffer was torn ("unneeded"): the restore
    # checks only the copies it uses, so it need not be reported unless a restore of its version fetched it.
    sc = plan_trial(0, 0, layouts=["zero3"], faults=[Fault.CORRUPT_TIER2])
    base = {s: 1.0 / s for s in range(1, sc.iters + 1)}
    swap = [{"event": "assignment", "generation": 1}]

    def injected(unneeded: bool) -> list[dict]:
        return [{"action": "y", "fired": True, "corrupted": [
            {"tier": 2, "rank": 2, "index": 1, "version": 4, "file": "f", "path": "p", "unneeded": unneeded}]}]

    not_read = "restoring step 4: 2 rank(s) from own memory, 1 from peer replicas {1: 2}\n"
    read = "restoring step 4: 2 rank(s) from own memory, 1 from peer replicas {2: 0}\n"
    def run(log: str, inj: list[dict]):
        return check_trial(TrialRun(scenario=sc, first=_run(base, log, swap), relaunch=None, injected=inj,
                                    workdir="."), base)
    assert run(not_read, injected(True)).ok
    assert not run(read, injected(True)).ok  # fetched but never refused: must fail
    assert not run(not_read, injected(False)).ok  # the lost rank's own replica must always be reported
    reported = "tier 2: replica buffer 1 of rank 2 held here is unusable (checksum mismatch)\n" + read
    assert run(reported, injected(True)).ok


def test_checker_requires_a_report_only_for_a_corrupt_slot_whose_version_was_restored():
    # The corrupted slot holds step 7, but the agreed version was 6 (the lost rank's copies of 7 were torn by the
    # kill): the slot is never read, so nothing must report it; a restore of step 7 must have refused it.
    sc = plan_trial(0, 0, layouts=["zero3"], faults=[Fault.CORRUPT_TIER1])
    base = {s: 1.0 / s for s in range(1, sc.iters + 1)}
    swap = [{"event": "assignment", "generation": 1}]
    inj = [{"action": "y", "fired": True, "corrupted": [
        {"tier": 1, "rank": 2, "index": 0, "version": 7, "file": "f", "path": "p"}]}]

    def run(log: str):
        return check_trial(TrialRun(scenario=sc, first=_run(base, log, swap), relaunch=None, injected=inj,
                                    workdir="."), base)
    assert run("restoring step 6: 2 rank(s) from own memory, 1 from peer replicas {0: 1}\n").ok
    v = run("restoring step 7: 2 rank(s) from own memory, 1 from peer replicas {0: 1}\n")
    assert not v.ok and any("never reported unusable" in p for p in v.problems)
    assert any("own (corrupt) memory" in p for p in v.problems)


def test_planner_2_runs_every_fault_on_every_layout_that_takes_it():
    for seed in range(10):
        pairs = {(s.fault, s.layout) for s in plan_campaign(seed, len(FAULTS) * len(LAYOUTS))}
        assert pairs == {(f, name) for name, lay in LAYOUTS.items() for f in FAULTS if f in lay.faults}, seed


def test_planner_1_is_kept_for_recorded_trials():
    # The flaw planner 2 fixes: with 11 faults over 4 layouts, planner 1 puts each fault on one layout only.
    old = plan_campaign(200, 3 * len(FAULTS), planner=1)
    assert len({(s.fault, s.layout) for s in old}) == len(FAULTS)
    # A trial chaos_200.jsonl recorded under planner 1 (trial 0: zero1, in_replication) replays exactly ...
    sc = plan_trial(200, 0, planner=1)
    assert (sc.layout, sc.fault) == ("zero1", Fault.IN_REPLICATION)
    assert sc.reproduce().endswith(" --planner 1") and sc.to_json()["planner"] == 1
    # ... and the default planner's command needs no flag.
    assert "--planner" not in plan_trial(200, 0).reproduce()
    with pytest.raises(ValueError, match="planner must be one of"):
        plan_trial(0, 0, planner=3)


def test_a_fault_that_landed_off_plan_is_reported_as_not_injected_as_planned():
    """A step-triggered signal is sent from outside the job: on a loaded host with fast steps it can land several
    steps after its plan (seed 0's trial 1: planned after step 4, landed after step 10). The injector records where
    it landed (inject.off_plan, pure); a run that recovered anyway did not test the plan's moment: status
    not_injected, the note saying where it landed. A run that failed stays failed."""
    from deadpool_ext.chaos.inject import off_plan

    assert off_plan(4, 4) is None and off_plan(4, 5) is None and off_plan(4, None) is None
    assert off_plan(4, 10) == "not injected as planned: planned after step 4, landed after step 10"
    sc = plan_trial(0, 0, layouts=["zero3"], faults=[Fault.WORKER])
    base = {s: 1.0 / s for s in range(1, sc.iters + 1)}
    swap = [{"event": "assignment", "generation": 1}]
    landed = [{"action": "x", "fired": True, "landed_after": 10, "as_planned": False, "note": off_plan(4, 10)}]
    v = check_trial(TrialRun(scenario=sc, first=_run(base, "", swap), relaunch=None, injected=landed, workdir="."),
                    base)
    assert v.ok and v.status == "not_injected" and v.notes == [off_plan(4, 10)] and v.faults_injected == 1
    on_plan = [{**landed[0], "landed_after": 5, "as_planned": True, "note": ""}]
    v = check_trial(TrialRun(scenario=sc, first=_run(base, "", swap), relaunch=None, injected=on_plan, workdir="."),
                    base)
    assert v.ok and v.status == "passed"
    v = check_trial(TrialRun(scenario=sc, first=_run(base, "", swap, rc=1), relaunch=None, injected=landed,
                             workdir="."), base)
    assert not v.ok and v.status == "failed"
