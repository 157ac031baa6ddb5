"""deadpool-run refuses impossible timing flags before starting anything."""
from __future__ import annotations

import pytest

from deadpool_ext.launcher.cli import main
from tests.log_interface import assert_refusal


@pytest.mark.parametrize("argv,needle", [
    (["--heartbeat-s", "0"], "--heartbeat-s must be a positive number of seconds"),
    (["--watch-s", "-1"], "--watch-s must be a positive number of seconds"),
    (["--detect-timeout-s", "0.4", "--heartbeat-s", "0.5"],
     "--detect-timeout-s (0.4) must be longer than --heartbeat-s"),
    (["--malloc-arena-max", "-1"], "--malloc-arena-max -1: must be an integer in 0..1024"),
])
def test_impossible_timing_is_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--nnodes", "2", "train.py"])
    assert_refusal((exc.value.code, capsys.readouterr().err), rc=2, names=needle)


def test_workers_heap_arenas():
    """--malloc-arena-max reaches the workers' environment unless one is set already (that one wins), 0 sets none."""
    from deadpool_ext.launcher.args import malloc_env

    assert malloc_env(2, {}, log=True) == {"MALLOC_ARENA_MAX": "2"}
    assert malloc_env(2, {"MALLOC_ARENA_MAX": "8"}, log=True) == {}  # the inherited 8 reaches the workers
    assert malloc_env(0, {}, log=False) == {}
