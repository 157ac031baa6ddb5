"""``deadpool check CONFIG.json [--json]``: validate a ``"deadpool"`` section offline, before a job is launched.

Reads a DeepSpeed config (or a Megatron ``--deadpool-config`` file: only the section), names *every* bad key of
the section (one line each: the key and what is allowed), prints what the section turns on, and says which
launch paths honour it:

- ``deadpool-run ... train.py``, ``torchrun ... -m deadpool_ext.run train.py`` (any launcher), or
  ``import deadpool_ext.auto`` in the script: every ``deepspeed.initialize`` with this config attaches (raw
  calls, HF Trainer and Accelerate, Lightning's ``DeepSpeedStrategy``), if the installed DeepSpeed is one the
  hook supports;
- ``deadpool_ext.deepspeed.initialize`` in the script: always;
- plain ``torchrun train.py`` with ``deepspeed.initialize``: **not** honoured (DeepSpeed drops unknown keys).

Exit status 0 when the section is valid, 1 when a key is bad, 2 when the file cannot be read or has no section.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from typing import Any

HELP = "validate a \"deadpool\" config section offline: every bad key, what it turns on, which launches honour it"
MAX_PROBLEMS = 50
_PATH = re.compile(r"^deadpool config: (deadpool(?:\.[A-Za-z0-9_]+)*)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="DeepSpeed config JSON (or a file holding only {\"deadpool\": {...}})")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def all_problems(section: Any) -> list[str]:
    """Every bad key of ``section`` (one message each, as the loader words it): the loader stops at the first,
    so each bad key is dropped in turn (its default used) and the section loaded again."""
    from ..config import ConfigError, DeadpoolConfig

    doc = copy.deepcopy(section)
    problems: list[str] = []
    while len(problems) < MAX_PROBLEMS:
        try:
            DeadpoolConfig.from_dict(doc)
            return problems
        except ConfigError as exc:
            msg = str(exc)
            problems.append(msg)
            m = _PATH.match(msg)
            if m is None or not _drop(doc, m.group(1).split(".")[1:]):
                return problems  # not attributable to one key (e.g. the section itself): nothing more to learn
    return problems


def _drop(doc: Any, keys: list[str]) -> bool:
    """Remove ``doc[k0][k1]...``; False when there is nothing to remove (the error is about the whole object)."""
    if not keys:
        return False
    node = doc
    for k in keys[:-1]:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    if not isinstance(node, dict) or keys[-1] not in node:
        return False
    del node[keys[-1]]
    return True


def _hook_support() -> tuple[bool, str]:
    try:
        from .. import patches  # type: ignore[attr-defined]

        patches.get("deepspeed_initialize_hook").check()
    except ImportError as exc:
        return False, f"the hook cannot be loaded ({exc})"
    except Exception as exc:  # UnsupportedVersionError: its one line names the versions
        return False, str(exc)
    return True, "supported by the installed DeepSpeed"


def _turns_on(cfg: Any) -> list[str]:
    """What the section turns on, each tier with what it depends on in the launch layout: a tier that needs other
    nodes is off when every rank lands on one host."""
    out = []
    if not cfg.enabled:
        return ["nothing: enabled is false (DeepSpeed runs exactly as without the section)"]
    out.append(f"tier 1: snapshots of every rank's state every {cfg.snapshot.interval} step(s) into shared memory "
               f"({cfg.local.shm_root})" + (" in the background" if cfg.snapshot.background else ", in the foreground")
               + "; survives a worker's restart on the same node, not the loss of the node")
    if cfg.replication.factor:
        layout = (f"{cfg.local.simulate_nodes} simulated nodes on one host (a test layout)" if cfg.local.simulate_nodes
                  else "depends on the launch layout: on only when the ranks span at least 2 nodes (hosts, or "
                       "deadpool-run's --nnodes); with every rank of a torchrun job on one host there is no other node "
                       "to hold a replica and tier 2 is off")
        out.append(f"tier 2: {cfg.replication.factor} replica(s) of each snapshot in other nodes' memory ({layout})")
    else:
        out.append("tier 2 off (replication.factor 0): a lost node's state comes only from tier 3")
    if cfg.differential.enabled:
        out.append(f"differentials between bases every {cfg.differential.base_interval} steps")
    if cfg.persist.url:
        out.append(f"tier 3: a base every {cfg.persist.interval} step(s) to {cfg.persist.url}" if cfg.persist.interval
                   else f"tier 3 at {cfg.persist.url}, but persist.interval is 0: no base is ever written")
    if cfg.hot_swap.enabled:
        out.append("hot-swap under deadpool-run (depends on the launch: spares from --spare-nodes replace failed "
                   "nodes in-process; under torchrun a failure restarts every worker, which restore from tiers 1-2)")
    st = cfg.straggler
    if st.action != "off":
        out.append(f"stragglers under deadpool-run: a node {st.factor:g}x slower than the others' median over "
                   f"{st.window_s:g} s is " + ("named and replaced by a spare in place (never with no spare left, "
                                               "at most once per window)" if st.action == "swap" else
                                               "named (log, timeline, metrics), not replaced")
                   + " (deadpool-run's --straggler-* flags win)")
    return out


def run(args: argparse.Namespace) -> int:
    from ..config import SECTION, DeadpoolConfig
    from ..integrations.deepspeed_hook import read_json

    doc = read_json(args.config)
    if doc is None:
        print(f"deadpool check: {args.config}: cannot read it as JSON (missing, unreadable, not JSON, or over 16 MiB)",
              file=sys.stderr)
        return 2
    if not isinstance(doc, dict) or SECTION not in doc:
        print(f"deadpool check: {args.config}: no \"{SECTION}\" section (add \"{SECTION}\": {{...}}; every key is "
              "documented in deadpool_ext/config.py)", file=sys.stderr)
        return 2
    problems = all_problems(doc[SECTION])
    megatron_only = not (set(doc) - {SECTION})
    supported, why = _hook_support()
    megatron = "scripts/pretrain_gpt_megatron.py --deadpool-config FILE (under deadpool-run or torchrun)"
    paths: list[dict[str, Any]] = ([{"launch": megatron, "honoured": True}] if megatron_only else [
        {"launch": "deadpool-run ... train.py / torchrun ... -m deadpool_ext.run train.py / accelerate launch ... -m "
                   "deadpool_ext.run train.py / import deadpool_ext.auto",
         "honoured": supported, "why": why},
        {"launch": "deadpool_ext.deepspeed.initialize(...) in the script", "honoured": True},
        {"launch": "plain torchrun/deepspeed train.py with deepspeed.initialize", "honoured": False,
         "why": "DeepSpeed drops keys it does not know; nothing would warn"}])
    turns_on = [] if problems else _turns_on(DeadpoolConfig.from_dict(doc[SECTION]))
    if args.json:
        bad_keys = [m.group(1) for m in map(_PATH.match, problems) if m is not None]
        print(json.dumps({"config": args.config, "ok": not problems, "problems": problems, "bad_keys": bad_keys,
                          "turns_on": turns_on, "launch_paths": paths}, indent=2))
        return 1 if problems else 0
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"deadpool check: {args.config}: {len(problems)} bad key(s) in the \"{SECTION}\" section",
              file=sys.stderr)
        return 1
    print(f"{args.config}: the \"{SECTION}\" section is valid. It turns on:")
    for line in turns_on:
        print(f"  - {line}")
    print("Launch paths:")
    for path in paths:
        print(f"  - [{'yes' if path['honoured'] else 'NO '}] {path['launch']}"
              + (f": {path['why']}" if path.get("why") else ""))
    return 0
