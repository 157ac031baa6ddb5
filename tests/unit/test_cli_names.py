"""``deadpool verify`` and ``deadpool inspect`` check a base's file names by the rule the writer uses: the installed
DeepSpeed's naming functions whenever DeepSpeed imports (``deadpool_ext/commands/_names.py``), the fallback list
only where it does not, and their JSON says which.

To tell the two rules apart, DeepSpeed's ``_get_ckpt_name`` is made to write a name no DeepSpeed 0.19 writes
(``next_mp_rank_00_model_states.pt``): a base holding it verifies when the tools follow DeepSpeed, and is refused
by the fallback list."""
from __future__ import annotations

import json
import os

import pytest

from tests.security.test_storage import small_base, valid_record, write_record

NEW = "next_mp_rank_00_model_states.pt"


@pytest.fixture
def no_rule_yet(monkeypatch):
    """The process as a fresh ``deadpool`` command finds it: no integration has handed the persist layer a rule."""
    from deadpool_ext.integrations.deepspeed.names import deepspeed_file_names
    from deadpool_ext.persist import layout

    monkeypatch.setattr(layout, "_names", [])
    deepspeed_file_names.cache_clear()
    yield
    deepspeed_file_names.cache_clear()


@pytest.fixture
def deepspeed_writes_a_new_name(monkeypatch, no_rule_yet):
    from deepspeed.runtime.engine import DeepSpeedEngine

    was = DeepSpeedEngine._get_ckpt_name

    def renamed(self, *args, **kwargs):
        path = was(self, *args, **kwargs)
        return os.path.join(os.path.dirname(path), "next_" + os.path.basename(path))

    monkeypatch.setattr(DeepSpeedEngine, "_get_ckpt_name", renamed)


def _base_named(url: str, name: str) -> None:
    small_base(url)
    tag = "global_step2"
    os.rename(os.path.join(url, tag, "mp_rank_00_model_states.pt"), os.path.join(url, tag, name))
    with open(os.path.join(url, tag, name), "rb") as fh:
        write_record(url, tag, valid_record({name: fh.read()}, tag))


def _cli(capsys, *argv: str) -> tuple[int, dict]:
    from deadpool_ext.cli import main

    rc = main(list(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_verify_and_inspect_follow_the_installed_deepspeeds_naming_functions(tmp_path, capsys,
                                                                              deepspeed_writes_a_new_name):
    import deepspeed

    from deadpool_ext.persist.layout import FALLBACK_NAMES
    from deadpool_ext.persist.records import UnsafeNameError

    url = str(tmp_path / "t3")
    _base_named(url, NEW)
    with pytest.raises(UnsafeNameError):
        FALLBACK_NAMES.check(NEW, "x")  # the hand-written list would refuse the base
    rc, out = _cli(capsys, "verify", url, "--json")
    assert rc == 0 and out["file_names"] == f"deepspeed {deepspeed.__version__}", out
    assert [(b["tag"], b["verdict"]) for b in out["bases"]] == [("global_step2", "ok")], out
    rc, out = _cli(capsys, "inspect", url, "--json", "--shm-root", str(tmp_path / "shm"))
    assert rc == 0 and out["file_names"] == f"deepspeed {deepspeed.__version__}", out
    assert [(v["tag"], v["complete"], "refused" in v) for v in out["tier3"]["versions"]] == [
        ("global_step2", True, False)], out


def test_without_deepspeed_the_fallback_list_is_used_and_named(tmp_path, capsys, monkeypatch,
                                                               deepspeed_writes_a_new_name):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed"
                        else find_spec(name, *a))
    url = str(tmp_path / "t3")
    _base_named(url, NEW)
    rc, out = _cli(capsys, "verify", url, "--json")
    assert out["file_names"] == "fallback list (DeepSpeed is not installed)", out
    assert rc == 1 and [(b["tag"], b["verdict"]) for b in out["bases"]] == [("global_step2", "refused")], out
    assert NEW in out["bases"][0]["errors"][0]
    ok = str(tmp_path / "ok")
    small_base(ok)  # DeepSpeed 0.19's own names: the fallback list accepts them
    rc, out = _cli(capsys, "verify", ok, "--json")
    assert rc == 0 and [b["verdict"] for b in out["bases"]] == ["ok"], out


def test_verify_json_is_the_only_stdout_whatever_deepspeed_logs(tmp_path):
    """DeepSpeed's logger writes to stdout (its accelerator detection, where DS_ACCELERATOR is unset): the tools
    send it to stderr while they make the rule, so ``--json`` stays one JSON object."""
    import subprocess
    import sys

    from deadpool_ext.testing.launch import REPO

    url = str(tmp_path / "t3")
    small_base(url)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = REPO
    res = subprocess.run([sys.executable, "-m", "deadpool_ext.cli", "verify", url, "--json"], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["file_names"].startswith("deepspeed ") and [b["verdict"] for b in out["bases"]] == ["ok"], out
