"""The straggler rule (launcher/straggler.py), turn by turn without processes: heartbeats' paces in, names,
evictions and their guards out."""
from __future__ import annotations

import math

import pytest

from deadpool_ext.cluster.assignment import Assignment
from deadpool_ext.launcher import straggler as sg
from deadpool_ext.launcher.actions import Event, Log
from deadpool_ext.launcher.values import BadValue, heartbeat

WINDOW = 10.0


def assignment(n: int = 3, nproc: int = 1, generation: int = 0, spares: tuple[str, ...] = ("spare0",)) -> Assignment:
    ranks, nodes = {}, {}
    for i in range(n):
        for j in range(nproc):
            ranks[f"node{i}.{j}"] = i * nproc + j
            nodes[f"node{i}.{j}"] = f"node{i}"
    return Assignment(generation=generation, world_size=n * nproc, ranks=ranks, nodes=nodes, spares=spares)


class Job:
    """A synchronous job's heartbeats: every rank takes the slowest rank's wall time per step; each rank's busy
    time is its own, the rest of the step it waits in collectives."""

    def __init__(self, a: Assignment, busy: dict[str, float], measured: bool = True) -> None:
        self.a, self.busy, self.measured = a, dict(busy), measured
        self.t, self.steps = 0.0, 0
        self.totals = {w: [0.0, 0.0] for w in a.ranks}

    def run(self, seconds: float) -> None:
        """Train for ``seconds`` of wall time."""
        end = self.t + seconds
        while self.t < end:
            step = max(self.busy[w] for w in self.a.ranks)
            for w in self.a.ranks:
                self.totals[w][0] += step
                self.totals[w][1] += step - self.busy[w]
            self.t += step
            self.steps += 1

    def beats(self) -> dict[str, dict]:
        return {w: {"t": self.t, "pace": [self.steps, tot[0], tot[1], self.measured]}
                for w, tot in self.totals.items()}


def drive(job: Job, seconds: float, settings: sg.StragglerSettings, state: sg.StragglerState | None = None,
          spares: tuple[str, ...] = ("spare0",), every: float = 0.5):
    """Turns every ``every`` seconds for ``seconds``: (state, every verdict's actions, every eviction)."""
    state = state or sg.StragglerState()
    actions, evictions = [], []
    end = job.t + seconds
    while job.t < end:
        job.run(every)
        v = sg.judge(state, job.beats(), job.a, spares, job.t, settings)
        state = v.state
        actions += v.actions
        if v.evict:
            evictions.append((job.t, dict(v.evict)))
    return state, actions, evictions


def events(actions) -> list[dict]:
    """The straggler events among the actions."""
    return [a.fields for a in actions if isinstance(a, Event) and a.fields["event"] == "straggler"]


def said(actions) -> list:
    """Every action but the once-a-window ``pace`` events."""
    return [a for a in actions if not (isinstance(a, Event) and a.fields["event"] == "pace")]


def test_a_slow_node_is_named_once_per_window_with_the_seconds_the_job_lost():
    job = Job(assignment(), {"node0.0": 0.1, "node1.0": 0.4, "node2.0": 0.1})
    _, actions, evictions = drive(job, 3 * WINDOW + 3, sg.StragglerSettings(window_s=WINDOW))
    named = events(actions)
    assert not evictions  # report is the default: named only
    assert [e["node"] for e in named] == ["node1"] * 3
    e = named[0]
    assert e["decision"] == "named" and e["ratio"] == pytest.approx(4.0) and e["busy_s"] == pytest.approx(0.4)
    assert e["median_s"] == pytest.approx(0.1) and e["ranks"] == [1]
    # each window: 0.3 s lost per step, 0.4 s steps -> 75% of the window (bounded by it)
    assert e["lost_s"] == pytest.approx(e["steps"] * 0.3) and e["lost_s"] <= WINDOW
    assert all(b["time"] - a["time"] >= WINDOW for a, b in zip(named, named[1:]))
    line = next(a.text for a in actions if isinstance(a, Log))
    assert "node node1 (rank 1) is a straggler" in line and "4.0x the other nodes' median" in line
    assert "action report (default): named only" in line


def test_not_judged_before_a_whole_window_of_the_generation():
    job = Job(assignment(), {"node0.0": 0.1, "node1.0": 0.4, "node2.0": 0.1})
    _, actions, _ = drive(job, WINDOW - 1, sg.StragglerSettings(window_s=WINDOW))
    assert not said(actions)


