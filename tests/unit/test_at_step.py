"""The in-process step fault (deadpool_ext.chaos.at_step): parsing, once-per-job marker, real signal."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deadpool_ext.chaos.at_step import ENV, InjectedFault, StepFault, harness_env


def test_parse_and_render_round_trip():
    f = StepFault.parse("kill@step=6,rank=1,marker=/tmp/x")
    assert (f.action, f.step, f.rank, f.marker) == ("kill", 6, 1, "/tmp/x")
    assert StepFault.parse(f.render()) == f


@pytest.mark.parametrize("spec, words", [
    ("explode@step=1,rank=0,marker=m", "ACTION one of"),
    ("kill step=1", "ACTION one of"),
    ("kill@step=1,rank=0", "missing ['marker']"),
    ("kill@step=1,rank=0,marker=m,colour=red", "'colour=red'"),
    ("kill@step=one,rank=0,marker=m", "integers"),
    ("kill@step=0,rank=0,marker=m", "step must be >= 1"),
])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(ValueError, match=ENV) as exc:
        StepFault.parse(spec)
    assert words in str(exc.value)


def test_fires_once_per_job_on_the_named_rank_and_step(tmp_path):
    marker = str(tmp_path / "fault")
    f = StepFault("raise", 3, 1, marker)
    assert not f.due(2, 1) and not f.due(3, 0) and f.due(3, 1)
    with pytest.raises(InjectedFault):
        f.fire()
    assert open(marker).read() == str(os.getpid())
    assert not f.due(3, 1)  # a restarted worker redoing step 3 goes on
    f.fire()                 # and a racing second claim does nothing


def test_kill_is_a_real_sigkill_installed_by_the_harness_environment(tmp_path):
    # The product only fires its hook point; the fault is installed at interpreter start by the harness's
    # sitecustomize (harness_env puts it on PYTHONPATH), as in every process of a faulted job.
    marker = str(tmp_path / "fault")
    code = ("from deadpool_ext import hooks\n"
            "for s in range(1, 6):\n    hooks.fire(hooks.AFTER_STEP, step=s, rank=0)\n    print(s, flush=True)\n")
    env = {**os.environ, **harness_env({ENV: f"kill@step=3,rank=0,marker={marker}"})}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)
    assert [int(s) for s in res.stdout.split()] == [1, 2]  # the steps it completed: killed in step 3
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0 and [int(s) for s in again.stdout.split()] == [1, 2, 3, 4, 5]


def test_without_the_harness_the_variable_alone_does_nothing(tmp_path):
    # The product never reads DEADPOOL_INJECT: set without the harness's PYTHONPATH, nothing is installed.
    marker = str(tmp_path / "fault")
    code = ("from deadpool_ext import hooks\n"
            "for s in range(1, 4):\n    hooks.fire(hooks.AFTER_STEP, step=s, rank=0)\n"
            "print(hooks.registered(hooks.AFTER_STEP), flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, ENV: f"kill@step=2,rank=0,marker={marker}"})
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert int(res.stdout) == 0  # hooks registered on AFTER_STEP
    assert not os.path.exists(marker)


def test_restore_gate_holds_only_a_hot_swap_restore(tmp_path, monkeypatch):
    import threading
    import time

    from deadpool_ext.chaos.at_step import GATE_ENV, restore_gate

    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    t0 = time.monotonic()
    restore_gate(generation=0, timeout_s=5)  # job start: never held
    assert time.monotonic() - t0 < 1
    threading.Timer(0.5, gate.write_text, args=("x",)).start()
    t0 = time.monotonic()
    restore_gate(generation=1, timeout_s=10)
    assert 0.4 < time.monotonic() - t0 < 5  # held until the injector opened it
    gate.unlink()
    t0 = time.monotonic()
    restore_gate(generation=1, timeout_s=0.3)  # bounded: goes on after the deadline
    assert time.monotonic() - t0 < 2


def test_hold_waits_for_its_release_file_then_returns(tmp_path):
    import threading
    import time

    marker = str(tmp_path / "hold")
    fault = StepFault.parse(f"hold@step=2,rank=0,marker={marker}")
    done = threading.Event()
    t = threading.Thread(target=lambda: (fault.fire(), done.set()), daemon=True)
    t.start()
    time.sleep(0.3)
    assert os.path.exists(marker) and not done.is_set()   # held: the marker says so, the step does not go on
    open(marker + ".release", "w").close()
    assert done.wait(5)
    assert not fault.due(2, 0)   # once per job
