"""Take the simulator's fixed costs from this project's measured benchmark results.

Reads ``benchmarks/results/snapshot_overhead.json`` and ``recovery.json`` when present (the committed full runs,
not the ``*_quick`` smoke runs) and returns overrides of :class:`~deadpool_ext.sim.params.Costs`, each with the
JSON path it came from. Absent files or keys simply leave the defaults (which are these same measurements as
of the commit that wrote them), and the provenance says so.

What is taken, and why it transfers to a GPU cluster only roughly:

* ``costs.snapshot_overhead_ratio`` - step-time ratio of ``deadpool`` (snapshot every iteration) over ``none``,
  largest model measured. On 2 shared CPU cores the copy competes with compute; on GPUs it competes for PCIe
  and host memory bandwidth only, so this is pessimistic (DeadPool reports 1.0).
* ``costs.persist_overhead_ratio`` - the same for ``dcp_async`` (a background persistent checkpoint).
* ``costs.hotswap_fixed_s`` = agree + rebuild, ``costs.restore_fixed_s`` = restore, from the hot-swap timeline;
  ``costs.startup_s`` = the relaunched job's start-up and load. Software fixed costs (imports, process groups,
  ``deepspeed.initialize``); on a real cluster NCCL initialisation grows with the job, so treat them as floors.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .params import Params


@dataclass(slots=True)
class Calibration:
    overrides: dict[str, float] = field(default_factory=dict)
    """``costs.key`` -> value taken from the results."""
    sources: dict[str, str] = field(default_factory=dict)
    """``costs.key`` -> where the value came from."""
    missing: list[str] = field(default_factory=list)
    """What could not be read (file absent, key absent), one line each."""

    def apply(self, params: Params) -> Params:
        return params.with_overrides(self.overrides) if self.overrides else params

    def to_dict(self) -> dict[str, Any]:
        return {"overrides": dict(self.overrides), "sources": dict(self.sources), "missing": list(self.missing)}


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _load(path: str, cal: Calibration) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        cal.missing.append(f"{os.path.basename(path)}: not found (defaults kept)")
    except (OSError, ValueError) as exc:
        cal.missing.append(f"{os.path.basename(path)}: unreadable ({exc}); defaults kept")
    return None


def _largest_size(doc: dict) -> str | None:
    sizes = doc.get("sizes") or {}
    ranked = [(_get(v, "result.params") or 0, name) for name, v in sizes.items()
              if _get(v, "analysis.modes.deadpool.ratio_to_none") is not None]
    return max(ranked)[1] if ranked else None


def _take(cal: Calibration, key: str, value: Any, source: str, lo: float) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= lo:
        cal.overrides[key] = float(value)
        cal.sources[key] = source
    else:
        cal.missing.append(f"{source}: absent or out of range ({value!r}); default kept for {key}")


def calibrate(results_dir: str) -> Calibration:
    """Overrides from the results in ``results_dir`` (usually ``benchmarks/results``)."""
    cal = Calibration()
    snap = _load(os.path.join(results_dir, "snapshot_overhead.json"), cal)
    if snap is not None:
        size = _largest_size(snap)
        if size is None:
            cal.missing.append("snapshot_overhead.json: no size with a deadpool ratio; defaults kept")
        else:
            base = f"sizes.{size}.analysis.modes"
            for key, mode in (("costs.snapshot_overhead_ratio", "deadpool"), ("costs.persist_overhead_ratio",
                                                                               "dcp_async")):
                path = f"{base}.{mode}.ratio_to_none"
                # A ratio measured below 1 is noise around "no overhead"; the model needs >= 1.
                value = _get(snap, path)
                if isinstance(value, (int, float)) and 0.9 <= value < 1.0:
                    value = 1.0
                _take(cal, key, value, f"snapshot_overhead.json: {path}", 1.0)
    rec = _load(os.path.join(results_dir, "recovery.json"), cal)
    if rec is not None:
        sizes = [s for s in ("small", "medium", "tiny") if _get(rec, f"sizes.{s}.analysis.hotswap.phases_median")]
        if not sizes:
            cal.missing.append("recovery.json: no hot-swap phases; defaults kept")
        else:
            base = f"sizes.{sizes[0]}.analysis"
            hs = _get(rec, f"{base}.hotswap.phases_median") or {}
            agree, rebuild = hs.get("agree_s"), hs.get("rebuild_s")
            fixed = agree + rebuild if isinstance(agree, (int, float)) and isinstance(rebuild, (int, float)) else None
            _take(cal, "costs.hotswap_fixed_s", fixed, f"recovery.json: {base}.hotswap.phases_median agree_s + "
                                                       "rebuild_s", 0.0)
            _take(cal, "costs.restore_fixed_s", hs.get("restore_s"),
                  f"recovery.json: {base}.hotswap.phases_median.restore_s", 0.0)
            _take(cal, "costs.startup_s", _get(rec, f"{base}.baseline.phases_median.startup_and_load_s"),
                  f"recovery.json: {base}.baseline.phases_median.startup_and_load_s", 0.0)
    return cal