def test_uniform_slowdown_names_no_one():
    job = Job(assignment(4), {f"node{i}.0": 0.1 for i in range(4)})
    state, actions, _ = drive(job, 2 * WINDOW, sg.StragglerSettings(window_s=WINDOW, action="swap"))
    job.busy = {w: 0.9 for w in job.busy}   # every node 9x slower at once
    _, actions, evictions = drive(job, 3 * WINDOW, sg.StragglerSettings(window_s=WINDOW, action="swap"), state)
    assert not said(actions) and not evictions


def test_a_slow_majority_is_the_job_not_a_straggler():
    job = Job(assignment(3), {"node0.0": 0.4, "node1.0": 0.4, "node2.0": 0.1})
    _, actions, evictions = drive(job, 3 * WINDOW, sg.StragglerSettings(window_s=WINDOW, action="swap",
                                                                        factor=1.5))
    assert not evictions and not events(actions)
    [line] = [a.text for a in actions if isinstance(a, Log)]   # said once
    assert "2 of 3 nodes" in line and "the job itself is slow, no one is named" in line


def test_noise_below_the_factor_names_no_one():
    job = Job(assignment(3), {"node0.0": 0.1, "node1.0": 0.18, "node2.0": 0.1})
    _, actions, _ = drive(job, 3 * WINDOW, sg.StragglerSettings(window_s=WINDOW))
    assert not said(actions)


def test_two_nodes_compared_with_each_other_not_with_their_mean():
    job = Job(assignment(2, spares=("spare0",)), {"node0.0": 0.1, "node1.0": 0.3})
    _, actions, evictions = drive(job, WINDOW + 1, sg.StragglerSettings(window_s=WINDOW, action="swap"))
    [e] = events(actions)
    assert e["ratio"] == pytest.approx(3.0) and e["decision"] == "evicted"
    [(_, evict)] = evictions
    assert list(evict) == ["node1.0"] and evict["node1.0"].startswith("straggler: ")


def test_swap_evicts_every_worker_of_the_node_and_then_waits_a_window():
    a = assignment(3, nproc=2, spares=("spare0", "spare1"))
    busy = {w: 0.1 for w in a.ranks}
    busy["node2.1"] = 0.5   # one slow rank makes its node slow
    job = Job(a, busy)
    s = sg.StragglerSettings(window_s=WINDOW, action="swap")
    state, actions, evictions = drive(job, WINDOW + 1, s, spares=("spare0", "spare1"))
    [(t1, evict)] = evictions
    assert sorted(evict) == ["node2.0", "node2.1"] and state.evicted == {"node2"}
    [e] = events(actions)
    assert e["ranks"] == [4, 5] and e["decision"] == "evicted" and "spares left: spare0, spare1" in e["why"]
    # the same generation goes on (the eviction not yet carried out): the next naming of another slow node within
    # the window is not an eviction
    job.busy["node2.1"], job.busy["node0.0"] = 0.1, 0.5
    state, actions, evictions = drive(job, 1.5 * WINDOW, s, state, spares=("spare1",))
    kept = [e for e in events(actions) if e["node"] == "node0"]
    assert not evictions and kept and kept[0]["decision"] == "kept"
    assert "at most one eviction per window" in kept[0]["why"]


def test_never_evicts_with_no_spare_left():
    job = Job(assignment(3, spares=()), {"node0.0": 0.1, "node1.0": 0.5, "node2.0": 0.1})
    _, actions, evictions = drive(job, WINDOW + 1, sg.StragglerSettings(window_s=WINDOW, action="swap"), spares=())
    [e] = events(actions)
    assert not evictions and e["decision"] == "kept" and e["why"] == "not evicted: no spare left"


def test_a_new_generation_starts_its_window_afresh():
    job = Job(assignment(3), {"node0.0": 0.1, "node1.0": 0.5, "node2.0": 0.1})
    s = sg.StragglerSettings(window_s=WINDOW, action="swap")
    state, _, evictions = drive(job, WINDOW + 1, s)
    assert len(evictions) == 1
    # the spare took node1's ranks in generation 1: its counters start at 0, the survivors' go on
    a1 = Assignment(generation=1, world_size=3, ranks={"node0.0": 0, "spare0.0": 1, "node2.0": 2},
                    nodes={"node0.0": "node0", "spare0.0": "spare0", "node2.0": "node2"}, spares=())
    job2 = Job(a1, {"node0.0": 0.1, "spare0.0": 0.1, "node2.0": 0.1})
    v = sg.judge(state, job2.beats(), a1, (), job.t, s)
    assert v.state.generation == 1 and v.state.evicted == {"node1"} and not said(v.actions)
    job2.t = job.t
    _, actions, evictions = drive(job2, 2 * WINDOW, s, v.state, spares=())
    assert not said(actions) and not evictions


