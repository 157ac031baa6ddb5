"""The ``deadpool`` command: tools around a running or finished job.

Each subcommand lives in its own module under ``deadpool_ext/commands/`` (see that package's docstring);
``deadpool --help`` lists them.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import types
from collections.abc import Sequence

from . import commands


def _modules() -> dict[str, types.ModuleType]:
    out = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            out[info.name.replace("_", "-")] = importlib.import_module(f"{commands.__name__}.{info.name}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    mods = _modules()
    p = argparse.ArgumentParser(prog="deadpool", description="deadpool_ext tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, mod in mods.items():
        sp = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or "").strip() or None,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
    args = p.parse_args(argv)
    try:
        return int(mods[args.cmd].run(args) or 0)
    except FileNotFoundError as exc:  # a missing checkpoint location or file: one line, not a traceback
        print(f"deadpool {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
