"""Take the simulator's fixed costs from this project's current measured benchmark results.

Reads the current results that ``benchmarks/results/INDEX.md`` names (stable file names; older runs live in
``benchmarks/results/archive/`` and are never read): ``snapshot_overhead.json``,
the ``snapshot_overhead_{small,medium}_n{2,4}.json`` runs for the interference ratios and ``recovery.json``
(the default path, in-place hot-swap) for the recovery costs. Returns overrides of
:class:`~deadpool_ext.sim.params.Costs`, each with the file and the JSON path it came from. Absent files or keys
leave the defaults (which are these same measurements as of the commit that wrote them), and ``missing`` says so.

What is taken, and why it transfers to a GPU cluster only roughly:

* ``costs.snapshot_overhead_ratio`` - the window ratio of ``deadpool`` (snapshot every iteration) over ``none``,
  counted whole: a window of steps ends when its last snapshot is committed (``bench_snapshot_overhead.py``,
  analysis rule ``window``). The largest model measured, and of its measurements the best resolved one (narrowest
  90% interval). Taken as measured, with no clamp; results measured before the window rule (their background work
  outside the timer) are not read. On 2 shared CPU cores the copy competes with compute; on GPUs it competes for
  PCIe and host memory bandwidth only, so this is pessimistic for a GPU cluster.
* ``costs.persist_overhead_ratio`` - the same for ``dcp_async`` (a background persistent checkpoint).
* ``costs.hotswap_fixed_s`` = agree + rebuild, ``costs.restore_fixed_s`` = restore, medians of the hot-swap
  timeline's phases (a failed node the spare built its engine for); ``costs.hotswap_unready_s`` the same over the
  runs that killed a node no spare built for (``recovery_nodes.json``: the other nodes' runs, pooled; the older
  ``recovery.json``: its ``unready`` runs); ``costs.startup_s`` = the relaunched baseline's start-up and
  ``load_checkpoint``. The model
  charges detection (``costs.detect_s``, an at-scale assumption) and the recomputed iteration separately, so the
  measured end-to-end figures (which contain both) are not used as costs. Software fixed costs (imports, process
  groups, ``deepspeed.initialize``); on a real cluster NCCL initialisation grows with the job, so treat them as
  floors.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .params import Params

# The current results, relative to the results directory, in order of preference. These names are the stable
# names of benchmarks/results/INDEX.md (CURRENT in benchmarks/results_index.py); a test checks that they agree.
SNAPSHOT_FILES: tuple[str, ...] = ("snapshot_overhead_medium_n2.json", "snapshot_overhead_medium_n4.json",
                                    "snapshot_overhead_small_n2.json", "snapshot_overhead_small_n4.json")
RECOVERY_FILES: tuple[str, ...] = ("recovery_nodes.json", "recovery.json")
"""``recovery_nodes.json`` first: every node killed in turn (issue 44), so the cost of a node no spare built for is
today's (the spare relabels its engine in place); ``recovery.json`` holds the older ``unready`` runs (the spare
started its script again)."""
# Model sizes of the recovery benchmark, most preferred first: small has 3 repeats, medium one.
RECOVERY_SIZES: tuple[str, ...] = ("small", "medium", "tiny")

# The checkout this module belongs to: file names are shown relative to it (benchmarks/results/...), so the
# provenance printed by `deadpool simulate` names no machine path.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(slots=True)
class Calibration:
    overrides: dict[str, float] = field(default_factory=dict)
    """``costs.key`` -> value taken from the results."""
    sources: dict[str, str] = field(default_factory=dict)
    """``costs.key`` -> ``"<file>: <JSON path>"``, where the value came from."""
    files: dict[str, str] = field(default_factory=dict)
    """``costs.key`` -> the results file alone (relative to the checkout when inside it)."""
    missing: list[str] = field(default_factory=list)
    """What could not be read (file absent, key absent), one line each."""

    def apply(self, params: Params) -> Params:
        return params.with_overrides(self.overrides) if self.overrides else params

    def lines(self, effective: Params | None = None) -> list[str]:
        """One line per calibrated cost, ``costs.hotswap_fixed_s = 0.596 (from <file>: <path>)``; with
        ``effective`` (the parameters finally used), a value replaced later (--params, flags, --set) says so."""
        def fmt(key: str, v: float) -> str:
            return f"{v:.4f}" if key.endswith("_ratio") else f"{v:.3f}"

        out = []
        for key, value in self.overrides.items():
            line = f"{key} = {fmt(key, value)} (from {self.sources[key]})"
            if effective is not None:
                section, name = key.split(".", 1)
                used = getattr(getattr(effective, section), name)
                if used != value:
                    line += f"; overridden: {fmt(key, used)} used"
            out.append(line)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"overrides": dict(self.overrides), "sources": dict(self.sources), "files": dict(self.files),
                "missing": list(self.missing)}


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _display(path: str) -> str:
    full = os.path.abspath(path)
    rel = os.path.relpath(full, _CHECKOUT)
    return full if rel.startswith("..") else rel


def _load_group(results_dir: str, names: tuple[str, ...], cal: Calibration) -> list[tuple[str, dict]]:
    """(display path, document) of each file of a group that exists and parses, in the group's order. Only a
    group with no file at all counts as missing; an unreadable file is always reported."""
    docs, absent = [], []
    for name in names:
        path = os.path.join(results_dir, name)
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            absent.append(name)
            continue
        except (OSError, ValueError) as exc:
            cal.missing.append(f"{_display(path)}: unreadable ({exc}); not used")
            continue
        if isinstance(doc, dict):
            docs.append((_display(path), doc))
        else:
            cal.missing.append(f"{_display(path)}: not a results object; not used")
    if not docs and absent:
        cal.missing.append(f"{' / '.join(absent)}: not found in {_display(results_dir)} (defaults kept)")
    return docs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _take(cal: Calibration, key: str, value: Any, file: str, path: str, lo: float) -> None:
    if _number(value) and value >= lo:
        cal.overrides[key] = float(value)
        cal.sources[key] = f"{file}: {path}"
        cal.files[key] = file
    else:
        cal.missing.append(f"{file}: {path} absent or out of range ({value!r}); default kept for {key}")


def _best_ratio(docs: list[tuple[str, dict]], mode: str) -> tuple[str, str] | None:
    """(file, JSON path) of the ``mode`` ratio to use: the largest model measured, and among its measurements (in
    any of the files) the one with the narrowest 90% interval; earlier files win ties."""
    ranked = []
    for order, (file, doc) in enumerate(docs):
        for size, entry in (doc.get("sizes") or {}).items():
            if _get(entry, "analysis.rule") != "window":  # background work outside the timer: not counted whole
                continue
            base = f"sizes.{size}.analysis.modes.{mode}"
            if not _number(_get(doc, f"{base}.window_ratio")):
                continue
            ci = _get(doc, f"{base}.window_ratio_ci90")
            width = ci[1] - ci[0] if isinstance(ci, list) and len(ci) == 2 and all(map(_number, ci)) else math.inf
            params = _get(entry, "result.params")
            ranked.append((-(params if _number(params) else 0), width, order, file, f"{base}.window_ratio"))
    return min(ranked)[3:] if ranked else None


def _unready(doc: dict[str, Any], size: str) -> tuple[float | None, str]:
    """Agree + rebuild when the failed node is one no spare built for, and where it was read: the median over the
    runs of ``runs.per_node`` (every node but the shadowed one, killed in turn), else the ``unready`` runs'."""
    per_node = _get(doc, f"sizes.{size}.runs.per_node")
    if isinstance(per_node, dict) and per_node:
        sums = sorted(ph["agree_s"] + ph["rebuild_s"] for runs in per_node.values() for r in runs
                      if isinstance(ph := r.get("phases"), dict) and _number(ph.get("agree_s"))
                      and _number(ph.get("rebuild_s")))
        mid = len(sums) // 2
        value = (sums[mid] if len(sums) % 2 else (sums[mid - 1] + sums[mid]) / 2) if sums else None
        return value, (f"sizes.{size}.runs.per_node ({', '.join(sorted(per_node))}: {len(sums)} runs), median of "
                       "phases agree_s + rebuild_s")
    un: dict[str, Any] = _get(doc, f"sizes.{size}.analysis.unready.hotswap.phases_median") or {}
    ua: Any = un.get("agree_s")
    ur: Any = un.get("rebuild_s")
    return (ua + ur if _number(ua) and _number(ur) else None,
            f"sizes.{size}.analysis.unready.hotswap.phases_median agree_s + rebuild_s")


