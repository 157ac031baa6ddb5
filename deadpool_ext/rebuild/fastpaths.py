"""Whether a deadpool-run job's fast paths are on (the in-place swap, a spare's build-ahead), and the real reason
when one is off (pure: no store, no torch, no processes).

Why two readings: the runner decides before the script's first line, from the configs it can see
(:func:`before_script`), because the process groups are built there (swappable or not) and a spare builds ahead
there or waits. A script that builds its config dict in code shows nothing before it runs. Then the runner
assumes the section's defaults (in-place on, build-ahead on; ``known`` False): the active ranks build swappable
groups, which cost nothing if the section later turns the swap off (the runtime then recovers by rebuild or
restart, and a rebuild builds plain groups). A spare cannot assume: building ahead for a job whose section says
otherwise, or that never attaches, would build an engine nobody joins. So rank 0 writes what its section says when
it attaches (:func:`at_attach`, the store key ``config/fast_paths``), and a spare that saw no config waits for that
record (or its assignment, whichever comes first) before it decides (:func:`for_spare`); a process that joins a
later generation without having built ahead takes the group mode from it too (:func:`groups_in_place`).

Call order: runner ``before_script`` -> ``init_distributed`` (actives: groups; spares: ``rebuild/spare.py``
``build_ahead``, which reads the record through :func:`for_spare`) -> the script -> the engine's attach writes
``at_attach`` (rank 0) -> spares decide.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import DeadpoolConfig
    from ..launcher.values import JobFastPaths

NO_CONFIG = "no config visible before the script ran"


@dataclass(frozen=True, slots=True)
class FastPaths:
    in_place: bool
    """The process groups are swappable and survivors keep their engine (``hot_swap.in_place``)."""
    build_ahead: bool
    """A spare builds its engine before any failure (``hot_swap.spare_build_ahead``, with ``in_place``)."""
    why_not: str | None = None
    """The real reason a fast path is off (None when both are on)."""
    known: bool = True
    """False: no config was visible before the script ran, these are the section's defaults, assumed until the
    job's engine attaches and says what its section holds."""


def _from_section(cfg: DeadpoolConfig, where: str, *, swaps_in_place: bool, rebuilds: str) -> FastPaths:
    if not cfg.hot_swap.enabled:
        return FastPaths(False, False, f"hot_swap.enabled is false in {where}")
    if not swaps_in_place:
        return FastPaths(False, False, f"every rank rebuilds ({rebuilds})")
    if not cfg.hot_swap.in_place:
        return FastPaths(False, False, f"hot_swap.in_place is false in {where}")
    if not cfg.hot_swap.spare_build_ahead:
        return FastPaths(True, False, f"hot_swap.spare_build_ahead is false in {where}")
    return FastPaths(True, True)


def before_script(ds_configs: Sequence[str], configs: Sequence[str], cfg: DeadpoolConfig | None) -> FastPaths:
    """The runner's reading (``run.py``): ``ds_configs``, the DeepSpeed configs with a section named for this job;
    ``configs``, every config with a section (Megatron-Core's ``--deadpool-config`` holds only the section);
    ``cfg``, the first section found. No config at all: the defaults, assumed (``known`` False)."""
    if not configs or cfg is None:
        return FastPaths(True, True, None, known=False)
    # DeepSpeed and Megatron-Core (whose --deadpool-config holds only the section) both swap in place
    return _from_section(cfg, configs[0], swaps_in_place=True, rebuilds="")


def at_attach(cfg: DeadpoolConfig, *, swaps_in_place: bool, framework: str) -> FastPaths:
    """What the section an engine attached with says (rank 0 writes it for spares: ``config/fast_paths``)."""
    return _from_section(cfg, "the config the script passed to its engine", swaps_in_place=swaps_in_place,
                         rebuilds=f"{framework} has no in-place swap")


def from_record(job: JobFastPaths) -> FastPaths:
    return FastPaths(job.in_place, job.build_ahead, job.why or None)


def for_spare(runner: FastPaths, job: JobFastPaths | None) -> FastPaths | None:
    """What a spare does before its script: the runner's reading when it saw a config; else the job's record once
    rank 0 attached; None: not known yet (the spare waits for the record or its assignment)."""
    if runner.known:
        return runner
    return None if job is None else from_record(job)


def groups_in_place(runner: FastPaths, job: JobFastPaths | None, generation: int) -> bool:
    """Whether this process builds swappable groups for ``generation`` when it forms it without having built ahead
    (an active rank in generation 0, a spare assigned later, a process started again): the runner's reading when
    it saw a config; else the job's record; else (no rank attached yet) the defaults in generation 0, where every
    rank builds, and plain groups later, since no survivor can be keeping an engine that never attached."""
    if runner.known:
        return runner.in_place
    if job is not None:
        return job.in_place
    return generation == 0


def spare_line(worker_id: str, why: str) -> str:
    """The spare's line when it does not build ahead (the real reason)."""
    return f"spare {worker_id}: not built ahead ({why}); it builds its engine after an assignment"
