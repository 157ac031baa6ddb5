"""Upper bounds on every numeric and string field of the "deadpool" section (config.py): a value past its bound is
one error line naming the key and what is allowed, and what it echoes is shortened (a 1 MB URL is not printed)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest

from deadpool_ext import config as cfgmod
from deadpool_ext.config import ConfigError, DeadpoolConfig
from deadpool_ext.testing.launch import REPO, base_env
from tests.log_interface import assert_refusal


def _leaf_fields() -> list[tuple[str, typing.Any]]:
    """(dotted path under the section, type hint) of every non-bool scalar field, sections walked recursively."""
    out: list[tuple[str, typing.Any]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(typing.cast(type, hint), f"{prefix}{f.name}.")
                continue
            inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if inner[0] is not bool:
                out.append((f"{prefix}{f.name}", inner[0]))
    walk(DeadpoolConfig, "")
    return out


def _section(path: str, value: object) -> dict:
    doc: dict = {}
    cur = doc
    *heads, last = path.split(".")
    for h in heads:
        cur = cur.setdefault(h, {})
    cur[last] = value
    return doc


HUGE = {int: 10**30, float: 1e300, str: "x" * (1 << 20)}


@pytest.mark.parametrize("path,hint", _leaf_fields(), ids=[p for p, _ in _leaf_fields()])
def test_every_field_has_an_upper_bound_said_in_one_short_line(path, hint):
    assert hint in HUGE, f"{path}: a field of type {hint} has no bound test here"
    with pytest.raises(ConfigError) as exc:
        DeadpoolConfig.from_dict(_section(path, HUGE[hint]))
    line = str(exc.value)
    assert line.startswith(f"deadpool config: deadpool.{path}: "), line
    assert "\n" not in line and len(line) < 400, line


@pytest.mark.parametrize("section,needle", [
    ({"replication": {"factor": 10**9}}, "deadpool.replication.factor: must be an integer >= 0 and <= 65535 "
                                         "(replicas go to other nodes than the rank's), got 1000000000"),
    ({"snapshot": {"interval": 1e30}}, "deadpool.snapshot.interval: must be an integer, got 1e+30"),
    ({"snapshot": {"interval": 10**9 + 1}}, "deadpool.snapshot.interval: must be an integer >= 1 and <= 1000000000"),
    ({"persist": {"interval": 10**30}}, "deadpool.persist.interval: must be an integer >= 0 and <= 1000000000, got an "
                                        "integer of 100 bits"),
    ({"persist": {"keep_last": 1001}}, "deadpool.persist.keep_last: must be an integer >= 1 and <= 1000"),
    ({"persist": {"max_mb_s": 1e12}}, "deadpool.persist.max_mb_s: must be a finite number in 0..1048576 MiB/s"),
    ({"differential": {"base_interval": 5000}}, "differential.base_interval: must be an integer >= 2 and <= 1024"),
    ({"differential": {"replay_batch": 5000}}, "differential.replay_batch: must be an integer >= 1 and <= 1024"),
    ({"local": {"simulate_nodes": 2000}}, "deadpool.local.simulate_nodes: must be an integer >= 0 and <= 1024"),
    ({"local": {"shm_root": "/" + "d" * 5000}}, "deadpool.local.shm_root: must be a directory path of at most 4096"),
])
def test_bounds_name_the_key_and_what_is_allowed(section, needle):
    with pytest.raises(ConfigError) as exc:
        DeadpoolConfig.from_dict(section)
    assert needle in str(exc.value)


def test_a_megabyte_url_is_refused_and_not_echoed_in_full():
    with pytest.raises(ConfigError) as exc:
        DeadpoolConfig.from_dict({"persist": {"url": "s3://b/" + "u" * (1 << 20)}})
    line = str(exc.value)
    assert "deadpool.persist.url: must be a path or fsspec URL of at most 4096 characters" in line
    assert "(1048583 characters)" in line and len(line) < 300


def test_the_bounds_match_the_launcher():
    from deadpool_ext.launcher.args import MAX_NODES, MAX_PROCS_PER_NODE

    assert (cfgmod.MAX_NODES, cfgmod.MAX_PROCS_PER_HOST) == (MAX_NODES, MAX_PROCS_PER_NODE)


def test_check_cli_says_a_huge_url_in_one_short_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"deadpool": {"persist": {"url": "/" + "p" * (1 << 20)}}}))
    res = subprocess.run([sys.executable, "-m", "deadpool_ext.cli", "check", str(path)], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=base_env({"PYTHONPATH": REPO}))
    assert_refusal(res, rc=1, names="deadpool.persist.url")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2 and all(len(ln) < 300 for ln in lines)  # the bad key's line and the count of bad keys
