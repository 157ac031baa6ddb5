"""Running a probe as a second local user (the attacker of tests/security): which interpreter that uid can run."""
from __future__ import annotations

import subprocess
import sys

import pytest


def python_for(uid: int) -> str:
    """An interpreter `uid` can run (this one may live under root's home); skips the test where none can."""
    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            ran = subprocess.run([exe, "-I", "-c", "pass"], user=uid, group=uid, extra_groups=[], timeout=30)
            if ran.returncode == 0:
                return exe
        except (OSError, subprocess.SubprocessError):
            continue
    pytest.skip(f"no Python interpreter runs as uid {uid}")