def calibrate(results_dir: str) -> Calibration:
    """Overrides from the current results in ``results_dir`` (usually ``benchmarks/results``)."""
    cal = Calibration()
    snaps = _load_group(results_dir, SNAPSHOT_FILES, cal)
    if snaps:
        for key, mode in (("costs.snapshot_overhead_ratio", "deadpool"), ("costs.persist_overhead_ratio",
                                                                           "dcp_async")):
            best = _best_ratio(snaps, mode)
            if best is None:
                cal.missing.append(f"{' / '.join(f for f, _ in snaps)}: no {mode} window ratio (counted whole); "
                                   f"default kept for {key}")
                continue
            file, path = best
            ci = _get(dict(snaps)[file], path + "_ci90")
            shown = f"{path} (90% CI {ci[0]:.3f}-{ci[1]:.3f})" if isinstance(ci, list) and len(ci) == 2 else path
            _take(cal, key, _get(dict(snaps)[file], path), file, shown, 0.9)
    recs = _load_group(results_dir, RECOVERY_FILES, cal)
    found = next(((file, doc, size) for file, doc in recs for size in RECOVERY_SIZES
                  if _get(doc, f"sizes.{size}.analysis.hotswap.phases_median")), None)
    if recs and found is None:
        cal.missing.append(f"{' / '.join(f for f, _ in recs)}: no hot-swap phases; defaults kept")
    elif found is not None:
        file, doc, size = found
        base = f"sizes.{size}.analysis"
        hs = _get(doc, f"{base}.hotswap.phases_median")
        agree, rebuild = hs.get("agree_s"), hs.get("rebuild_s")
        fixed = agree + rebuild if _number(agree) and _number(rebuild) else None
        _take(cal, "costs.hotswap_fixed_s", fixed, file, f"{base}.hotswap.phases_median agree_s + rebuild_s", 0.0)
        unready, where = _unready(doc, size)
        _take(cal, "costs.hotswap_unready_s", unready, file, where, 0.0)
        _take(cal, "costs.restore_fixed_s", hs.get("restore_s"), file, f"{base}.hotswap.phases_median.restore_s",
              0.0)
        _take(cal, "costs.startup_s", _get(doc, f"{base}.baseline.phases_median.startup_and_load_s"), file,
              f"{base}.baseline.phases_median.startup_and_load_s", 0.0)
    return cal
