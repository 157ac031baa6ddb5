"""Host-level faults on the namespace bed (``testing/hosts.py``): ``deadpool chaos --bed``.

Each trial makes a fresh bed of 3 hosts with a 3-member etcd cluster, runs the layout's job under one
``deadpool-run`` per host (node i on host i % 3, spare j on host j % 3), injects one host-level fault and checks the
result against the layout's fault-free run on a bed (bit for bit), in the same row shape as the single-host
campaign (``chaos/report.py`` prints both).

Faults (what is injected -> what must happen):

- ``host_loss``: every process of a follower host SIGKILLed (its launcher, its memory) -> its nodes replaced by
  spares on other hosts;
- ``coordinator_loss``: the same for host 0, which holds the coordinator role -> another launcher takes the role,
  then as above;
- ``partition``: a host's link cut, healed once the next generation is published -> the host pauses its workers
  before its lease lapses, its ranks go to spares; healed, it is fenced for good (its launcher exits 3);
- ``etcd_member``: one etcd member SIGKILLed -> nothing: clients fail over; no failure, no swap;
- ``etcd_quorum``: two members SIGKILLed for 5 s, then restarted -> every host pauses and resumes; no swap;
- ``stuck``: a rank's main thread blocked for good after a step (``hang`` of ``chaos/at_step.py``), its heartbeat
  alive -> found by progress (``--progress-timeout-s``), fenced, replaced.

The plan is pure and seeded like ``chaos/plan.py``: trial t's fault is entry ``(offset(seed) + t) mod 6`` of the
list above, so 6 consecutive trials cover all of them; layout, victim and step are drawn from
``"deadpool-chaos-bed/<seed>/<trial>"``.
"""
from __future__ import annotations

import enum
import json
import os
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .at_step import ENV, harness_env
from .catalogue import LAYOUTS
from .journal import Journal, Pieces

HOSTS = 3
LEADER_TTL_S = 4
PROGRESS_TIMEOUT_S = 6.0
DETECT_TIMEOUT_S = 6.0
"""Heartbeat hang detection of the bed's jobs (5 processes on 2 cores: 3 s starved a healthy worker once)."""
QUORUM_LOSS_S = 5.0


class HostFault(str, enum.Enum):
    HOST_LOSS = "host_loss"
    COORDINATOR_LOSS = "coordinator_loss"
    PARTITION = "partition"
    ETCD_MEMBER = "etcd_member"
    ETCD_QUORUM = "etcd_quorum"
    STUCK = "stuck"


HOST_FAULTS: tuple[HostFault, ...] = tuple(HostFault)
BED_LAYOUTS: tuple[str, ...] = ("zero1", "zero2", "zero3", "megatron")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostScenario:
    seed: int
    trial: int
    layout: str
    fault: HostFault
    iters: int
    step: int
    host: int = -1          # the host lost or cut (host_loss, coordinator_loss, partition)
    member: int = -1        # the etcd member lost (etcd_member; etcd_quorum loses this one and the next)
    rank: int = -1          # the rank stuck (stuck)
    layouts: tuple[str, ...] = ()

    @property
    def expect_swaps(self) -> int:
        return 0 if self.fault in (HostFault.ETCD_MEMBER, HostFault.ETCD_QUORUM) else 1

    def describe(self) -> str:
        at = f"after step {self.step}"
        return {HostFault.HOST_LOSS: f"SIGKILL host {self.host} whole {at}",
                HostFault.COORDINATOR_LOSS: f"SIGKILL host 0 (coordinator) whole {at}",
                HostFault.PARTITION: f"cut host {self.host}'s link {at}, heal after the reassignment",
                HostFault.ETCD_MEMBER: f"SIGKILL etcd member {self.member} {at}",
                HostFault.ETCD_QUORUM: f"SIGKILL etcd members {self.member}, {(self.member + 1) % 3} for "
                                       f"{QUORUM_LOSS_S:g}s {at}",
                HostFault.STUCK: f"block rank {self.rank}'s main thread for good after step {self.step}"}[self.fault]

    def reproduce(self) -> str:
        return (f"deadpool chaos --bed --seed {self.seed} --trial {self.trial} "
                f"--layouts {','.join(self.layouts or (self.layout,))}")

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "trial": self.trial, "layout": self.layout, "fault": self.fault.value,
                "iters": self.iters, "step": self.step, "host": self.host, "member": self.member, "rank": self.rank,
                "expect_swaps": self.expect_swaps, "description": self.describe(), "reproduce": self.reproduce()}


