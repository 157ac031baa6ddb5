"""``deadpool verify URL [--version N] [--json]``: check every file of the tier-3 bases against the manifests.

Exit status 0 when every complete base verifies; 1 when a file is missing, truncated or corrupt, or a commit
record (or ``latest``) is malformed, names a file the layout never writes, or - with a checkpoint key - is not
signed by it (each problem is one line on stderr naming the file); 2 when there is no complete base at all.
Incomplete bases (no commit record) are listed but are not errors: they are never used.

Authenticity: with ``DEADPOOL_CHECKPOINT_KEY`` set, every commit record must carry a signature by that key
(``deadpool_ext.persist.sign``); without it, verify checks integrity only (checksums prove a file matches its
record, not who wrote the record) and says so.

``--json`` prints the same decisions as one JSON object on stdout (stderr and the exit status are unchanged)::

    {"url": URL, "authenticity": true | false,        # records checked against the key, or integrity only
     "file_names": "deepspeed 0.19.8",                # whose rule names were checked against (commands/_names.py)
     "latest": TAG | null, "problems": [LINE, ...],   # every line printed as "BAD LINE" on stderr
     "bases": [{"tag": TAG, "verdict": "ok" | "bad" | "refused" | "incomplete",
                "errors": [LINE, ...],                # each names the file (or record) and what is wrong
                "complete": bool, "ok": bool | null, "authenticated": bool, "files": N, "bytes": N}, ...]}

``refused``: the commit record (or its signature) is not accepted, so the base is never used; ``bad``: a file
does not match its record; ``incomplete``: no commit record yet (ignored, not an error). A key that cannot be
used (exit 2) prints no JSON, only its one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "verify sizes and xxh3 checksums of tier-3 bases; non-zero exit naming any bad file"


def authenticity_note(checked: bool) -> str:
    """The first line of the human output: what was checked (with a key: who wrote the records too)."""
    from ..persist.sign import key_env

    return ("checking authenticity (records signed with the checkpoint key) and integrity" if checked
            else f"note: no checkpoint key ({key_env()}): integrity only (checksums match the records; who wrote "
                 "the records is not checked)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="tier-3 location (the --save URL)")
    p.add_argument("--version", type=int, default=None, help="only this base")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: authenticity, latest, problems "
                   "and each base's verdict (ok, bad, refused, incomplete) with its errors")
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
    from ..persist.sign import checkpoint_key
    from ..persist.storage import open_existing
    from ._names import use_installed_names

    names = use_installed_names()  # the installed DeepSpeed's naming functions, as the writer's
    key = checkpoint_key()
    storage = open_existing(args.url)
    versions = [v for v in list_versions(storage, key=key) if args.version is None or v.version == args.version]
    report: list[dict[str, Any]] = []
    problems: list[str] = []
    latest = None
    try:
        latest = read_latest(storage)
    except BadRecordError as exc:
        problems.append(str(exc))
    for info in versions:
        if info.problem is not None:  # a commit record is there but refused: not "incomplete", an error
            problems.append(info.problem)
            report.append({"tag": info.tag, "verdict": "refused", "complete": False, "ok": False,
                           "errors": [info.problem], "authenticated": False})
            continue
        if info.commit is None:  # not complete
            report.append({"tag": info.tag, "verdict": "incomplete", "complete": False, "ok": None, "errors": []})
            continue
        errors = verify_version(storage, info, progress=Progress(f"verify {info.tag}",
                                                                  enabled=True if args.progress else None))
        report.append({"tag": info.tag, "verdict": "bad" if errors else "ok", "complete": True, "ok": not errors,
                       "errors": errors, "files": len(info.commit["files"]), "bytes": info.nbytes,
                       "authenticated": key is not None})
        problems.extend(errors)
    for e in problems:
        print(f"BAD {e}", file=sys.stderr)
    if args.json:
        print(json.dumps({"url": args.url, "authenticity": key is not None, "file_names": names, "latest": latest,
                          "problems": problems, "bases": report}, indent=1))
    else:
        print(authenticity_note(key is not None))
        for r in report:
            state = {"incomplete": "incomplete (ignored)", "refused": "REFUSED (bad commit record)", "ok": "OK",
                     "bad": "BAD"}[r["verdict"]]
            extra = f"  {r['files']} files, {r['bytes'] / 1e6:,.1f} MB" if r["complete"] else ""
            print(f"{r['tag']:<20} {state}{extra}")
    if problems:
        return 1
    if not any(r["complete"] for r in report):
        print(f"{args.url}: no complete tier-3 base", file=sys.stderr)
        return 2
    return 0
