"""The product boundary (issue 31, part 6): ``deadpool_ext.__all__`` is the public API, importing the package loads
no framework, and the README and the example scripts use nothing else."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import deadpool_ext
from deadpool_ext.testing.launch import REPO, base_env


def test_every_public_name_resolves_to_its_definition():
    from deadpool_ext.integrations import base, steps
    from deadpool_ext.integrations import deepspeed as ds_integration

    assert deadpool_ext.initialize is ds_integration.initialize
    assert deadpool_ext.register is ds_integration.register
    assert deadpool_ext.resilient_steps is steps.resilient_steps
    assert deadpool_ext.ResilientLoop is base.ResilientLoop
    for name in deadpool_ext.__all__:
        assert getattr(deadpool_ext, name) is not None, name
    assert set(deadpool_ext.__all__) <= set(dir(deadpool_ext))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deadpool_ext.nope  # noqa: B018


def test_importing_the_package_loads_no_framework():
    code = ("import json, sys, deadpool_ext\n"
            "print(json.dumps(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'megatron')\n"
            "                        if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=base_env(),
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert json.loads(r.stdout) == []


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_and_the_examples_import_only_the_public_api():
    """A user copies what the README shows: every import of the package there (and in the example scripts a user
    starts from) is ``import deadpool_ext`` or ``from deadpool_ext import <public name>``."""
    sources = {"README.md": "\n".join(_python_blocks(open(os.path.join(REPO, "README.md")).read()))}
    examples = os.path.join(REPO, "scripts", "examples")
    for f in sorted(os.listdir(examples)):
        if f.endswith(".py"):
            with open(os.path.join(examples, f)) as fh:
                sources[f"scripts/examples/{f}"] = fh.read()
    bad = []
    for where, text in sources.items():
        for line in text.splitlines():
            m = re.match(r"\s*from (deadpool_ext[\w.]*) import (.+)", line)
            if m:
                names = [n.strip().split(" as ")[0] for n in m.group(2).split("#")[0].strip("() ").split(",")]
                if m.group(1) != "deadpool_ext" or not set(names) <= set(deadpool_ext.__all__):
                    bad.append(f"{where}: {line.strip()}")
            m = re.match(r"\s*import (deadpool_ext[\w.]*)", line)
            if m and m.group(1) not in ("deadpool_ext", "deadpool_ext.auto"):
                bad.append(f"{where}: {line.strip()}")
    assert not bad, "imports outside deadpool_ext.__all__:\n" + "\n".join(bad)
