"""Chaos suite: random faults over many trials, each checked against a fault-free run (docs/chaos.md).

**A tool beside the product, not part of it**: nothing in the core or the integrations imports this package (the
import contracts in ``pyproject.toml`` forbid it), and a user's job never runs it.

- :mod:`.catalogue`  the faults (an enum), the layouts they run on, the primitive actions a fault expands to
- :mod:`.plan`       ``plan_trial(seed, trial, layouts)``: a pure function from a seed to a scenario
- :mod:`.inject`     applying one action to a running job (signals, byte corruption, a full disk)
- :mod:`.runner`     launching a scenario under ``deadpool-run`` with deadlines, baselines cached per layout
- :mod:`.check`      what a trial must satisfy: identical losses, every corrupt copy refused and never used
- :mod:`.report`     the summary table and its JSON
- :mod:`.journal`    a campaign in pieces: finished trials and baselines as JSON lines, skipped when run again
- :mod:`.hostfaults` host-level faults on the namespace bed (``deadpool chaos --bed``)

The CLI is ``deadpool chaos`` (``deadpool_ext/commands/chaos.py``).
"""
from __future__ import annotations

from .catalogue import FAULTS, LAYOUTS, Action, Fault, Layout, Trigger
from .plan import Scenario, plan_campaign, plan_trial

__all__ = ["FAULTS", "LAYOUTS", "Action", "Fault", "Layout", "Trigger", "Scenario", "plan_campaign", "plan_trial"]
