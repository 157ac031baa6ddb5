"""``deadpool inspect URL [--shm-root DIR] [--json]``: what each tier holds.

- tier 3 (URL): every ``global_stepN`` base with its size, file count, layout (world / dp size, ZeRO stage),
  whether it is complete (commit record present) and where ``latest`` points. Checksums are not read here
  (that is ``deadpool verify``), so it is fast on large bases. A commit record or ``latest`` that is malformed
  (or, with ``DEADPOOL_CHECKPOINT_KEY``, not signed by the key) is shown as REFUSED, named on stderr in one
  line, and the exit status is 1.
- tiers 1 and 2 (this host's shared memory, ``--shm-root``, default /dev/shm): the ``deadpool.<job>.<node>``
  directories, their snapshot slots (tier 1) and peer replicas (tier 2), with the version each complete slot
  holds (header only; torn or in-progress slots show as incomplete).

File names in the records are checked against the installed DeepSpeed's naming functions whenever DeepSpeed
imports (``commands/_names.py``); ``--json`` says which rule (``file_names``).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import sys
import time
from typing import Any

HELP = "versions, sizes and completeness per tier (tier 3 at URL; tiers 1/2 in this host's shared memory)"
_SEG = re.compile(r"^deadpool\.(?P<job>[A-Za-z0-9_-]+)\.(?P<kind>[a-z]+)\.r(?P<rank>\d+)\.(?P<slot>[A-Za-z0-9_-]+)$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="tier-3 location (the --save URL)")
    p.add_argument("--shm-root", default="/dev/shm", help="node-local shared memory to scan for tiers 1/2")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def tier3_report(url: str, key: bytes | None = None) -> dict[str, Any]:
    from ..persist.layout import list_versions, read_latest
    from ..persist.records import BadRecordError
    from ..persist.storage import open_existing

    storage = open_existing(url)
    out = []
    problems: list[str] = []
    for v in list_versions(storage, key=key):
        row: dict[str, Any] = {"version": v.version, "tag": v.tag, "complete": v.complete}
        if v.problem is not None:
            row.update(refused=v.problem)
            problems.append(v.problem)
        elif v.commit:
            c = v.commit
            row.update(bytes=v.nbytes, files=len(c["files"]), world_size=c.get("world_size"),
                       dp_world_size=c.get("dp_world_size"), zero_stage=c.get("zero_stage"),
                       published=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.get("published_at", 0))))
        else:
            names = storage.listdir(v.tag)
            row.update(files=len([n for n in names if not n.startswith(".tmp.")]),
                       ranks_done=len([n for n in names if n.startswith("deadpool_manifest.rank")]))
        out.append(row)
    try:
        latest = read_latest(storage)
    except BadRecordError as exc:
        latest = None
        problems.append(str(exc))
    return {"url": url, "latest": latest, "versions": out, "problems": problems}


def _slot_version(path: str) -> tuple[int | None, int]:
    from ..snapshot.slots import probe_slot

    size = os.path.getsize(path)
    if size == 0:
        return None, 0
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        meta, _ = probe_slot(memoryview(mm), verify=False)
    version = meta.get("version") if meta else None
    return (int(version) if version is not None else None), size


def memory_report(shm_root: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not os.path.isdir(shm_root):
        return rows
    for d in sorted(os.listdir(shm_root)):
        full = os.path.join(shm_root, d)
        if not (d.startswith("deadpool.") and os.path.isdir(full)):
            continue
        for name in sorted(os.listdir(full)):
            m = _SEG.match(name)
            if not m:
                continue
            try:
                version, size = _slot_version(os.path.join(full, name))
            except Exception:  # noqa: BLE001 - a slot being rewritten right now: report it as incomplete
                version, size = None, os.path.getsize(os.path.join(full, name))
            rows.append({"dir": d, "tier": 1 if m["kind"] == "snap" else 2, "kind": m["kind"], "job": m["job"],
                         "rank": int(m["rank"]), "slot": m["slot"], "bytes": size, "version": version,
                         "complete": version is not None})
    return rows


def run(args: argparse.Namespace) -> int:
    from ..persist.records import CheckpointTrustError
    from ..persist.sign import checkpoint_key
    from ._names import use_installed_names

    names = use_installed_names()  # the installed DeepSpeed's naming functions, as the writer's
    try:
        t3 = tier3_report(args.url, checkpoint_key())
    except CheckpointTrustError as exc:  # e.g. an unusable key: one line, not a traceback
        print(f"deadpool inspect: {exc}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"tier3": t3, "memory": memory_report(args.shm_root), "file_names": names}
    for p in t3["problems"]:
        print(f"REFUSED {p}", file=sys.stderr)
    status = 1 if t3["problems"] else 0
    if args.json:
        print(json.dumps(report, indent=1))
        return status
    print(f"tier 3: {t3['url']}  (latest -> {t3['latest']})")
    if not t3["versions"]:
        print("  no bases")
    for r in t3["versions"]:
        if "refused" in r:
            print(f"  {r['tag']:<18} REFUSED    (its commit record: see stderr; never used)")
        elif r["complete"]:
            print(f"  {r['tag']:<18} complete   {r['bytes'] / 1e6:10,.1f} MB  {r['files']:3d} files  "
                  f"world {r['world_size']}"
                  f" dp {r['dp_world_size']} ZeRO-{r['zero_stage']}  {r['published']}")
        else:
            print(f"  {r['tag']:<18} INCOMPLETE ({r['files']} files, {r['ranks_done']} rank manifests; never used)")
    mem = report["memory"]
    print(f"tiers 1/2: {args.shm_root}" + ("" if mem else "  (no deadpool shared memory on this host)"))
    for r in mem:
        state = f"version {r['version']}" if r["complete"] else "incomplete"
        print(f"  tier {r['tier']} {r['dir']}/r{r['rank']}.{r['slot']:<8} {r['bytes'] / 1e6:10,.1f} MB  {state}")
    return status
