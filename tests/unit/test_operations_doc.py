"""docs/operations.md covers every knob (issue 46, part 5): each key of the ``"deadpool"`` section and each
``deadpool-run`` flag has a row there, with its default and what it costs. A knob added without its row fails here."""
from __future__ import annotations

import dataclasses

from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.launcher.args import build_parser
from deadpool_ext.testing.launch import REPO


def _doc() -> str:
    with open(f"{REPO}/docs/operations.md") as fh:
        return fh.read()


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += _keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_key_of_the_deadpool_section_has_its_row():
    rows = [line for line in _doc().splitlines() if line.startswith("| `")]
    missing = [k for k in _keys(DeadpoolConfig) if not any(line.startswith(f"| `{k}` |") for line in rows)]
    assert not missing, f"docs/operations.md has no row for: {missing}"


def test_every_deadpool_run_flag_has_its_row():
    rows = [line.split("|")[1] for line in _doc().splitlines() if line.startswith("| `--")]
    flags = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    missing = [f for f in flags if not any(f"`{f}`" in row for row in rows)]
    assert not missing, f"docs/operations.md has no row for: {missing}"
