"""The trial planner: ``plan_trial(seed, trial, layouts)`` is a pure function (no clock, no global random state,
no environment), so ``deadpool chaos --seed S --trial T`` replays exactly the scenario a campaign ran.

Coverage: the fault of trial ``t`` is the catalogue entry at ``(offset(seed) + t) mod n`` (``n`` faults: the
catalogue less entries none of the chosen layouts can take), so any ``n`` consecutive trials cover every fault the
layouts support. The layout is entry ``(t // n + t mod n) mod c`` of the ``c`` chosen layouts that can take the
fault (planner 2, the default), so trials ``0 .. n * len(layouts) - 1`` run every fault on every layout that takes
it. Planner 1 (``--planner 1``) used ``(t // n + t) mod c``, which with 11 faults and 4 layouts puts each fault on
one layout only; it is kept so that trials recorded under it (``chaos_200``) replay exactly.
Everything else (victim, step, signal, which copy) is drawn from a generator seeded by the string
``"deadpool-chaos/<seed>/<trial>"`` (string seeds are hashed with SHA-512 by :mod:`random`, so the draw does not
depend on PYTHONHASHSEED).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .catalogue import DEFAULT_LAYOUTS, FAULTS, LAYOUTS, TIER3_FAULTS, Action, Fault, Layout, Trigger

PLANNERS = (1, 2)
"""Layout-rotation rules (see the module docstring); the default is the last."""
DEFAULT_PLANNER = PLANNERS[-1]
SAVE_INTERVAL = 2
"""Tier-3 base interval of the relaunch trials (steps)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One trial: a job, the faults injected into it, and what recovery must look like."""

    seed: int
    trial: int
    layout: str
    fault: Fault
    iters: int
    spares: int
    actions: tuple[Action, ...]
    save_interval: int = 0
    """Tier-3 bases every K steps (0: no --save)."""
    relaunch: bool = False
    """Every node is lost: a second job resumes with --load from tier 3."""
    expect_swaps: int = 0
    """Hot swaps that must happen (at least)."""
    layouts: tuple[str, ...] = ()
    """The campaign's layouts and ..."""
    only: tuple[str, ...] = ()
    """... its fault filter (empty: the whole catalogue): both are needed to replay the trial."""
    planner: int = DEFAULT_PLANNER
    """The layout-rotation rule the trial was planned with."""

    def describe(self) -> str:
        return "; ".join(a.describe() for a in self.actions)

    def reproduce(self) -> str:
        cmd = (f"deadpool chaos --seed {self.seed} --trial {self.trial} "
               f"--layouts {','.join(self.layouts or [self.layout])}")
        cmd += f" --faults {','.join(self.only)}" if self.only else ""
        return cmd + (f" --planner {self.planner}" if self.planner != DEFAULT_PLANNER else "")

    def to_json(self) -> dict:
        return {"seed": self.seed, "trial": self.trial, "layout": self.layout, "fault": self.fault.value,
                "iters": self.iters, "spares": self.spares, "save_interval": self.save_interval,
                "relaunch": self.relaunch, "expect_swaps": self.expect_swaps, "planner": self.planner,
                "description": self.describe(),
                "reproduce": self.reproduce()}


def check_layouts(layouts: Sequence[str]) -> tuple[str, ...]:
    if isinstance(layouts, str) or not layouts:
        raise ValueError(f"layouts must be a non-empty list of names from {sorted(LAYOUTS)}, got {layouts!r}")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; choose from {sorted(LAYOUTS)}")
    return tuple(dict.fromkeys(layouts))


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_trial(seed: int, trial: int, layouts: Sequence[str] = DEFAULT_LAYOUTS,
               faults: Sequence[Fault] | None = None, planner: int = DEFAULT_PLANNER) -> Scenario:
    """The scenario of trial ``trial`` of the campaign seeded ``seed`` over ``layouts`` (and, if given, only the
    catalogue entries ``faults``), with layout-rotation rule ``planner``."""
    _check_int("seed", seed, 0)
    _check_int("trial", trial, 0)
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {list(PLANNERS)}, got {planner!r}")
    names = check_layouts(layouts)
    catalogue = FAULTS if faults is None else tuple(Fault(f) for f in faults)
    if not catalogue:
        raise ValueError("faults must name at least one catalogue entry")
    usable = [f for f in catalogue if any(f in LAYOUTS[n].faults for n in names)]
    if not usable:
        raise ValueError(f"none of the faults {[f.value for f in catalogue]} can run on layouts {list(names)}")
    offset = random.Random(f"deadpool-chaos/{seed}").randrange(len(usable))
    fault = usable[(offset + trial) % len(usable)]
    # Layouts rotate too: one step per cycle through the faults, so each fault meets every layout that takes it.
    candidates = [n for n in names if fault in LAYOUTS[n].faults]
    turn = trial // len(usable) + (trial if planner == 1 else trial % len(usable))
    layout = LAYOUTS[candidates[turn % len(candidates)]]
    rng = random.Random(f"deadpool-chaos/{seed}/{trial}")
    sc = _expand(seed, trial, layout, fault, rng)
    return replace(sc, layouts=names, only=() if faults is None else tuple(f.value for f in catalogue),
                   planner=planner)


