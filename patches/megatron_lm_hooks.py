"""Hooks for Megatron-LM's own training loop (``pretrain_gpt.py`` users): ``--deadpool-*`` flags and a
step hook around ``megatron.training.training.train_step``.

Megatron-LM is not a PyPI package and is not installed in this project's environment: this module is
tested against a stand-in ``megatron.training.training`` module (tests/unit/test_patches.py), not against a
real Megatron-LM checkout. What is tested: the flags, the version guard, and that the hook runs around
``train_step`` and reverts. What is not: a real Megatron-LM run.

Use in a copy of Megatron-LM's ``pretrain_gpt.py``::

    from deadpool_ext.patches.megatron_lm_hooks import add_deadpool_args, TRAIN_STEP_HOOK
    ...
    TRAIN_STEP_HOOK.configure(before=runtime.wait_for_copy, after=on_step_done)  # e.g. a MegatronRuntime's hooks
    TRAIN_STEP_HOOK.apply()
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_deadpool_args)

``before`` runs before each ``train_step`` (it contains the optimizer step, so an in-flight snapshot copy
must be finished by then: the copy overlaps the rest of the previous iteration rather than this one's
forward/backward), ``after`` runs once it returned. The hook knows nothing of deadpool_ext's runtime (patches
never import the integrations); the caller passes the callables.
"""
from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from .base import Patch, UnsupportedVersionError
from .megatron_core_cpu_device import SUPPORTED_MEGATRON_CORE


def add_deadpool_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: adds the ``--deadpool-*`` flags and returns the parser."""
    g = parser.add_argument_group(title="deadpool_ext")
    g.add_argument("--deadpool-config", default=None,
                   help='JSON file with a "deadpool" section (keys of deadpool_ext.config.DeadpoolConfig)')
    g.add_argument("--deadpool-disable", action="store_true", help="train without the extension")
    g.add_argument("--deadpool-snapshot-interval", type=int, default=None,
                   help="override deadpool.snapshot.interval (in-memory snapshot every N iterations)")
    g.add_argument("--deadpool-replication-factor", type=int, default=None,
                   help="override deadpool.replication.factor (peer replicas per rank, 0: tier 2 off)")
    return parser


def deadpool_section(args: argparse.Namespace) -> dict[str, Any]:
    """The ``deadpool`` config section the flags describe (file first, then the overrides)."""
    import json

    section: dict[str, Any] = {}
    if args.deadpool_config:
        with open(args.deadpool_config) as fh:
            section = dict(json.load(fh).get("deadpool", {}))
    if args.deadpool_disable:
        section["enabled"] = False
    if args.deadpool_snapshot_interval is not None:
        section.setdefault("snapshot", {})["interval"] = args.deadpool_snapshot_interval
    if args.deadpool_replication_factor is not None:
        section.setdefault("replication", {})["factor"] = args.deadpool_replication_factor
    return section


class MegatronLMTrainStepHook(Patch):
    name = "megatron_lm_hooks"
    requires = {"megatron-core": SUPPORTED_MEGATRON_CORE}
    why = "deadpool_ext hooks around megatron.training.training.train_step"

    def __init__(self) -> None:
        super().__init__()
        self.before: Callable[[], None] | None = None
        self.after: Callable[[], None] | None = None

    def configure(self, *, before: Callable[[], None] | None, after: Callable[[], None] | None) -> None:
        self.before, self.after = before, after

    def _check_environment(self) -> None:
        try:
            import megatron.training.training  # noqa: F401
        except ImportError as exc:
            raise UnsupportedVersionError(f"patch {self.name}: Megatron-LM (megatron.training) is not importable; "
                                          "this hook is for Megatron-LM's own training loop") from exc

    def _apply(self) -> None:
        import megatron.training.training as mt

        original = mt.train_step
        hook = self

        @functools.wraps(original)
        def train_step(*args: Any, **kwargs: Any) -> Any:
            if hook.before is not None:
                hook.before()
            out = original(*args, **kwargs)
            if hook.after is not None:
                hook.after()
            return out

        self._swap(mt, "train_step", train_step)


TRAIN_STEP_HOOK = MegatronLMTrainStepHook()
PATCH = TRAIN_STEP_HOOK
apply = PATCH.apply
revert = PATCH.revert
