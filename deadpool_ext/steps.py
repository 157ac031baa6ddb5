"""``from deadpool_ext.steps import resilient_steps``: a hand-written loop's data position in every snapshot, and
its failed steps redone in place under deadpool-run (``deadpool_ext/integrations/steps.py``)."""
from .integrations.steps import ResilientSteps, Step, resilient_steps

__all__ = ["ResilientSteps", "Step", "resilient_steps"]
