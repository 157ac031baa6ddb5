"""benchmarks/run_all.py: discovery convention, command lines, which results the report reads, and the report
itself from small hand-made result files (no benchmark is run)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from deadpool_ext.testing.launch import REPO

_spec = importlib.util.spec_from_file_location("run_all", os.path.join(REPO, "benchmarks", "run_all.py"))
run_all = importlib.util.module_from_spec(_spec)
sys.modules["run_all"] = run_all  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(run_all)


def _bench(directory, name, src):
    (directory / f"bench_{name}.py").write_text(src)


def test_discovery_reads_the_convention_without_importing(tmp_path):
    _bench(tmp_path, "zeta", "import torch\np.add_argument('--quick')\np.add_argument(\"--out\", default=x)\n")
    _bench(tmp_path, "megatron", "p.add_argument('--quick', action='store_true')\n")
    _bench(tmp_path, "peers", "p.add_argument('--out')\n")
    _bench(tmp_path, "simulate", "p.add_argument(\n    '--quick')\np.add_argument('--out')\n")
    (tmp_path / "helper.py").write_text("p.add_argument('--quick')\n")
    found = run_all.discover(str(tmp_path))
    assert [b.name for b in found] == ["simulate", "peers", "megatron", "zeta"]  # known order, then by name
    by = {b.name: b for b in found}
    assert (by["zeta"].quick, by["zeta"].out) == (True, True)
    assert (by["megatron"].quick, by["megatron"].out) == (True, False)
    assert (by["peers"].quick, by["peers"].out) == (False, True)


def test_commands_follow_the_convention(tmp_path):
    b = run_all.Bench("x", "/b/bench_x.py", quick=True, out=True)
    cmd = run_all.command(b, True, "/out")
    assert cmd[:3] == ["nice", "-n", "10"] and cmd[-4:] == ["/b/bench_x.py", "--quick", "--out", "/out"]
    assert "--quick" not in run_all.command(b, False, "/out")
    assert "does not accept --out" in run_all.command(run_all.Bench("m", "p", True, False), True, "/o")
    assert run_all.command(run_all.Bench("p", "p", False, True), True, "/o") == "has no --quick mode"
    assert isinstance(run_all.command(run_all.Bench("p", "p", False, True), False, "/o"), list)


def test_real_benchmarks_are_discovered():
    names = {b.name: b for b in run_all.discover()}
    assert {"snapshot_overhead", "recovery", "peers", "simulate"} <= set(names)
    for n in ("snapshot_overhead", "recovery", "peers", "simulate"):
        assert names[n].quick and names[n].out, n


def test_result_preference_this_run_then_full_then_quick(tmp_path):
    out, res = tmp_path / "out", tmp_path / "res"
    out.mkdir()
    res.mkdir()
    assert run_all.find_result("peers", str(out), True, str(res)) is None
    (res / "peers_quick.json").write_text('{"v": "committed quick"}')
    assert run_all.find_result("peers", str(out), True, str(res))[1]["v"] == "committed quick"
    (res / "peers.json").write_text('{"v": "committed full"}')
    assert run_all.find_result("peers", str(out), True, str(res))[1]["v"] == "committed full"
    (out / "peers_quick.json").write_text('{"v": "this run"}')
    assert run_all.find_result("peers", str(out), True, str(res))[1]["v"] == "this run"
    (out / "peers_quick.json").write_text("{broken")
    assert run_all.find_result("peers", str(out), True, str(res))[1]["v"] == "committed full"


def test_report_without_results_says_not_measured(tmp_path):
    path = run_all.write_report(str(tmp_path), True, [], str(tmp_path / "REPORT.md"), "cmd", str(tmp_path))
    text = open(path).read()
    assert "# Benchmark report" in text and "shared with other engineers" in text
    assert text.count("not measured yet") >= 5
    assert "not simulated yet" in text


def _summary(median):
    return {"n": 3, "median": median, "p90": median, "mean": median, "min": median, "max": median}


def test_report_with_results_draws_every_figure(tmp_path):
    pytest.importorskip("matplotlib")
    machine = {"cpu_model": "Test CPU", "cpu_count": 2, "loadavg": [1, 1, 1]}
    peers = {"command": "python benchmarks/bench_peers.py --quick", "machine": machine,
             "result": {"size": "tiny", "params": 1e6, "layout": {"nproc": 2, "simulated_nodes": 2},
                        "notes": {"dlrover_flash_shim": "keyword dropped"}},
             "analysis": {f"{m}@{k}": {"mode": m, "interval": k, "ratio_to_none": 1.0 + 0.1 * (m != "none") / k,
                                       "blocking_s": _summary(0.01 if m != "none" else None)}
                          for m in ("none", "deadpool", "ds_default", "dlrover_flash") for k in (1, 2)}}
    recovery = {"command": "python benchmarks/bench_recovery.py", "machine": machine, "sizes": {"small": {"analysis": {
        "hotswap": {"raw_s": _summary(9.0), "phases_median": {"detect_s": 0.2, "rebuild_s": 5.0, "total_s": 9}},
        "baseline": {"raw_s": _summary(20.0), "phases_median": {"detect_s": 1.0, "startup_and_load_s": 15.0}}}}}}
    persist = {"command": "p", "machine": machine, "sizes": {"small": {"analysis": {
        "disk_bw_MB_s": 900.0, "persist_idle_MB_s": 800.0, "persist_training_MB_s": 600.0}}}}
    snap = {"command": "s", "machine": machine, "sizes": {"small": {"analysis": {
        "modes": {"deadpool": {"blocking_s": _summary(0.001)}, "ds_default": {"blocking_s": _summary(0.5)}},
        "memory": {"per_rank": [{"state_bytes": 100 << 20, "slot_bytes": [100 << 20, 100 << 20],
                                 "replica_bytes": 200 << 20}]}}}}}
    diff = {"command": "d", "machine": machine, "model": "GPT tiny", "layout": "4 ranks",
            "results": [{"zero_stage": 2, "base_blob_bytes": 800, "diff_blob_bytes": 150},
                        {"zero_stage": 3, "base_blob_bytes": 500, "diff_blob_bytes": 150}]}
    for name, doc in (("peers_quick", peers), ("recovery", recovery), ("persist", persist),
                      ("snapshot_overhead", snap), ("differential_quick", diff)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    runs = [{"benchmark": "peers", "command": "c", "returncode": 0, "wall_s": 3.0, "log": "l"},
            {"benchmark": "megatron", "skipped": "does not accept --out"}]
    path = run_all.write_report(str(tmp_path), True, runs, str(tmp_path / "REPORT.md"), "run_all --quick",
                                str(tmp_path))
    text = open(path).read()
    for png in ("overhead_vs_interval", "blocking", "recovery", "persist", "memory"):
        assert (tmp_path / f"report_{png}.png").exists(), png
        assert f"report_{png}.png" in text
    assert "skipped: does not accept --out" in text
    assert "## Headlines\n\nRendered from the current results by `python benchmarks/headlines.py`" in text
    assert "differential_quick.json" in text  # base vs differential sizes drawn from bench_differential


# -- the current results and their index ----------------------------------------------------------------
_ispec = importlib.util.spec_from_file_location("results_index", os.path.join(REPO, "benchmarks", "results_index.py"))
results_index = importlib.util.module_from_spec(_ispec)
sys.modules["results_index"] = results_index
_ispec.loader.exec_module(results_index)


def test_results_dir_holds_only_current_results_and_index_names_them():
    """Every file at the top of benchmarks/results belongs to a CURRENT entry (older runs go to archive/), every
    file an entry names exists, and INDEX.md has a section for each."""
    assert results_index.unaccounted() == []
    assert results_index.missing() == []
    index = open(os.path.join(REPO, "benchmarks", "results", "INDEX.md")).read()
    for e in results_index.CURRENT:
        assert f"\n## {e.stem}\n" in index, e.stem
    assert not any("/work/" in line or "/home/" in line for line in index.splitlines() if "--out /tmp" not in line)


def test_calibration_reads_only_current_results():
    from deadpool_ext.sim import calibration

    # Each name the calibration reads is a current result, or not measured yet (absent from results/): never an
    # archived run's name.
    current = {f"{e.stem}.json" for e in results_index.CURRENT if not e.md_only}
    results = os.path.join(REPO, "benchmarks", "results")
    for name in calibration.SNAPSHOT_FILES + calibration.RECOVERY_FILES:
        assert name in current or not os.path.exists(os.path.join(results, name)), name
    assert set(calibration.RECOVERY_FILES) <= current


def test_report_reads_every_current_file_of_a_benchmark(tmp_path):
    for stem, v in (("persist", "small"), ("persist_medium", "medium")):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"v": v}))
    found = run_all.find_results("persist", str(tmp_path), False, str(tmp_path))
    assert [d["v"] for _, d in found.files] == ["small", "medium"] and found[1]["v"] == "small"
    # This run's own output (not a current file) wins: a quick run's report shows the quick run, and a full run
    # (bench_persist.py writes persist.json... here a new file under the benchmark's default name, persist_new
    # standing for it) shows the new numbers until they are filed under the stable names.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "persist_quick.json").write_text('{"v": "this run"}')
    assert run_all.find_results("persist", str(tmp_path / "out"), True, str(tmp_path)).files[0][1]["v"] == "this run"


def test_report_names_no_machine_paths():
    assert run_all.clean("python benchmarks/bench_peers.py --quick --out /work/main/benchmarks/results/quick") == (
        "python benchmarks/bench_peers.py --quick --out benchmarks/results/quick")
    assert run_all.clean("nice -n 10 /work/main/.venv/bin/python /work/x/benchmarks/bench_a.py --out /tmp/pm") == (
        "nice -n 10 python benchmarks/bench_a.py --out $TMPDIR/pm")
    assert run_all.clean("`/srv/ck/configs/a.json`") == "`configs/a.json`"
    report = open(os.path.join(REPO, "benchmarks", "results", "REPORT.md")).read()
    assert "/work/" not in report and "/tmp/" not in report and "--quick" not in report.split("## Sources")[0]
