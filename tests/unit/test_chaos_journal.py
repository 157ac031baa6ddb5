"""A chaos campaign in pieces (``chaos/journal.py``): the journal's format and its refusals, and a campaign that
stops at its time budget and continues from the journal without rerunning a trial or a baseline. The jobs
themselves are stood in for (a Runner that records what it was asked to run): what is under test is which trials
and baselines run, and what the report covers."""
from __future__ import annotations

import json
import types

import pytest

from deadpool_ext.chaos import campaign
from deadpool_ext.chaos.journal import Journal, JournalError, Pieces
from deadpool_ext.chaos.plan import plan_trial
from deadpool_ext.chaos.runner import JobRun, TrialRun

METRICS = {s: 5.0 - 0.1 * s for s in range(1, 13)}


class FakeRunner:
    """Every job 'runs' instantly with the baseline's losses: each trial passes unless its fault needs output."""

    ran: list[str] = []
    now = 0.0   # the campaign's clock: each trial takes 10 s of it

    def __init__(self, workdir, *, job_timeout_s=480.0, log=print):
        self.baselines: dict = {}

    def baseline(self, layout, iters):
        if (layout, iters) not in self.baselines:
            FakeRunner.ran.append(f"baseline {layout}/{iters}")
            self.baselines[(layout, iters)] = JobRun(returncode=0, timed_out=False, elapsed_s=1.0, output="",
                                                     metrics={s: METRICS[s] for s in range(1, iters + 1)})
        return self.baselines[(layout, iters)]

    def run_trial(self, sc):
        FakeRunner.ran.append(f"trial {sc.trial}")
        FakeRunner.now += 10.0
        return TrialRun(scenario=sc, first=self.baselines[(sc.layout, sc.iters)], relaunch=None, injected=[],
                        workdir="w")

    def close(self):
        pass


@pytest.fixture
def fake_runner(monkeypatch):
    FakeRunner.ran, FakeRunner.now = [], 0.0
    monkeypatch.setattr(campaign, "Runner", FakeRunner)
    monkeypatch.setattr(campaign, "time", types.SimpleNamespace(time=lambda: FakeRunner.now))
    return FakeRunner


def test_a_campaign_stopped_by_its_budget_continues_from_the_journal(tmp_path, fake_runner):
    path = str(tmp_path / "j.jsonl")
    scenarios = [plan_trial(7, t, ["zero1"]) for t in range(4)]
    first = campaign.run_campaign(scenarios, journal=Journal(path, "host"), stop_after_s=15, log=lambda m: None)
    assert first["summary"]["ran_now"] == 2 and first["summary"]["pending"] == 2, first["summary"]
    assert fake_runner.ran == ["baseline zero1/" + str(scenarios[0].iters), "trial 0", "trial 1"]
    fake_runner.ran = []
    second = campaign.run_campaign(scenarios, journal=Journal(path, "host"), log=lambda m: None)
    assert fake_runner.ran == ["trial 2", "trial 3"]    # the baseline came from the journal, no trial twice
    assert [r["scenario"]["trial"] for r in second["rows"]] == [0, 1, 2, 3]
    assert second["summary"]["trials"] == 4 and second["summary"]["pending"] == 0
    lines = [json.loads(x) for x in open(path)]
    assert [x["kind"] for x in lines] == ["baseline", "trial", "trial", "trial", "trial"]


def test_a_torn_last_line_is_dropped_and_its_trial_runs_again(tmp_path, fake_runner):
    path = tmp_path / "j.jsonl"
    scenarios = [plan_trial(7, t, ["zero1"]) for t in range(2)]
    campaign.run_campaign(scenarios, journal=Journal(str(path), "host"), log=lambda m: None)
    text = path.read_text()
    path.write_text(text[: len(text) - 40])   # the last trial's line cut short, as by a kill mid-write
    said: list[str] = []
    j = Journal(str(path), "host", said.append)
    assert [r["scenario"]["trial"] for r in j.rows()] == [0] and "torn" in said[0], said
    fake_runner.ran = []
    campaign.run_campaign(scenarios, journal=j, log=lambda m: None)
    assert fake_runner.ran == ["trial 1"]
    assert path.read_text().endswith("\n") and len(Journal(str(path), "host").rows()) == 2


