"""``deadpool verify URL [--version N] [--json]``: check every file of the tier-3 bases against the manifests.

Exit status 0 when every complete base verifies; 1 when a file is missing, truncated or corrupt, or a commit
record (or ``latest``) is malformed, names a file the layout never writes, or - with a checkpoint key - is not
signed by it (each problem is one line on stderr naming the file); 2 when there is no complete base at all.
Incomplete bases (no commit record) are listed but are not errors: they are never used.

Authenticity: with ``DEADPOOL_CHECKPOINT_KEY`` set, every commit record must carry a signature by that key
(``deadpool_ext.persist.sign``); without it, verify checks integrity only (checksums prove a file matches its
record, not who wrote the record) and says so.
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
    from ..persist.records import CheckpointTrustError

    try:
        return _run(args)
    except CheckpointTrustError as exc:  # e.g. an unusable key: one line, not a traceback
        print(f"deadpool verify: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ..persist.layout import list_versions, read_latest, verify_version
    from ..persist.progress import Progress
    from ..persist.records import BadRecordError
    from ..persist.sign import checkpoint_key, key_env
    from ..persist.storage import open_existing

    key = checkpoint_key()
    storage = open_existing(args.url)
    versions = [v for v in list_versions(storage, key=key) if args.version is None or v.version == args.version]
    report: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        read_latest(storage)
    except BadRecordError as exc:
        problems.append(str(exc))
    for info in versions:
        if info.problem is not None:  # a commit record is there but refused: not "incomplete", an error
            problems.append(info.problem)
            report.append({"tag": info.tag, "complete": False, "ok": False, "errors": [info.problem],
                           "authenticated": False})
            continue
        if info.commit is None:  # not complete
            report.append({"tag": info.tag, "complete": False, "ok": None, "errors": []})
            continue
        errors = verify_version(storage, info, progress=Progress(f"verify {info.tag}",
                                                                  enabled=True if args.progress else None))
        report.append({"tag": info.tag, "complete": True, "ok": not errors, "errors": errors,
                       "files": len(info.commit["files"]), "bytes": info.nbytes, "authenticated": key is not None})
        problems.extend(errors)
    for e in problems:
        print(f"BAD {e}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("checking authenticity (records signed with the checkpoint key) and integrity" if key is not None
              else f"note: no checkpoint key ({key_env()}): integrity only (checksums match the records; who wrote "
                   "the records is not checked)")
        for r in report:
            state = ("incomplete (ignored)" if r["ok"] is None else "REFUSED (bad commit record)") \
                if not r["complete"] else ("OK" if r["ok"] else "BAD")
            extra = f"  {r['files']} files, {r['bytes'] / 1e6:,.1f} MB" if r["complete"] else ""
            print(f"{r['tag']:<20} {state}{extra}")
    if problems:
        return 1
    if not any(r["complete"] for r in report):
        print(f"{args.url}: no complete tier-3 base", file=sys.stderr)
        return 2
    return 0