def test_unmeasured_collectives_are_said_once_and_judge_nothing():
    job = Job(assignment(3), {"node0.0": 0.1, "node1.0": 0.5, "node2.0": 0.1}, measured=False)
    _, actions, evictions = drive(job, 2 * WINDOW, sg.StragglerSettings(window_s=WINDOW, action="swap"))
    assert not evictions and len(actions) == 1 and "time no collective" in actions[0].text


def test_off_does_nothing():
    job = Job(assignment(3), {"node0.0": 0.1, "node1.0": 0.5, "node2.0": 0.1})
    _, actions, evictions = drive(job, 2 * WINDOW, sg.StragglerSettings(window_s=WINDOW, action="off"))
    assert not said(actions) and not evictions


def test_window_pace_needs_steps_in_the_window():
    samples = (sg.Sample(0.0, 0, 0.0, 0.0, True), sg.Sample(20.0, 2, 20.0, 1.0, True))
    assert sg.window_pace(samples, 10.0, 20.0, 3) is None
    assert sg.window_pace(samples, 10.0, 20.0, 2) == (9.5, 10.0, 2)
    assert sg.window_pace(samples, -1.0, 20.0, 1) is None   # the history does not reach back that far


def test_a_node_slow_in_one_half_of_the_window_only_is_not_named():
    """node1 was slow for the first half of the window and has recovered: over the whole window its busy time is
    above the factor, over the second half it is not."""
    a = assignment(3)
    job = Job(a, {"node0.0": 0.1, "node1.0": 1.0, "node2.0": 0.1})
    history: dict[str, list[sg.Sample]] = {w: [] for w in a.ranks}
    s = sg.StragglerSettings(window_s=WINDOW, factor=1.5)

    def sample() -> None:
        for w, beat in job.beats().items():
            n, step_s, wait_s, measured = beat["pace"]
            history[w].append(sg.Sample(job.t, n, step_s, wait_s, measured))

    sample()
    while job.t < WINDOW / 2:
        job.run(0.5)
        sample()
    job.busy["node1.0"] = 0.1
    while job.t < WINDOW:
        job.run(0.5)
        sample()
    state = sg.StragglerState(generation=0, history={w: tuple(h) for w, h in history.items()})
    [whole] = [p for p in sg.node_paces(state, a, job.t - WINDOW, job.t, 3) or () if p.node == "node1"]
    assert whole.ratio >= s.factor
    v = sg.judge(state, {}, a, ("spare0",), job.t, s)
    assert not said(v.actions) and not v.evict


def test_resolve_flag_over_job_over_default():
    assert sg.resolve(None, None, None, None) == sg.StragglerSettings()
    s = sg.resolve(None, None, 5.0, {"action": "swap", "factor": 3.0, "window_s": 60.0})
    assert (s.action, s.factor, s.window_s, s.source) == ("swap", 3.0, 5.0, "deadpool.straggler.action")
    s = sg.resolve("report", None, None, {"action": "swap"})
    assert (s.action, s.source) == ("report", "--straggler-action")
    assert sg.resolve(None, None, None, {"action": "report", "factor": 2.0, "window_s": 30.0}).source == "default"


@pytest.mark.parametrize("bad", [dict(action="evict"), dict(factor=1.0), dict(factor=math.nan), dict(factor=True),
                                 dict(window_s=0), dict(window_s=math.inf), dict(window_s="10")])
def test_setting_errors_name_the_value(bad):
    args = {"action": None, "factor": None, "window_s": None, **bad}
    why = sg.setting_error(args["action"], args["factor"], args["window_s"])
    assert why is not None and why.startswith("must be") and repr(next(iter(bad.values()))) in why


def test_heartbeat_schema_checks_the_pace():
    beat = heartbeat("hb/w", b'{"t": 1, "step": 2, "step_at": 1, "coll": false, "still_s": 0, '
                             b'"pace": [3, 1.5, 0.5, true]}')
    assert beat["pace"] == [3, 1.5, 0.5, True]
    for bad in (b'[3, 1.5, 0.5]', b'[3, 1.5, 0.5, 1]', b'[-1, 1.5, 0.5, true]', b'[3, "x", 0.5, true]'):
        with pytest.raises(BadValue, match="pace"):
            heartbeat("hb/w", b'{"t": 1, "step": 2, "step_at": 1, "coll": false, "still_s": 0, "pace": ' + bad + b"}")


