"""Megatron-Core integration: per-rank (TP/PP/DP shard) snapshots, parallel-state rebuild on hot-swap,
tier-3 bases in dist_checkpointing format. See docs/megatron.md.

Modules: ``layout`` (pure rank <-> coordinates), ``parallel`` (shims, initialize/destroy parallel state),
``model`` (GPT + optimizer builder), ``step`` (one iteration through Megatron's schedules), ``state``
(MegatronStateAdapter), ``runtime`` (MegatronRuntime), ``checkpoint`` (tier 3), ``train`` (the script's loop).
Importing this package imports neither Megatron-Core nor the patches.
"""
from __future__ import annotations

from .layout import Coordinates, Layout, LayoutError, coordinates

__all__ = ["Coordinates", "Layout", "LayoutError", "coordinates"]
