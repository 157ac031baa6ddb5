"""``deadpool export URL --out FILE.safetensors [--version N]``: consolidated fp32 weights of a tier-3 base.

The newest complete base whose checksums verify (or ``--version N``) is copied into a private directory
(exactly the files its commit record lists, hashed on the way), its pickles checked against the DeepSpeed
allowlist, consolidated with DeepSpeed's zero_to_fp32 (weights-only) and written as safetensors;
``transformers`` models load it with ``load_state_dict`` (``safetensors.torch.load_file``) or
``from_pretrained`` on a folder holding it as ``model.safetensors``.
"""
from __future__ import annotations

import argparse
import json
import sys

HELP = "consolidated fp32 weights of a tier-3 base as .safetensors (Hugging Face loadable)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="tier-3 location (the --save URL)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--version", type=int, default=None, help="base to export (default: newest verified)")
    p.add_argument("--cache", default=None, help="private working directory for the verified copy (default: "
                   "$XDG_CACHE_HOME/deadpool/tier3 or ~/.cache/deadpool/tier3)")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when not a terminal")


def run(args: argparse.Namespace) -> int:
    from ..integrations.deepspeed.export import export_safetensors
    from ..persist.atomic import IncompleteCheckpointError
    from ..persist.progress import Progress
    from ..persist.records import CheckpointTrustError

    try:
        info = export_safetensors(args.url, args.out, version=args.version, cache_root=args.cache,
                                  progress=Progress("verify", enabled=True if args.progress else None),
                                  log=lambda m: print(m, file=sys.stderr))
    except (CheckpointTrustError, IncompleteCheckpointError) as exc:  # one line naming the file, not a traceback
        print(f"deadpool export: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0
