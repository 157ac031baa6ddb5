"""A spare's warm parent (``rebuild/warm.py``): real forks, real signals. The parent imports the script's frameworks
once, forks a fresh child whenever one starts again, passes the launcher's signals on, and ends as its child ended;
a child dies with its parent; a fork is refused with threads running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from deadpool_ext.launcher.local import family
from deadpool_ext.rebuild import warm
from deadpool_ext.testing.wait import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The "spare": calls hold() as deadpool_ext.run does for a spare, then behaves as its argument says.
HARNESS = textwrap.dedent("""
    import os, sys, time, signal
    sys.path.insert(0, {repo!r})
    from deadpool_ext.rebuild import warm
    out, mode, script = sys.argv[1], sys.argv[2], sys.argv[3]
    parent = os.getpid()
    warm.hold("spare0.0", script, None)          # returns in the child only
    with open(out, "a") as f:
        f.write(f"{{os.getpid()}} {{os.getppid()}} {{int('colorsys' in sys.modules)}} {{int(warm.is_child())}}\\n")
    n = len(open(out).read().splitlines())
    if mode == "again" and n == 1:
        warm.again()                              # the first child starts again
    if mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(5))
    if mode in ("term", "sleep"):
        time.sleep(60)
    sys.exit(7)
""")


def _start(tmp_path, mode: str) -> tuple[subprocess.Popen[bytes], str]:
    harness, script, out = tmp_path / "harness.py", tmp_path / "train.py", str(tmp_path / "children")
    harness.write_text(HARNESS.format(repo=REPO))
    # colorsys stands for a framework: the parent imports what the script imports of FRAMEWORKS only
    script.write_text("import colorsys\nimport torch\nfrom torch import nn\nprint('never run by the parent')\n")
    env = {**os.environ, "DEADPOOL_TIMELINE": str(tmp_path / "timeline.jsonl")}
    proc = subprocess.Popen([sys.executable, str(harness), out, mode, str(script)], env=env)
    return proc, out


def _children(out: str) -> list[list[int]]:
    try:
        return [[int(x) for x in line.split()] for line in open(out).read().splitlines()]
    except FileNotFoundError:
        return []


def test_a_start_again_is_a_fresh_child_of_the_same_warm_parent(tmp_path):
    proc, out = _start(tmp_path, "again")
    assert proc.wait(60) == 7                      # the second child's status is the spare's
    first, second = _children(out)
    assert first[1] == second[1] == proc.pid       # both children of the process the launcher started
    assert first[0] != second[0]
    assert first[2:] == second[2:] == [0, 1]       # colorsys is no framework: imported by neither before the script
    events = [json.loads(line) for line in open(tmp_path / "timeline.jsonl")]
    held = [e for e in events if e.get("event") == "spare_warm_parent"]
    assert len(held) == 1 and held[0]["pid"] == proc.pid and held[0]["imported"] == ["torch", "torch.nn"], held


def test_the_launchers_sigterm_reaches_the_child_and_the_parent_ends_as_it_did(tmp_path):
    proc, out = _start(tmp_path, "term")
    wait_until(lambda: _children(out), 60, "the warm parent's child")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 5


def test_a_child_killed_ends_its_parent_by_the_same_signal(tmp_path):
    proc, out = _start(tmp_path, "sleep")
    (child, _, *_), = wait_until(lambda: _children(out), 60, "the warm parent's child")
    assert family(proc.pid) == [proc.pid, child]   # what the launcher signals and fences
    before = os.path.basename(sys.executable)[:15]  # the name the launcher started the spare under
    assert psutil.Process(proc.pid).name() == warm.PARENT_NAME and psutil.Process(child).name() == before
    os.kill(child, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def test_a_child_dies_with_its_parent(tmp_path):
    proc, out = _start(tmp_path, "sleep")
    (child, _, *_), = wait_until(lambda: _children(out), 60, "the warm parent's child")
    proc.kill()
    proc.wait(30)

    def gone() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split(")")[-1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    wait_until(gone, 10, "the orphaned child to die (PR_SET_PDEATHSIG)")


def test_no_fork_with_a_thread_running_and_the_frameworks_read_from_the_script(tmp_path):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="heartbeat")
    t.start()
    try:
        why = warm.why_not() or ""  # pytest's own threads may be there too
        assert "other thread(s) run before the script (" in why and "heartbeat" in why, why
    finally:
        stop.set()
        t.join()
    script = tmp_path / "s.py"
    script.write_text("import os\nimport torch.distributed as dist\nfrom transformers import GPT2Config, "
                      "Trainer\nfrom . import local\nimport deadpool_ext\nfrom deadpool_ext.training.pretrain import "
                      "run\ndef f():\n    import deepspeed\n")
    assert warm.script_frameworks(str(script), None) == ["torch.distributed", "transformers",
                                                         "transformers.GPT2Config", "transformers.Trainer",
                                                         "deadpool_ext.training.pretrain",
                                                         "deadpool_ext.training.pretrain.run"]
    assert warm.script_frameworks(str(tmp_path / "missing.py"), None) == []
    assert not warm.is_child()
    with pytest.raises(AssertionError):
        warm.again()
