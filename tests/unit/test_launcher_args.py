"""deadpool-run's worker-environment flags (its refusals of impossible timing: tests/security/test_input.py)."""
from __future__ import annotations


def test_workers_heap_arenas():
    """--malloc-arena-max reaches the workers' environment unless one is set already (that one wins), 0 sets none."""
    from deadpool_ext.launcher.args import malloc_env

    assert malloc_env(2, {}, log=True) == {"MALLOC_ARENA_MAX": "2"}
    assert malloc_env(2, {"MALLOC_ARENA_MAX": "8"}, log=True) == {}  # the inherited 8 reaches the workers
    assert malloc_env(0, {}, log=False) == {}