def plan_campaign(seed: int, trials: int, layouts: Sequence[str] = DEFAULT_LAYOUTS,
                  faults: Sequence[Fault] | None = None, planner: int = DEFAULT_PLANNER) -> list[Scenario]:
    _check_int("trials", trials, 1)
    return [plan_trial(seed, t, layouts, faults, planner) for t in range(trials)]


def _expand(seed: int, trial: int, layout: Layout, fault: Fault, rng: random.Random) -> Scenario:
    """The primitive actions of ``fault`` on ``layout``; every draw comes from ``rng``, in a fixed order."""
    nodes = layout.nodes()
    victim_node = rng.choice(nodes)
    victim = rng.choice(layout.workers(victim_node))
    # Late enough that both tier-1 slots and both replica buffers hold a version; early enough to recompute.
    step = rng.randint(3, layout.iters - 3)
    sig = rng.choice(["SIGKILL", "SIGSTOP"])
    kw: dict[str, Any] = dict(seed=seed, trial=trial, layout=layout.name, fault=fault, iters=layout.iters)

    def signal(target: str, trigger: Trigger, sig: str = "SIGKILL") -> Action:
        return Action(op="signal", target=target, sig=sig, trigger=trigger)

    if fault is Fault.WORKER:
        return Scenario(**kw, spares=1, expect_swaps=1,
                        actions=(signal(victim, Trigger(kind="step", value=step), sig),))
    if fault is Fault.NODE:
        return Scenario(**kw, spares=1, expect_swaps=1,
                        actions=(signal(victim_node, Trigger(kind="step", value=step), sig),))
    if fault is Fault.SPARE:
        # spare0 is lost first; the later worker loss must be taken by spare1 (or, if spare0's hang is not
        # detected yet, by spare0 failing to join and spare1 after it).
        return Scenario(**kw, spares=2, expect_swaps=1, actions=(
            signal("spare0", Trigger(kind="step", value=step - 1), sig),
            signal(victim, Trigger(kind="step", value=step + 1))))
    if fault is Fault.IN_SNAPSHOT:
        return Scenario(**kw, spares=1, expect_swaps=1, actions=(
            signal(victim, Trigger(kind="slot_write", value=step, rank=layout.rank(victim))),))
    if fault is Fault.IN_REPLICATION:
        # The transfer of the victim's replica; SIGKILL either end of it.
        holder = f"{layout.holder_node(victim_node)}.{victim.split('.')[1]}"
        target = rng.choice([victim, holder])
        return Scenario(**kw, spares=1, expect_swaps=1, actions=(
            signal(target, Trigger(kind="replica_write", value=step, rank=layout.rank(victim))),))
    if fault is Fault.IN_RECOVERY:
        # The spare's node dies while everyone rebuilds for generation 1; the failed ranks' state is still held
        # by the original holder, so spare1 can restore it in generation 2. (Killing a survivor instead can lose
        # the only replica of the first victim: that is the documented unrecoverable case, not a chaos trial.)
        return Scenario(**kw, spares=2, expect_swaps=2, actions=(
            signal(victim, Trigger(kind="step", value=step)),
            signal("spare0", Trigger(kind="assignment", value=1))))
    if fault is Fault.CORRUPT_TIER1:
        survivors = [n for n in nodes if n != victim_node]
        node = rng.choice(survivors)
        rank = layout.rank(rng.choice(layout.workers(node)))
        # "all" slots only when this survivor's replica is on a surviving node (it can refetch its own state);
        # otherwise the newest slot only, and the older one must be used.
        which = "all" if layout.holder_node(node) != victim_node and rng.random() < 0.5 else "newest"
        return Scenario(**kw, spares=1, expect_swaps=1, actions=(
            signal(victim_node, Trigger(kind="step", value=step)),
            Action(op="corrupt", tier=1, rank=rank, which=which, trigger=Trigger(kind="assignment", value=1))))
    if fault is Fault.CORRUPT_TIER2:
        return Scenario(**kw, spares=1, expect_swaps=1, actions=(
            signal(victim_node, Trigger(kind="step", value=step)),
            Action(op="corrupt", tier=2, rank=layout.rank(victim), which="newest",
                   trigger=Trigger(kind="assignment", value=1))))
    assert fault in TIER3_FAULTS
    kw3: dict[str, Any] = dict(kw, spares=0, save_interval=SAVE_INTERVAL, relaunch=True)
    first = 2 * SAVE_INTERVAL if rng.random() < 0.5 else SAVE_INTERVAL
    if fault is Fault.CORRUPT_TIER3:
        return Scenario(**kw3, actions=(
            Action(op="corrupt", tier=3, trigger=Trigger(kind="base_published", value=first)),
            Action(op="kill_job", trigger=Trigger(kind="now"))))
    if fault is Fault.TIER3_FULL:
        return Scenario(**kw3, actions=(
            Action(op="fill", trigger=Trigger(kind="base_published", value=first)),
            Action(op="kill_job", trigger=Trigger(kind="step", value=first + 2 * SAVE_INTERVAL + 1))))
    return Scenario(**kw3, actions=(
        Action(op="kill_job", trigger=Trigger(kind="base_writing", value=first + SAVE_INTERVAL)),))
