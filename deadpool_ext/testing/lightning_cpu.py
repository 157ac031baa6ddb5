"""Run a Lightning script with its ``DeepSpeedStrategy`` allowed on DeepSpeed's CPU accelerator and nothing else
of the extension: ``python -m deadpool_ext.testing.lightning_cpu script.py ARGS`` (after ``torchrun``).

The reference runs of the Lightning tests: the same unmodified script as under the runner, without the runner
(Lightning refuses DeepSpeed on CPU; ``patches/lightning_deepspeed_cpu.py`` is the one change).
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    from deadpool_ext import patches  # type: ignore[attr-defined]

    patches.get("lightning_deepspeed_cpu").apply()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
