"""``launcher/metrics.py``: the timeline read as it grows, the ledger as Prometheus families, and the endpoint
serving them (in this process: no job)."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deadpool_ext.launcher.args import _metrics_error, build_parser, check_args
from deadpool_ext.launcher.metrics import LedgerCollector, MetricsServer, TimelineTail, families
from deadpool_ext.recovery.ledger import CAUSES, ledger
from tests.unit.test_ledger import T0, _first, _snap, _start, _swap


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _render(events, now) -> dict:
    reg = CollectorRegistry(auto_describe=False)

    class Static:
        def collect(self):
            yield from families(ledger(events, now), "dp1", 2)

    reg.register(Static())
    return _samples(generate_latest(reg).decode())


def test_every_metric_is_present_from_the_start_zero_where_nothing_happened():
    got = _render([_start()], T0 + 10)
    assert got[("deadpool_goodput_ratio", ())] == 1.0 and got[("deadpool_wall_seconds", ())] == 10.0
    for cause in CAUSES:
        assert got[("deadpool_lost_seconds", (("cause", cause),))] == 0.0
    assert got[("deadpool_recoveries_total", (("cause", "crash"), ("tier", "tier2")))] == 0.0
    for name in ("deadpool_spares_available", "deadpool_stragglers_named_total", "deadpool_versions_quarantined_total"):
        assert (name, ()) in got, name
    assert got[("deadpool_spares_available", ())] == 1.0 and got[("deadpool_timeline_bad_lines_total", ())] == 2.0
    assert got[("deadpool_job_info", (("job_id", "dp1"),))] == 1.0


def test_a_recovery_is_served_as_the_ledger_books_it():
    events = [_start(), _first(T0 + 4), _snap(T0 + 5), *_swap(1, T0 + 10), {"event": "finished", "time": T0 + 30}]
    got, led = _render(events, T0 + 99), ledger(events, T0 + 99)
    assert got[("deadpool_recoveries_total", (("cause", "crash"), ("tier", "tier2")))] == 1.0
    assert got[("deadpool_goodput_ratio", ())] == pytest.approx(led.goodput) and led.goodput < 1
    for cause in CAUSES:
        assert got[("deadpool_lost_seconds", (("cause", cause),))] == pytest.approx(led.lost_s[cause])
    assert got[("deadpool_snapshot_bytes", ())] == 1000 and got[("deadpool_snapshot_commit_lag_seconds", ())] == 0.2
    assert got[("deadpool_job_ended", ())] == 1.0 and got[("deadpool_generation", ())] == 1.0


def test_the_tail_takes_whole_lines_only_and_skips_what_is_not_an_event(tmp_path):
    path = tmp_path / "t.jsonl"
    tail = TimelineTail(str(path))
    assert tail.read() == []                                   # no file yet: nothing, no error
    line = json.dumps(_start())
    path.write_text(line[:20])
    assert tail.read() == []                                   # a line being written is not taken
    with open(path, "a") as fh:
        fh.write(line[20:] + "\n" + "not json\n" + "[1, 2]\n" + json.dumps(_snap(T0 + 1)) + "\n"
                 + json.dumps(_snap(T0 + 6, version=2)) + "\n")
    events = tail.read()
    assert [e["event"] for e in events] == ["start", "snapshot"] and events[1]["version"] == 2
    assert tail.bad_lines == 2


def test_the_endpoint_serves_the_timeline_so_far(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [_start(), *_swap(1, T0 + 10)]) + "\n")
    server = MetricsServer("127.0.0.1", 0, str(path), "dp1")
    port = server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            got = _samples(resp.read().decode())
    finally:
        server.close()
    assert got[("deadpool_recoveries_total", (("cause", "crash"), ("tier", "tier2")))] == 1.0
    assert got[("deadpool_lost_seconds", (("cause", "detect"),))] == pytest.approx(0.9)


def test_the_collector_computes_at_scrape_time(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_start()) + "\n")
    now = [T0 + 5]
    collector = LedgerCollector(TimelineTail(str(path)), "dp1", clock=lambda: now[0])
    wall = {f.name: f.samples[0].value for f in collector.collect() if f.samples}["deadpool_wall_seconds"]
    now[0] = T0 + 8
    assert wall == 5.0 and {f.name: f for f in collector.collect()}["deadpool_wall_seconds"].samples[0].value == 8.0


def _args(*flags: str):
    return build_parser().parse_args([*flags, "--nnodes", "1", "scripts/pretrain_gpt.py"])


def _check(*flags: str):
    p = build_parser()
    args = _args(*flags)
    check_args(p, args)
    return args


@pytest.mark.parametrize("flags,error", [
    (("--metrics-port", "70000"), "--metrics-port 70000: must be an integer in 0..65535"),
    (("--metrics-addr", "127.0.0.1"), "--metrics-addr needs --metrics-port PORT"),
    (("--metrics-port", "9400", "--metrics-addr", "192.0.2.254"), "--metrics-addr 192.0.2.254: not an address of "
                                                                 "this host"),
])
def test_bad_metrics_flags_are_refused_naming_the_flag(flags, error):
    why = _metrics_error(_args(*flags))
    assert why is not None and why.startswith(error) and "\n" not in why
    with pytest.raises(SystemExit) as exc:       # check_args refuses it before anything starts
        _check(*flags)
    assert exc.value.code == 2


def test_a_wildcard_metrics_address_only_when_asked_for():
    assert _check("--metrics-port", "9400").metrics_addr is None           # the launcher uses --host
    assert _check("--metrics-port", "9400", "--metrics-addr", "0.0.0.0").metrics_addr == "0.0.0.0"


def test_the_grafana_dashboard_queries_only_metrics_the_endpoint_serves():
    import re

    from deadpool_ext.testing.launch import REPO

    with open(f"{REPO}/docs/grafana/deadpool.json") as fh:
        dash = json.load(fh)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]] + \
        [a["expr"] for a in dash["annotations"]["list"]] + [v["query"] for v in dash["templating"]["list"]]
    used = {m for e in exprs for m in re.findall(r"deadpool_[a-z_]+", e)}
    served = {name for name, _ in _render([_start(), _snap(T0), _pace(T0, 0.1, 1.0)], T0 + 1)}
    assert used and used <= served, used - served


def _pace(t: float, busy_max: float, ratio: float) -> dict:
    return {"event": "pace", "generation": 0, "window_s": 30.0, "nodes": 4, "step_s": busy_max + 0.01,
            "busy_median_s": 0.1, "busy_max_s": busy_max, "time": t,
            "slowest": [{"node": "node2", "busy_s": busy_max, "ratio": ratio}]}


def test_the_newest_pace_is_served_and_the_tail_keeps_only_it(tmp_path):
    """The straggler rule's pace (once per window, launcher/straggler.py): the step, the median and slowest busy
    time per step, the slowest node's ratio; absent until the first window."""
    got = _render([_start()], T0 + 1)
    assert ("deadpool_step_seconds", ()) not in got and ("deadpool_slowest_node_ratio", ()) not in got
    got = _render([_start(), _pace(T0 + 30, 0.2, 2.0), _pace(T0 + 60, 0.45, 4.5)], T0 + 61)
    assert got[("deadpool_step_seconds", ())] == pytest.approx(0.46)
    assert got[("deadpool_slowest_node_ratio", ())] == 4.5
    assert got[("deadpool_busy_seconds", (("which", "median"),))] == 0.1
    assert got[("deadpool_busy_seconds", (("which", "slowest"),))] == 0.45
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [_start(), *(_pace(T0 + 30 * i, 0.2, 2.0)
                                                                      for i in range(1, 50))]))
    tail = TimelineTail(str(path))
    assert [e["event"] for e in tail.read()] == ["start", "pace"] and tail.read()[-1]["time"] == T0 + 30 * 49
