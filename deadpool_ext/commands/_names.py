"""Which rule ``deadpool verify`` and ``deadpool inspect`` check checkpoint file names against.

The writer (the checkpoint engine and tier 3) takes the names from the installed DeepSpeed's own naming functions
(``integrations/deepspeed/names.py``). The tools take them from the same source whenever DeepSpeed imports, so a
DeepSpeed that writes a new name is read back by the same rule that wrote it; only where DeepSpeed is not
installed (or does not import) do they check against the persist layer's fallback list of DeepSpeed 0.19's names
(``persist/layout.py``), and they say so in their JSON (``file_names``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys


def use_installed_names() -> str:
    """Check names with the installed DeepSpeed's naming functions from now on, if it imports; returns where the
    rule in force comes from: ``deepspeed <version>`` or ``fallback list (<why>)``, one line. A DeepSpeed whose
    naming functions no longer take the arguments used fails loudly, as it fails the writer."""
    if importlib.util.find_spec("deepspeed") is None:
        return "fallback list (DeepSpeed is not installed)"
    # DeepSpeed's logger writes to the stdout it finds at import (e.g. its accelerator detection): stdout is the
    # tools' --json, so whatever DeepSpeed says while the rule is made goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import deepspeed

            from ..integrations.deepspeed.names import deepspeed_file_names
        except Exception as exc:  # noqa: BLE001 - any import failure: say which, check with the fallback list
            why = " ".join(f"{type(exc).__name__}: {exc}".split())
            return f"fallback list (DeepSpeed does not import: {why})"
        deepspeed_file_names()
    from ..persist.layout import use_file_names

    use_file_names(deepspeed_file_names)
    return f"deepspeed {deepspeed.__version__}"
