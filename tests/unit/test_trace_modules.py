"""The module-count tool (deadpool_ext/testing/trace_modules.py): the tracer in a real child process, and the
report's windows, roles and leaf rule over a recorded run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from deadpool_ext.testing import trace_hook as th
from deadpool_ext.testing import trace_modules as tm


def test_module_of_names_package_patches_and_scripts():
    pkg = os.path.join(tm.REPO, "deadpool_ext")
    assert th.module_of(os.path.join(pkg, "rebuild", "recover.py")) == "deadpool_ext.rebuild.recover"
    assert th.module_of(os.path.join(pkg, "launcher", "__init__.py")) == "deadpool_ext.launcher"
    assert th.module_of(os.path.join(tm.REPO, "patches", "x.py")) == "deadpool_ext.patches.x"
    assert th.module_of(os.path.join(tm.REPO, "scripts", "pretrain_gpt.py")) == "script:scripts/pretrain_gpt.py"
    assert th.module_of("/usr/lib/python3/threading.py") == ""


def test_tracer_records_calls_threads_callers_and_steps_in_a_child(tmp_path):
    # A real interpreter with the boot folder on its path, as deadpool-run's workers get it: a function of the
    # package called from another module of it, one in a named thread, one step through the hook point.
    code = """
import threading
from deadpool_ext import hooks
from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment
from deadpool_ext.launcher import keys
initial_assignment([Worker("a.0", "a", 0)], ["a"], [])
t = threading.Thread(target=lambda: keys.heartbeat("a.0"), name="beat"); t.start(); t.join()
hooks.fire(hooks.AFTER_STEP, step=3, rank=0)
"""
    env = {**os.environ, th.ENV: str(tmp_path), "PYTHONPATH": os.pathsep.join([th.BOOT_DIR, tm.REPO])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, cwd=tm.REPO)
    (dump,) = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    rec = json.loads((tmp_path / dump).read_text())
    calls = {(m, f, t) for m, f, t, _ in rec["calls"]}
    assert ("deadpool_ext.cluster.membership", "initial_assignment", "MainThread") in calls
    assert ("deadpool_ext.launcher.keys", "heartbeat", "beat") in calls
    assert ("deadpool_ext.hooks", "fire", "MainThread") in calls
    assert not any(m == "deadpool_ext.testing.trace_hook" for m, _, _ in calls)  # the tracer leaves itself out
    assert "deadpool_ext.launcher.keys" in rec["imports"]                          # import-time runs apart
    assert [s for s, _, _ in rec["steps"]] == [3]


def _proc(pid, argv, *, calls, steps=(), worker_id=None):
    return {"pid": pid, "argv": argv, "worker_id": worker_id, "start": 0.0, "bucket_s": tm.BUCKET_S,
            "steps": [list(s) for s in steps], "imports": {},
            "calls": [[m, f, t, [[x, x] for x in times]] for m, f, t, times in calls],
            "edges": [["deadpool_ext.logs", "deadpool_ext.rebuild.recover", True, [int(101.0 / tm.BUCKET_S)]],
                      ["deadpool_ext.cluster.comm", "deadpool_ext.rebuild.recover", False,
                       [int(101.0 / tm.BUCKET_S)]]]}


def test_report_counts_each_role_inside_its_window(tmp_path, capsys):
    procs = tmp_path / "procs"
    procs.mkdir()
    recs = [
        _proc(10, [os.path.join(tm.REPO, "deadpool_ext", "launcher", "cli.py")],  # `-m` once the module runs
              calls=[("deadpool_ext.launcher.decide", "decide", "MainThread", [101.0]),
                     ("deadpool_ext.launcher.args", "parse", "MainThread", [1.0])]),
        _proc(11, ["scripts/pretrain_gpt.py"], worker_id="node0.0", steps=[(5, 0, 99.0), (5, 0, 103.0)],
              calls=[("deadpool_ext.rebuild.recover", "Recovery.handle_failure", "MainThread", [101.0]),
                     ("deadpool_ext.logs", "where", "MainThread", [101.0]),
                     ("deadpool_ext.training.pretrain", "run", "MainThread", [101.0]),
                     ("deadpool_ext.snapshot.manager", "SnapshotManager.after_step", "MainThread", [104.0])]),
        _proc(12, ["scripts/pretrain_gpt.py"], worker_id="spare0.0", steps=[(5, 1, 103.5)],
              calls=[("deadpool_ext.rebuild.recover", "Recovery.join_survivors", "MainThread", [102.03]),
                     ("deadpool_ext.integrations.deepspeed.runtime", "DeadpoolRuntime._wrap_step", "MainThread",
                      [102.01]),
                     ("deadpool_ext.rebuild.worker", "Membership._heartbeat", "deadpool-heartbeat", [90.0]),
                     ("deadpool_ext.rebuild.worker", "swap_into", "MainThread", [102.04])]),
        _proc(13, ["scripts/pretrain_gpt.py"], worker_id="node1.0", calls=[]),
    ]
    for r in recs:
        (procs / f"{r['pid']}.json").write_text(json.dumps(r))
    (tmp_path / "fault.json").write_text(json.dumps({"time": 100.0, "worker": "node1.0", "pid": 13, "step": 4}))
    events = [{"event": "recover", "role": "survivor", "pid": 11, "time": 102.5},
              {"event": "recover", "role": "spare", "pid": 12, "time": 103.0}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    loaded, t_fault, _ = tm.load(str(tmp_path))
    roles = {p.pid: p.role for p in loaded}
    assert roles == {10: "launcher", 11: "survivor", 12: "spare", 13: "failed"}
    windows = {p.pid: p.window for p in loaded}
    assert windows[11] == (100.0, 103.0) and windows[12] == (100.0, 103.5) and windows[10] == (100.0, 103.5)
    survivor = tm.count(loaded, "survivor")
    # after_step at 104 s is past the first step after the recover event; the demo's loop is a tool
    assert survivor.reader == ["deadpool_ext.rebuild.recover"] and survivor.leaves == ["deadpool_ext.logs"]
    assert list(survivor.tools) == ["deadpool_ext.training.pretrain"]
    # a leaf's direct call into a module to read is flagged; one through a library's frames (torch) is not
    assert survivor.flagged_leaves() == [("deadpool_ext.logs", "deadpool_ext.rebuild.recover")]
    spare = tm.count(loaded, "spare")
    assert spare.reader == ["deadpool_ext.integrations.deepspeed.runtime", "deadpool_ext.rebuild.recover",
                            "deadpool_ext.rebuild.worker"]  # the heartbeat at 90 s ran before the fault
    # from its join: the engine's build 20 ms before it (in the same 50 ms) is left out
    joined = tm.count(loaded, "spare", since=tm.JOIN)
    assert joined.windows == [(102.03, 103.5)]
    assert joined.reader == ["deadpool_ext.rebuild.recover", "deadpool_ext.rebuild.worker"]
    assert tm.count(loaded, "launcher").reader == ["deadpool_ext.launcher.decide"]
    assert tm.report(str(tmp_path)) == 0  # the human report runs through; its figures, from --json:
    capsys.readouterr()
    assert tm.report(str(tmp_path), as_json=True) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["survivor"]["reader"] == ["deadpool_ext.rebuild.recover"] and rep["left_out"] == []
    assert rep["launcher"]["reader"] == ["deadpool_ext.launcher.decide"]


def test_pass_throughs_are_modules_whose_functions_that_ran_are_one_or_two_statements():
    sizes = tm.statements("deadpool_ext.distributed")
    assert sizes["default_backend"] == 1 and sizes["init_distributed"] > 2
    c = tm.RoleCount("survivor", [1], [(0.0, 1.0)], product={
        "deadpool_ext.distributed": ["default_backend", "default_backend [deadpool-heartbeat]"],
        "deadpool_ext.rebuild.recover": ["Recovery.handle_failure", "Recovery.join_survivors.<locals>.form"],
        "deadpool_ext.snapshot.differential": ["DiffRing.__init__", "DiffRing.__init__.<locals>.<listcomp>"]})
    assert tm.pass_throughs(c) == ["deadpool_ext.distributed"]
    assert c.constructed == ["deadpool_ext.snapshot.differential"]
    assert c.reader == ["deadpool_ext.distributed", "deadpool_ext.rebuild.recover"]
    assert tm.statements("deadpool_ext.integrations.base")["ResilientLoop.__iter__"] > 2  # a loop's body counts


def test_a_frame_entered_before_the_window_counts_by_its_direct_calls():
    # The loop's generator catches the failure in a frame it entered long before: only its call out shows it ran.
    def rec(edge_at):
        return {"calls": [["deadpool_ext.integrations.base", "ResilientRuntime.handle_failure", "MainThread",
                           [[101.0, 101.0]]]], "imports": {},
                "edges": [["deadpool_ext.integrations.steps", "deadpool_ext.integrations.base", True,
                           [int(edge_at / tm.BUCKET_S)]]]}
    inside = tm.count([tm.Proc(1, "survivor", "node0.0", rec(101.0), (100.0, 103.0))], "survivor")
    assert inside.reader == ["deadpool_ext.integrations.base", "deadpool_ext.integrations.steps"]
    assert inside.product["deadpool_ext.integrations.steps"] == [tm.ENTERED_BEFORE]
    edge = tm.count([tm.Proc(1, "survivor", "node0.0", rec(100.01), (100.0, 103.0))], "survivor")
    assert edge.reader == ["deadpool_ext.integrations.base"]  # only in the window's first 50 ms: not enough


def test_an_incomplete_trace_is_left_out_and_named(tmp_path):
    (tmp_path / "procs").mkdir()
    (tmp_path / "procs" / "7.json").write_text('{"pid": 7, "calls": [')
    (tmp_path / "fault.json").write_text(json.dumps({"time": 1.0, "worker": "node1.0", "pid": 8, "step": 4}))
    (tmp_path / "timeline.jsonl").write_text("")
    left_out: list[tuple[str, str]] = []
    procs, _, _ = tm.load(str(tmp_path), left_out)
    assert procs == [] and [path for path, _ in left_out] == [str(tmp_path / "procs" / "7.json")]
    assert left_out[0][1].startswith("not a complete trace")