def test_an_evicted_node_is_never_taken_back_under_its_name():
    """An evicted node stays in the roster: a join by its name is refused (a repaired machine joins as a new spare
    under a new name, and the rule judges it once it trains)."""
    from deadpool_ext.cluster.assignment import Worker
    from deadpool_ext.launcher.decide import Roster, join_refusal

    roster = Roster(workers=(Worker("node0.0", "node0", 0), Worker("node1.0", "node1", 0),
                             Worker("spare0.0", "spare0", 0)),
                    active_nodes=("node0", "node1"), spare_nodes=("spare0",),
                    node_host={"node0": 0, "node1": 0, "spare0": 0})
    why = join_refusal("node1", b'{"nproc": 1, "time": 1}', roster, 1)
    assert why is not None and "taken by a node of this job" in why
    assert join_refusal("node1b", b'{"nproc": 1, "time": 1}', roster, 1) is None


def test_the_pace_is_written_once_per_window_whatever_the_job():
    job = Job(assignment(5), {f"node{i}.0": 0.1 for i in range(5)} | {"node3.0": 0.3})
    _, actions, _ = drive(job, 4 * WINDOW, sg.StragglerSettings(window_s=WINDOW))
    paces = [a.fields for a in actions if isinstance(a, Event) and a.fields["event"] == "pace"]
    assert len(paces) == 3 and all(b["time"] - a["time"] >= WINDOW for a, b in zip(paces, paces[1:]))
    p = paces[-1]
    assert p["nodes"] == 5 and p["busy_median_s"] == pytest.approx(0.1) and p["busy_max_s"] == pytest.approx(0.3)
    assert p["step_s"] == pytest.approx(0.3) and len(p["slowest"]) == sg.PACE_SLOWEST
    assert p["slowest"][0]["node"] == "node3" and p["slowest"][0]["ratio"] == pytest.approx(3.0)


def test_deadpool_check_says_what_the_straggler_section_does():
    from deadpool_ext.commands.check import _turns_on
    from deadpool_ext.config import DeadpoolConfig

    def line(section: dict) -> list[str]:
        return [x for x in _turns_on(DeadpoolConfig.from_dict({"straggler": section})) if x.startswith("stragglers")]

    [swap] = line({"action": "swap", "window_s": 10})
    assert "2x slower" in swap and "over 10 s" in swap and "replaced by a spare" in swap
    [report] = line({})
    assert "named" in report and "not replaced" in report and "over 30 s" in report
    assert line({"action": "off"}) == []


def test_the_median_of_the_others_is_the_brute_force_one():
    import random
    import statistics

    rng = random.Random(46)
    for n in range(2, 40):
        values = sorted(rng.random() for _ in range(n))
        for i in range(n):
            assert sg._median_without(values, i) == pytest.approx(statistics.median(values[:i] + values[i + 1:]))


def test_swap_without_the_hot_swap_is_refused_naming_the_key():
    from deadpool_ext.config import ConfigError, DeadpoolConfig

    with pytest.raises(ConfigError, match="straggler.action: swap replaces a slow node"):
        DeadpoolConfig.from_dict({"straggler": {"action": "swap"}, "hot_swap": {"enabled": False}})
    assert DeadpoolConfig.from_dict({"straggler": {"action": "report"}, "hot_swap": {"enabled": False}})


def test_deadpool_timeline_lists_the_namings():
    from deadpool_ext.commands.timeline import straggler_lines

    events = [{"event": "start", "time": 100.0}] + [
        {"event": "straggler", "time": 130.0 + i, "node": "node1", "ratio": 4.25, "window_s": 30.0, "steps": 12,
         "lost_s": 9.5, "decision": "named", "why": "action report (default): named only"} for i in range(12)]
    lines = straggler_lines(events)
    assert lines[0] == "stragglers named: 12 (the last 10)" and len(lines) == 11
    assert lines[1].startswith("  +32.0 s: node node1 (4.2x") and "waited 9.5 s): named" in lines[1]
    assert straggler_lines([{"event": "start", "time": 1.0}]) == []


def test_the_rule_over_16384_ranks_names_the_slow_node_alone():
    """2,048 nodes of 8 ranks, a window's samples each: the rule names node7 alone. What a turn costs at this size
    is measured in benchmarks/bench_straggler_rule.py (results/straggler_rule.md), not here."""
    a = assignment(2048, nproc=8)
    s = sg.StragglerSettings(window_s=30.0, action="swap")
    gap = s.window_s / sg.SAMPLES_PER_WINDOW
    history = {}
    for w in a.ranks:
        busy = 3.0 if a.nodes[w] == "node7" else 1.0
        history[w] = tuple(sg.Sample(k * gap, k, 3.0 * k, (3.0 - busy) * k, True) for k in range(18))
    state = sg.StragglerState(generation=0, history=history)
    v = sg.judge(state, {}, a, ("spare0",), 17 * gap, s)
    assert sorted({w.split(".")[0] for w in v.evict}) == ["node7"]
