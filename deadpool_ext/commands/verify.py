"""``deadpool verify URL [--version N] [--json]``: check every file of the tier-3 bases against the manifests.

Exit status 0 when every complete base verifies; 1 when a file is missing, truncated or corrupt (each bad file
is named on stderr); 2 when there is no complete base at all. Incomplete bases (no commit record) are listed
but are not errors: they are never used.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "verify sizes and xxh3 checksums of tier-3 bases; non-zero exit naming any bad file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="tier-3 location (the --save URL)")
    p.add_argument("--version", type=int, default=None, help="only this base")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when not a terminal")


def run(args: argparse.Namespace) -> int:
    from ..persist.layout import list_versions, verify_version
    from ..persist.progress import Progress
    from ..persist.storage import open_existing

    storage = open_existing(args.url)
    versions = [v for v in list_versions(storage) if args.version is None or v.version == args.version]
    report: list[dict[str, Any]] = []
    bad = 0
    for info in versions:
        if info.commit is None:  # not complete
            report.append({"tag": info.tag, "complete": False, "ok": None, "errors": []})
            continue
        errors = verify_version(storage, info, progress=Progress(f"verify {info.tag}",
                                                                  enabled=True if args.progress else None))
        bad += bool(errors)
        report.append({"tag": info.tag, "complete": True, "ok": not errors, "errors": errors,
                       "files": len(info.commit["files"]), "bytes": info.nbytes})
        for e in errors:
            print(f"BAD {e}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report:
            state = "incomplete (ignored)" if not r["complete"] else ("OK" if r["ok"] else "BAD")
            extra = f"  {r['files']} files, {r['bytes'] / 1e6:,.1f} MB" if r["complete"] else ""
            print(f"{r['tag']:<20} {state}{extra}")
    if not any(r["complete"] for r in report):
        print(f"{args.url}: no complete tier-3 base", file=sys.stderr)
        return 2
    return 1 if bad else 0
