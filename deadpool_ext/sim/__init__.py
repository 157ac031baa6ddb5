"""Large-cluster simulator: goodput of fault-tolerance policies on 512 to 16,384+ GPUs (``deadpool simulate``).

**A tool beside the product, not part of it**: nothing in the core or the integrations imports this package (the
import contracts in ``pyproject.toml`` forbid it), and a user's job never runs it.

Pure Python (no torch). Modules, in dependency order:

* :mod:`.params`      typed parameters (failure model, cluster, workload, bandwidths, costs, Monte Carlo)
* :mod:`.costs`       per-phase times derived from the parameters (bytes over bandwidths, fixed costs)
* :mod:`.calibration` fixed costs taken from this project's measured benchmark results
* :mod:`.failures`    seeded failure traces (Poisson, per-kind), shared by all policies
* :mod:`.policies`    restart from storage (sync/async), Gemini, DeadPool hot-swap, TierCheck
* :mod:`.elastic`     shrink and grow: the cost of running on fewer data-parallel replicas (no spare left)
* :mod:`.engine`      the discrete-event engine: one trial of one policy on one trace
* :mod:`.analytic`    Young / Daly closed forms
* :mod:`.sweep`       Monte Carlo summaries and the interval search
* :mod:`.checks`      the model against analytic results and published figures
* :mod:`.recommend`   which policy and intervals to choose; :mod:`.report` renders it

Model, parameters, sources and validation: ``docs/simulator.md``.
"""
from __future__ import annotations

from .params import Params, SimParamError
from .policies import POLICY_NAMES, make_policy

__all__ = ["Params", "SimParamError", "POLICY_NAMES", "make_policy"]