def plan_host_trial(seed: int, trial: int, layouts: Sequence[str] = BED_LAYOUTS,
                    faults: Sequence[HostFault] | None = None) -> HostScenario:
    """Pure: the same (seed, trial, layouts, faults) is always the same scenario."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(trial, bool) or not isinstance(trial, int) or trial < 0:
        raise ValueError(f"trial must be an int >= 0, got {trial!r}")
    names = tuple(dict.fromkeys(layouts))
    bad = [n for n in names if n not in BED_LAYOUTS]
    if not names or bad:
        raise ValueError(f"layouts on the bed: choose from {list(BED_LAYOUTS)}, got {list(layouts)}")
    catalogue = HOST_FAULTS if faults is None else tuple(HostFault(f) for f in faults)
    if not catalogue:
        raise ValueError("faults must name at least one host-level fault")
    offset = random.Random(f"deadpool-chaos-bed/{seed}").randrange(len(catalogue))
    fault = catalogue[(offset + trial) % len(catalogue)]
    layout = LAYOUTS[names[(trial // len(catalogue) + trial) % len(names)]]
    rng = random.Random(f"deadpool-chaos-bed/{seed}/{trial}")
    step = rng.randint(3, layout.iters - 3)
    hosts_with_nodes = sorted({i % HOSTS for i in range(layout.nnodes)})
    followers = [h for h in hosts_with_nodes if h != 0]
    host = {HostFault.HOST_LOSS: rng.choice(followers), HostFault.COORDINATOR_LOSS: 0,
            HostFault.PARTITION: rng.choice(hosts_with_nodes)}.get(fault, -1)
    member = rng.randrange(3) if fault in (HostFault.ETCD_MEMBER, HostFault.ETCD_QUORUM) else -1
    rank = rng.randrange(layout.nnodes * layout.nproc_per_node) if fault is HostFault.STUCK else -1
    return HostScenario(seed=seed, trial=trial, layout=layout.name, fault=fault, iters=layout.iters, step=step,
                        host=host, member=member, rank=rank, layouts=names)


def _script(layout_name: str, workdir: str, tag: str, metrics: str) -> list[str]:
    """The layout's training command (the configs of the single-host campaign, local.shm_root left default: each
    host has its own /dev/shm)."""
    from ..testing.launch import REPO

    layout = LAYOUTS[layout_name]
    name = "megatron_tiny_cpu.json" if layout.framework == "megatron" else f"gpt_tiny_zero{layout.zero_stage}_cpu.json"
    with open(os.path.join(REPO, "configs", name)) as fh:
        cfg = json.load(fh)
    cfg.get("deadpool", {}).pop("local", None)
    path = os.path.join(workdir, f"{tag}.config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    if layout.framework == "megatron":
        head = ["scripts/pretrain_gpt_megatron.py", "--tensor-model-parallel-size", str(layout.tp),
                "--deadpool-config", path]
    else:
        head = ["scripts/pretrain_gpt.py", "--deepspeed_config", path]
    return [*head, "--train-iters", str(layout.iters), "--metrics-out", metrics]


def _injector(sc: HostScenario, marker: str) -> Callable[[Any, str], None]:
    from ..recovery.timeline import read_events
    from ..testing.wait import wait_until

    def inject(bed: Any, timeline: str) -> None:
        if sc.fault in (HostFault.HOST_LOSS, HostFault.COORDINATOR_LOSS):
            bed.kill_host(sc.host)
        elif sc.fault is HostFault.PARTITION:
            bed.cut(sc.host)
            wait_until(lambda: any(e.get("event") == "assignment" for e in read_events(timeline)), 120,
                       "the next generation's assignment")
            time.sleep(1.0)
            bed.heal(sc.host)
        elif sc.fault is HostFault.ETCD_MEMBER:
            bed.etcd.kill_member(sc.member)
        elif sc.fault is HostFault.ETCD_QUORUM:
            lost = [sc.member, (sc.member + 1) % 3]
            for m in lost:
                bed.etcd.kill_member(m)
            time.sleep(QUORUM_LOSS_S)
            for m in lost:
                bed.etcd.restart_member(m)
        elif sc.fault is HostFault.STUCK:
            wait_until(lambda: os.path.exists(marker), 120, f"the stuck fault's marker {marker}")
    return inject


def run_bed_job(layout: str, workdir: str, tag: str, *, sc: HostScenario | None = None,
                job_timeout_s: float = 480.0) -> dict[str, Any]:
    """One job on a fresh bed (the fault of ``sc``, or none): rcs, metrics, events, timing."""
    from ..testing.hostjob import run_on_hosts
    from ..testing.hosts import HostBed

    lay = LAYOUTS[layout]
    metrics = os.path.join(workdir, f"{tag}.jsonl")
    marker = os.path.join(workdir, f"{tag}.stuck")
    env: dict[str, str] = {}
    step = 0
    if sc is not None:
        step = sc.step + 1 if sc.fault is HostFault.STUCK else sc.step
        if sc.fault is HostFault.STUCK:
            env = harness_env({ENV: f"hang@step={sc.step},rank={sc.rank},marker={marker}"})
    bed = HostBed(HOSTS, workdir=workdir, shm_size="3g")
    t0 = time.time()
    bed.start()
    try:
        bed.start_etcd(secrets.token_urlsafe(24), members=3)
        fault = _injector(sc, marker) if sc is not None else None
        if fault is not None and sc is not None and sc.fault is HostFault.STUCK:
            step = 1   # the injector only waits for the marker: start watching at once
        run = run_on_hosts(bed, workdir, _script(layout, workdir, tag, metrics), metrics, nnodes=lay.nnodes,
                           spares=2, name=tag, fault=fault, fault_step=max(1, step), timeout_s=job_timeout_s,
                           leader_ttl_s=LEADER_TTL_S, env=env,
                           extra=["--nproc-per-node", str(lay.nproc_per_node), "--detect-timeout-s",
                                  str(DETECT_TIMEOUT_S), "--progress-timeout-s", str(PROGRESS_TIMEOUT_S)])
        timed_out = any(rc is None and h in bed.holders for h, rc in enumerate(run.rcs))
    finally:
        bed.close()
    return {"rcs": run.rcs, "metrics": run.metrics, "events": run.events, "elapsed_s": time.time() - t0,
            "timed_out": timed_out, "tails": run.tails(1500), "marker": os.path.exists(marker)}


def check_host_trial(sc: HostScenario, job: dict[str, Any], base: dict[int, float]) -> dict[str, Any]:
    """The verdict row (the fields ``chaos/report.py`` reads)."""
    problems: list[str] = []
    events = job["events"]
    swaps = len([e for e in events if e.get("event") == "assignment"])
    restores = {"tier1": 0, "tier2": 0, "tier3": 0}
    for e in events:
        if e.get("event") == "recover":
            restores["tier2" if e.get("restored_from") == "peer" else "tier1"] += 1
    if job["timed_out"]:
        problems.append("silent hang: a launcher did not finish within the job deadline")
    lost_host = sc.host if sc.fault in (HostFault.HOST_LOSS, HostFault.COORDINATOR_LOSS) else None
    fenced_host = sc.host if sc.fault is HostFault.PARTITION else None
    for h, rc in enumerate(job["rcs"]):
        want = None if h == lost_host else 3 if h == fenced_host else 0
        if rc != want and not job["timed_out"]:
            problems.append(f"host {h}'s launcher exited {rc}, expected {want}")
    metrics = job["metrics"]
    # Global rank 0 logs the losses: stuck right after step S (inside the step's after_step hook), it never writes
    # step S's line, and the replacement restores the state *after* S, so S is not run again. Only that line may
    # be missing; every line present must equal the fault-free run's.
    unloggable = {sc.step} if sc.fault is HostFault.STUCK and sc.rank == 0 else set()
    differ = sorted(s for s in set(base) | set(metrics) if s in metrics and metrics[s] != base.get(s))
    missing = sorted(s for s in base if s not in metrics and s not in unloggable)
    mismatch = bool(differ or missing)
    notes: list[str] = []
    if differ:
        problems.append(f"losses differ from the fault-free run at steps {differ[:8]}")
    if missing:
        problems.append(f"steps {missing[:8]} missing from the metrics")
    if unloggable and sc.step not in metrics:
        notes.append(f"step {sc.step}'s loss was never logged: rank 0, its logger, was the stuck rank")
    if swaps < sc.expect_swaps or (sc.expect_swaps == 0 and swaps):
        problems.append(f"{swaps} hot swap(s), expected {sc.expect_swaps}")
    if sc.fault is HostFault.STUCK:
        why = [w["why"] for e in events if e.get("event") == "failure" for w in e["failed"].values()]
        if not any(w.startswith("no progress") for w in why):
            problems.append(f"the stuck rank was not found by progress (failures: {why})")
    if sc.fault is HostFault.COORDINATOR_LOSS and not any(
            e.get("event") == "leader" and e.get("host_rank") != 0 for e in events):
        problems.append("no other launcher took the coordinator role over")
    if sc.fault is HostFault.PARTITION:
        paused = [e for e in events if e.get("event") == "paused"]
        assigned = [e for e in events if e.get("event") == "assignment"]
        if not paused or not assigned or paused[0]["time"] >= assigned[0]["published_at"]:
            problems.append("the partitioned host's workers were not paused before its ranks were reassigned")
    injected = 0 if sc.fault is HostFault.STUCK and not job["marker"] else 1
    status = "failed" if problems else "passed" if injected else "not_injected"
    verdict = {"ok": not problems, "status": status, "problems": problems, "hot_swaps": swaps,
               "restores": restores, "refused": {"tier1": 0, "tier2": 0, "tier3": 0}, "mismatch": mismatch,
               "faults_injected": injected, "hits": [], "notes": notes}
    if problems:
        verdict["notes"] = [*notes, job["tails"][-3000:]]
    return verdict


def run_host_campaign(scenarios: Sequence[HostScenario], *, workdir: str, job_timeout_s: float = 480.0,
                      log: Callable[[str], None] = print, journal: Journal | None = None,
                      stop_after_s: float | None = None, replay_failed: bool = False) -> dict[str, Any]:
    """The bed's campaign; ``journal`` and ``stop_after_s`` as in :func:`chaos.campaign.run_campaign`."""
    from .report import summarize

    os.makedirs(workdir, exist_ok=True)
    baselines: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    pieces = Pieces(journal, stop_after_s, log, "[chaos --bed]", replay_failed=replay_failed)
    for sc in pieces.select(scenarios):
        if sc.layout not in baselines:
            baselines[sc.layout] = _bed_baseline(sc, workdir, job_timeout_s, log, journal)
        log(f"[chaos --bed] trial {sc.trial} ({sc.layout}, {sc.fault.value}): {sc.describe()}")
        job = run_bed_job(sc.layout, workdir, f"trial-{sc.seed}-{sc.trial}", sc=sc, job_timeout_s=job_timeout_s)
        verdict = check_host_trial(sc, job, baselines[sc.layout]["metrics"])
        log(f"[chaos --bed] trial {sc.trial}: {verdict['status']}"
            + (f" - {verdict['problems']}" if verdict["problems"] else ""))
        pieces.record(sc, {"scenario": sc.to_json(), "verdict": verdict, "elapsed_s": job["elapsed_s"],
                           "injected": [], "workdir": workdir})
    every, counts = pieces.finish()
    return {"rows": every, "summary": {**summarize(every), **counts},
            "workdir": os.path.abspath(workdir), "elapsed_s": time.time() - t0,
            "baselines": {k: {"elapsed_s": b["elapsed_s"]} for k, b in baselines.items()}}


def _bed_baseline(sc: HostScenario, workdir: str, job_timeout_s: float, log: Callable[[str], None],
                  journal: Journal | None) -> dict[str, Any]:
    rec = journal.baseline(sc.layout, sc.iters) if journal is not None else None
    if rec is not None:
        log(f"[chaos --bed] baseline {sc.layout} from the journal ({journal.path if journal else ''})")
        return {"metrics": rec["metrics"], "elapsed_s": rec["elapsed_s"]}
    log(f"[chaos --bed] baseline {sc.layout} on a fresh bed")
    base = run_bed_job(sc.layout, workdir, f"base-{sc.layout}", job_timeout_s=job_timeout_s)
    if base["rcs"] != [0] * HOSTS:
        raise RuntimeError(f"the fault-free {sc.layout} run on the bed failed: {base['rcs']}\n{base['tails']}")
    if journal is not None:
        journal.add_baseline(sc.layout, sc.iters, base["metrics"], base["elapsed_s"])
    return base