@pytest.mark.parametrize("line,says", [
    ("[1, 2]", "expected a JSON object"),
    ('{"kind": "trial", "mode": "moon"}', "'mode' must be one of"),
    ('{"kind": "pickle", "mode": "host"}', "'kind' must be 'baseline' or 'trial'"),
    ('{"kind": "baseline", "mode": "host", "layout": "zero1", "iters": 4, "metrics": {"1": "NaN"}}', "finite loss"),
    ('{"kind": "baseline", "mode": "host", "layout": "zero1", "iters": 4, "metrics": {"../x": 1.0}}', "step (digits)"),
    ('{"kind": "trial", "mode": "host", "key": "k", "row": {"scenario": {}}}', "'row' with 'scenario' and 'verdict'"),
    ("{not json", "not JSON"),
])
def test_a_line_the_journal_did_not_write_is_refused_with_its_place(tmp_path, line, says):
    path = tmp_path / "j.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(JournalError) as err:
        Journal(str(path), "host")
    assert str(err.value).startswith(f"{path}:1: ") and says in str(err.value), err.value


def test_modes_keep_their_own_trials_and_baselines(tmp_path):
    path = str(tmp_path / "j.jsonl")
    Journal(path, "bed").add_baseline("zero3", 10, {1: 2.0}, 3.0)
    Journal(path, "bed").add_trial("k", {"scenario": {}, "verdict": {}})
    host = Journal(path, "host")
    assert host.baseline("zero3", 10) is None and not host.has("k") and host.rows() == []
    bed = Journal(path, "bed")
    assert bed.baseline("zero3", 10)["metrics"] == {1: 2.0} and bed.has("k")


def test_the_bed_campaign_continues_from_the_journal(tmp_path, monkeypatch):
    from deadpool_ext.chaos import hostfaults

    ran: list[str] = []

    def fake_job(layout, workdir, tag, *, sc=None, job_timeout_s=480.0):
        ran.append(tag)
        return {"rcs": [0, 0, 0], "metrics": dict(METRICS), "events": [], "elapsed_s": 1.0, "timed_out": False,
                "tails": "", "marker": False}

    monkeypatch.setattr(hostfaults, "run_bed_job", fake_job)
    path = str(tmp_path / "j.jsonl")
    scenarios = [hostfaults.plan_host_trial(3, t, ["zero3"]) for t in range(3)]
    hostfaults.run_host_campaign(scenarios[:2], workdir=str(tmp_path), journal=Journal(path, "bed"), log=lambda m: None)
    assert ran == ["base-zero3", "trial-3-0", "trial-3-1"]
    ran.clear()
    report = hostfaults.run_host_campaign(scenarios, workdir=str(tmp_path), journal=Journal(path, "bed"),
                                          log=lambda m: None)
    assert ran == ["trial-3-2"]                     # baseline and trials 0, 1 from the journal
    assert [r["scenario"]["trial"] for r in report["rows"]] == [0, 1, 2]


def test_replay_failed_runs_only_failed_trials_again_and_the_replay_supersedes(tmp_path):
    path = str(tmp_path / "j.jsonl")
    j = Journal(path, "host")
    j.add_trial("a", {"scenario": {"trial": 0}, "verdict": {"status": "failed"}})
    j.add_trial("b", {"scenario": {"trial": 1}, "verdict": {"status": "passed"}})

    class Sc:
        def __init__(self, key, trial):
            self.key, self.trial = key, trial

        def reproduce(self):
            return self.key

    scenarios = [Sc("a", 0), Sc("b", 1), Sc("c", 2)]
    assert [s.key for s in Pieces(Journal(path, "host"), None, lambda m: None, "t").select(scenarios)] == ["c"]
    said: list[str] = []
    pieces = Pieces(Journal(path, "host"), None, said.append, "t", replay_failed=True)
    assert [s.key for s in pieces.select(scenarios)] == ["a", "c"] and "replaying" in said[0]
    pieces.record(scenarios[0], {"scenario": {"trial": 0}, "verdict": {"status": "passed"}})
    again = Journal(path, "host")
    assert [r["verdict"]["status"] for r in again.rows()] == ["passed", "passed"]   # a first, then b
    assert [r["verdict"]["status"] for r in again.replaced()] == ["failed"] and not again.failed("a")
