"""benchmarks/bench_five_swaps.py's pure parts: every swap within the targets or the target is not met, the
survivors' memory growth, the loss check and the rendered table."""
from __future__ import annotations

import importlib
import os
import sys

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
bench = importlib.import_module("bench_five_swaps")


def _doc(restored=(0.5, 0.6, 0.4, 0.5, 0.7), rss_end=1.03e9, losses=None) -> dict:
    # node0.0 trains through every swap; node2.0 joined for the last one
    swaps = [{"killed": f"w{i}", "restored_s": r, "raw_s": 2.5 + r, "built_ahead": True,
              "training": ["node0.0", *(["node2.0"] if i == len(restored) - 1 else [])],
              "phases": {"detect_s": 0.1, "restore_s": 0.3}} for i, r in enumerate(restored)]
    ref = {1: 5.5, 2: 5.25, 3: 5.0}
    return {"title": "t", "date": "2026-12-04", "command": "python b.py", "wall_s": 100.0, "size": "small",
            "machine": {"cpu_count": 2}, "swaps_planned": 5, "reference_losses": {str(k): v for k, v in ref.items()},
            "run": {"swaps": swaps, "normal_step_s": 2.6, "losses": losses or ref,
                    "rss_first": {"node0.0": 1e9, "node2.0": 1e9}, "rss_end": {"node0.0": rss_end, "node2.0": 1e9}}}


def test_every_swap_within_the_targets():
    an = bench.analyse(_doc())
    assert all(t["met"] for t in an["targets"].values()), an["targets"]
    assert an["survivor_rss_growth"] == {"node0.0": 1.03, "node2.0": 1.0} and an["losses_identical"]
    assert an["swaps_survived"] == {"node0.0": 5, "node2.0": 1}
    assert an["targets"]["survivor_memory"]["judged_on"] == ["node0.0"]


def test_memory_is_judged_on_the_survivors_of_every_swap_and_not_met_without_one():
    """A worker that joined for the last swaps is still warming up (its first steps); the target is about what
    five swaps leave in a survivor, so it is judged on the workers that trained through all of them."""
    doc = _doc()
    doc["run"]["rss_end"]["node2.0"] = 1.2e9
    assert bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    for sw in doc["run"]["swaps"]:
        sw["training"] = ["node2.0"] if sw is doc["run"]["swaps"][-1] else []
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]


def test_one_slow_swap_a_missing_swap_or_grown_memory_fail_their_target():
    assert not bench.analyse(_doc(restored=(0.5, 1.2, 0.4, 0.5, 0.7)))["targets"]["every_restored"]["met"]
    assert not bench.analyse(_doc(restored=(0.5, 0.6, 0.4, 0.5)))["targets"]["every_restored"]["met"]
    assert not bench.analyse(_doc(rss_end=1.06e9))["targets"]["survivor_memory"]["met"]
    assert not bench.analyse(_doc(losses={1: 5.5, 2: 5.25, 3: 5.0000001}))["losses_identical"]


def test_the_table_has_a_row_per_swap():
    doc = _doc()
    doc["analysis"] = bench.analyse(doc)
    md = bench.render(doc)
    assert md.count("| True |") == 5 and "node0.0 x1.030 (5)" in md and "every_restored met" in md


def test_a_normal_step_ran_with_a_spare_built_and_no_swap_under_way():
    # steps as (step, end time, own time); a spare ready at 10; kills at 30 and 60; the next spare ready at 45
    recs = [{"step": s, "time": t, "step_time_s": d} for s, t, d in
            [(1, 16, 6), (2, 20, 4), (3, 23, 3), (4, 34, 3), (5, 39, 5), (6, 44, 5), (7, 48, 3), (8, 51, 3),
             (9, 62, 3)]]
    quiet = bench.quiet_steps(recs, ready=[10, 45], kills=[30, 60], redone={4})
    assert [r["step"] for r in quiet] == [2, 3, 7, 8]  # 5 and 6 ran while the joining spare built; 9 saw a kill


def test_a_kill_waits_for_a_step_begun_once_the_spare_was_built():
    recs = [{"step": s, "time": t, "step_time_s": d} for s, t, d in [(6, 40, 5), (7, 45, 5), (8, 48, 3), (9, 51, 3)]]
    assert bench.kill_step(recs, ready_at=44, earliest=7) == 8  # step 7 began at 40, before the spare was built
    assert bench.kill_step(recs, ready_at=30, earliest=7) == 7  # the planned step was quiet already
    assert bench.kill_step(recs, ready_at=49, earliest=7) is None  # not logged yet: wait


def test_memory_is_a_median_over_a_window_not_one_sample_at_some_phase_of_a_step():
    from recovery_procs import window_median

    # one worker's RSS within steps: 1.0 GB between them, up to 1.3 GB with activations mid-step
    samples = [{"node0.0": v, "spare0.0": 5} for v in (1.0e9, 1.3e9, 1.0e9, 1.1e9, 1.0e9)] + [{"node0.0": 1.0e9}]
    assert window_median(samples) == {"node0.0": 1_000_000_000, "spare0.0": 5}
    assert window_median([]) == {}
    doc = _doc()
    doc["run"]["rss_window_s"] = 12.0
    doc["analysis"] = bench.analyse(doc)
    assert "median RSS over the 12 s before the last step" in bench.render(doc)


