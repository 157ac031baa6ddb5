"""Unit tests run in one process: what one test does to this process's spare life does not reach the next."""
import pytest


@pytest.fixture(autouse=True)
def _fresh_spare_life(monkeypatch):
    from deadpool_ext.rebuild.context import context

    monkeypatch.setattr(context(), "_spare", None)
