"""Packaging and layering facts a user relies on: nothing named ``patches`` on their path, patches import
no deadpool_ext code, a training job pulls no tool dependency, fault injection lives only in the harness,
modules stay small."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import deadpool_ext

PKG = os.path.dirname(os.path.abspath(deadpool_ext.__file__))
REPO = os.path.dirname(PKG)


def _run(code: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_patches_install_under_the_extensions_namespace_only(tmp_path):
    res = _run("import deadpool_ext.patches as p; print(repr(p.get('deepspeed_zero3_quiet_init').name))\n"
               "try:\n    import patches\nexcept ImportError:\n    print(repr('no top-level patches'))\n",
               str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert _values(res.stdout)[1] == "no top-level patches", res.stdout


def test_patches_import_no_deadpool_ext_code():
    offenders = []
    for name in sorted(os.listdir(os.path.join(REPO, "patches"))):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(REPO, "patches", name)).read())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] == "deadpool_ext"]
    assert offenders == []


def test_a_training_job_pulls_no_tool_dependency(tmp_path):
    code = ("import sys\nimport deadpool_ext, deadpool_ext.deepspeed, deadpool_ext.training.pretrain\n"
            "import deadpool_ext.integrations.megatron.runtime\n"
            + _loaded("matplotlib", "moto", "hypothesis", "deadpool_ext.chaos", "deadpool_ext.testing",
                      "deadpool_ext.sim"))
    assert _values(_ok(code, tmp_path).stdout)[-1] == []


def _loaded(*modules: str) -> str:
    """A line of code that prints which of ``modules`` the process has imported."""
    return f"print(sorted(m for m in {modules!r} if m in sys.modules))\n"


def _ok(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    res = _run(code, str(tmp_path))
    assert res.returncode == 0, res.stderr
    return res


def _values(stdout: str) -> list:
    """The Python literals ``code`` printed, one a line."""
    return [ast.literal_eval(line) for line in stdout.strip().splitlines()]


def test_the_launcher_checks_its_flags_without_importing_a_framework(tmp_path):
    """deadpool-run refuses a bad flag before torch is imported (one line, nothing else on stderr): a typo costs a
    user a fraction of a second, not the seconds torch takes to load; torch comes with the job's store at run time."""
    frameworks = _loaded("torch", "deepspeed", "megatron", "transformers")
    code = ("import sys\nimport deadpool_ext.launcher.cli as cli\n" + frameworks
            + "try:\n    cli.main(['--nnodes', '0', 'x.py'])\nexcept SystemExit as exc:\n    print(exc.code)\n"
            + frameworks)
    res = _ok(code, tmp_path)
    assert _values(res.stdout) == [[], 2, []]  # no framework before the flag check, nor after the refusal
    assert len(res.stderr.strip().splitlines()) == 1  # one line: test_launcher_args checks what it says


def _sources() -> list[tuple[str, str]]:
    out = []
    for root, _, files in os.walk(PKG):
        out += [(os.path.relpath(os.path.join(root, f), PKG), open(os.path.join(root, f)).read())
                for f in sorted(files) if f.endswith(".py")]
    return out


def test_fault_injection_variables_are_read_only_by_the_harness():
    found = sorted(rel for rel, text in _sources()
                   if ("DEADPOOL_INJECT" in text or "DEADPOOL_RESTORE_GATE" in text)
                   and not rel.startswith(("chaos" + os.sep, "testing" + os.sep)))
    assert found == []


def test_no_module_is_over_600_lines():
    assert sorted((rel, n) for rel, text in _sources() if (n := text.count("\n")) > 600) == []