def test_with_a_control_memory_is_judged_against_the_same_worker_without_kills():
    """The window before the first kill holds the process's own warm-up; the run without kills, sampled over the same
    steps, tells that apart from what the swaps leave: the judged figure is the survivor's RSS at the last step over
    the same worker's without kills."""
    doc = _doc(rss_end=1.08e9)  # grew 8% since the first kill
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    parts = {"rss_anon": {"node0.0": 0.7e9}, "rss_shmem": {"node0.0": 0.3e9}}
    doc["control"] = {"at_kills": [{"node0.0": 1.0e9}] * 5, "rss_end": {"node0.0": 1.06e9},
                      "parts_at_kills": [parts] * 5, "parts_end": parts}
    an = bench.analyse(doc)
    assert an["control_rss_growth"]["node0.0"] == 1.06
    assert round(an["survivor_rss_vs_control"]["node0.0"], 4) == round(1.08 / 1.06, 4)
    assert an["targets"]["survivor_memory"]["met"] and an["targets"]["survivor_memory"]["against"] == \
        "the run without kills"
    doc["control"]["rss_end"] = {"node0.0": 1.0e9}  # without kills it stayed flat: the 8% is the swaps'
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    doc["control"]["rss_end"] = {}  # the control lost the survivor's samples: not judged, not met
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    doc["control"]["rss_end"] = {"node0.0": 1.06e9}
    doc["run"]["parts_end"] = parts
    doc["analysis"] = bench.analyse(doc)
    md = bench.render(doc)
    assert "Control: the same job" in md and "node0.0 x1.019" in md and "anonymous 668 MB" in md
    assert "within 5% of the run without kills" in md


def test_with_the_allocator_probe_memory_is_judged_on_bytes_in_use_and_rss_is_reported_beside():
    """RSS counts the free memory glibc keeps in its heap (hundreds of MB here, changing with the order of
    allocations); the bytes in use are what a swap could leave alive."""
    doc = _doc(rss_end=1.09e9)
    doc["run"]["swaps"][0]["heap_before"] = {"node0.0": 2.40e9}
    doc["run"]["heap_end"] = {"node0.0": 2.46e9}
    doc["control"] = {"at_kills": [{"node0.0": 1.0e9}] * 5, "rss_end": {"node0.0": 1.0e9},
                      "heap_end": {"node0.0": 2.43e9}}
    an = bench.analyse(doc)
    assert round(an["survivor_heap_vs_control"]["node0.0"], 4) == round(2.46 / 2.43, 4)
    assert round(an["survivor_heap_growth"]["node0.0"], 3) == 1.025
    assert an["survivor_rss_vs_control"]["node0.0"] == 1.09  # reported, not judged
    mem = an["targets"]["survivor_memory"]
    assert mem["met"] and mem["against"].startswith("the same worker's allocator bytes in use")
    doc["run"]["heap_end"] = {"node0.0": 2.60e9}  # 7% more alive than without kills: a leak
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    doc["run"]["heap_end"] = {}  # the probe wrote nothing for the survivor: not judged, not met
    assert not bench.analyse(doc)["targets"]["survivor_memory"]["met"]
    doc["run"]["heap_end"] = {"node0.0": 2.46e9}
    doc["analysis"] = bench.analyse(doc)
    md = bench.render(doc)
    assert "bytes in use (glibc's `mallinfo2`" in md and "node0.0 x1.012 (2346 MB against 2317 MB)" in md


def test_heap_samples_in_a_window_by_worker(tmp_path):
    (tmp_path / "node0.0.41.jsonl").write_text('{"t": 1, "live": 10}\n{"t": 2, "live": 30}\n{"t": 3, "live": 20}\n'
                                                '{"t": 9, "live": 99}\n{"t": 4, "li')  # the last line cut by a kill
    (tmp_path / "node1.0.42.jsonl").write_text('{"t": 8, "live": 5}\n')
    heap = bench.read_heap(str(tmp_path))
    assert bench.heap_window(heap, 1, 3) == {"node0.0": 20}
    assert bench.heap_window(heap, 5, 9) == {"node0.0": 99, "node1.0": 5}
    assert bench.read_heap(str(tmp_path / "none")) == {}


def test_the_allocator_probe_runs_in_active_nodes_workers_only(tmp_path):
    """A spare's warm parent refuses to fork beside another Python thread: the probe never starts in one."""
    import subprocess

    for wid in ("node0.0", "spare0.0", "join1.0"):
        # the folder is made by the probe (the benchmark names one under its scratch directory); the probe writes
        # its first sample as it starts, so a worker id without a file never ran it
        env = {**os.environ, **bench.probe_env({"DEADPOOL_WORKER_ID": wid}, str(tmp_path / "heap"))}
        out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], env=env, timeout=60)
        assert out.returncode == 0
    heap = bench.read_heap(str(tmp_path / "heap"))
    assert list(heap) == ["node0.0"] and len(heap["node0.0"]) >= 1 and heap["node0.0"][0][1] > 0
