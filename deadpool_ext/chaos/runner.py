"""Launching a scenario: the job under ``deadpool-run`` (every node simulated on this host), the injector in
the foreground, a deadline on every process tree (``testing.launch.run_job`` kills and reaps it), and a
fault-free baseline per layout computed once per campaign."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..recovery.timeline import read_events
from ..testing.jobs import Job
from ..testing.launch import REPO, RunResult, base_env, read_metrics, run_job
from .at_step import GATE_ENV, harness_env
from .catalogue import LAYOUTS, Layout
from .inject import Injector, JobPaths
from .plan import Scenario

DETECT_TIMEOUT_S = 15.0
"""Hang detection of the chaos jobs. Longer than deadpool-run's 3 s default: on a loaded 2-core host a healthy
worker's heartbeat thread can starve for several seconds (seen: a fault-free baseline fenced as hung)."""
TIER3_MB = 192
"""Size of the tmpfs the storage-full trials save into."""


@dataclass(kw_only=True)
class JobRun:
    """One launched job: what it printed, what it measured, what the launcher recorded."""

    returncode: int
    timed_out: bool
    elapsed_s: float
    output: str
    metrics: dict[int, float]
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True)
class TrialRun:
    scenario: Scenario
    first: JobRun
    relaunch: JobRun | None
    injected: list[dict[str, Any]]
    workdir: str
    skipped: str = ""


class Runner:
    """Runs trials in ``workdir``. ``job_timeout_s`` bounds each job (the process tree is killed at it)."""

    def __init__(self, workdir: str, *, job_timeout_s: float = 480.0, log=print) -> None:
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.shm_root = f"/dev/shm/dp-chaos-{uuid.uuid4().hex[:8]}"
        os.makedirs(self.shm_root)
        self.job_timeout_s = job_timeout_s
        self.baselines: dict[tuple[str, int], JobRun] = {}
        self.log = log

    def close(self) -> None:
        shutil.rmtree(self.shm_root, ignore_errors=True)

    # -- commands -------------------------------------------------------------------------------------
    def _config(self, layout: Layout, d: str) -> str:
        if layout.framework == "megatron":
            path = os.path.join(d, "deadpool_megatron.json")
            with open(os.path.join(REPO, "configs", "megatron_tiny_cpu.json")) as fh:
                cfg = json.load(fh)
        else:
            path = os.path.join(d, f"ds_zero{layout.zero_stage}.json")
            with open(os.path.join(REPO, "configs", f"gpt_tiny_zero{layout.zero_stage}_cpu.json")) as fh:
                cfg = json.load(fh)
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        return path

    def _command(self, layout: Layout, d: str, name: str, *, spares: int, iters: int, job_id: str,
                 save: str | None = None, save_interval: int = 0,
                 load: str | None = None) -> tuple[list[str], JobPaths]:
        paths = JobPaths(shm_root=self.shm_root, job_id=job_id, metrics=os.path.join(d, f"{name}.metrics.jsonl"),
                         timeline=os.path.join(d, f"{name}.timeline.jsonl"), save_dir=save)
        args = ["--train-iters", str(iters)]
        if save:
            args += ["--save", save, "--save-interval", str(save_interval)]
        if load:
            args += ["--load", load]
        job = Job(script="scripts/pretrain_gpt.py", args=tuple(args), config=self._config(layout, d),
                  metrics=paths.metrics, nnodes=layout.nnodes, nproc_per_node=layout.nproc_per_node,
                  spare_nodes=spares, job_id=job_id, shm_root=self.shm_root, timeline=paths.timeline,
                  detect_timeout_s=DETECT_TIMEOUT_S)
        if layout.framework == "megatron":
            job = job.replace(script="scripts/pretrain_gpt_megatron.py", config_flag="--deadpool-config",
                              args=("--tensor-model-parallel-size", str(layout.tp), *args))
        return job.argv(), paths

    def _launch(self, cmd: list[str], paths: JobPaths, d: str, name: str, inject=None,
                env: dict[str, str] | None = None) -> JobRun:
        for stale in (paths.metrics, paths.timeline):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        res: RunResult = run_job(cmd, timeout_s=self.job_timeout_s, while_running=inject,
                                 env=base_env(env) if env else None)
        with open(os.path.join(d, f"{name}.log"), "w") as fh:
            fh.write(res.output)
        events = read_events(paths.timeline) if os.path.exists(paths.timeline) else []
        return JobRun(returncode=res.returncode, timed_out=res.timed_out, elapsed_s=res.elapsed_s, output=res.output,
                      metrics=read_metrics(paths.metrics), events=events)

    # -- baseline -------------------------------------------------------------------------------------
    def baseline(self, layout_name: str, iters: int) -> JobRun:
        """The fault-free run of a layout (no spares), once per runner; retried once if it fails (on a loaded
        host a start-up can miss a deadline)."""
        key = (layout_name, iters)
        if key not in self.baselines:
            layout = LAYOUTS[layout_name]
            d = os.path.join(self.workdir, f"baseline-{layout_name}")
            os.makedirs(d, exist_ok=True)
            for attempt in range(2):
                cmd, paths = self._command(layout, d, f"base{attempt}", spares=0, iters=iters,
                                           job_id=f"cb{uuid.uuid4().hex[:8]}")
                self.log(f"[chaos] baseline {layout_name} ({iters} steps), attempt {attempt + 1}")
                run = self._launch(cmd, paths, d, f"base{attempt}")
                if run.returncode == 0 and sorted(run.metrics) == list(range(1, iters + 1)):
                    break
            else:
                raise RuntimeError(f"fault-free baseline of {layout_name} failed twice (rc={run.returncode}, "
                                   f"timed out={run.timed_out}); see {d}:\n{run.output[-3000:]}")
            self.baselines[key] = run
        return self.baselines[key]

    # -- one trial ------------------------------------------------------------------------------------
    def run_trial(self, sc: Scenario) -> TrialRun:
        layout = LAYOUTS[sc.layout]
        d = os.path.join(self.workdir, f"trial-{sc.seed}-{sc.trial:03d}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        with open(os.path.join(d, "scenario.json"), "w") as fh:
            json.dump(sc.to_json(), fh, indent=1)
        with self._save_dir(sc, d) as (save, skipped):
            if skipped:
                empty = JobRun(returncode=0, timed_out=False, elapsed_s=0.0, output="", metrics={})
                return TrialRun(scenario=sc, first=empty, relaunch=None, injected=[], workdir=d, skipped=skipped)
            cmd, paths = self._command(layout, d, "job", spares=sc.spares, iters=sc.iters,
                                       job_id=f"ct{uuid.uuid4().hex[:8]}", save=save, save_interval=sc.save_interval)
            injector = Injector(paths, deadline_s=self.job_timeout_s)
            env = None
            if any(a.op == "corrupt" and a.tier in (1, 2) for a in sc.actions):
                # The restore waits for the corruption (chaos/at_step.py::restore_gate): a recovery faster than
                # the injector must not scan the buffers before their bytes are flipped.
                paths.restore_gate = os.path.join(d, "restore.gate")
                env = harness_env({GATE_ENV: paths.restore_gate})
            first = self._launch(cmd, paths, d, "job", inject=lambda proc: injector.run(proc, sc.actions), env=env)
            injector.release()
            relaunch = None
            if sc.relaunch:
                cmd, paths = self._command(layout, d, "relaunch", spares=0, iters=sc.iters,
                                           job_id=f"cr{uuid.uuid4().hex[:8]}", save=save,
                                           save_interval=sc.save_interval, load=save)
                relaunch = self._launch(cmd, paths, d, "relaunch")
        injected = [vars(r) for r in injector.records]
        return TrialRun(scenario=sc, first=first, relaunch=relaunch, injected=injected, workdir=d)

    @contextlib.contextmanager
    def _save_dir(self, sc: Scenario, d: str) -> Iterator[tuple[str | None, str]]:
        if not sc.save_interval:
            yield None, ""
            return
        save = os.path.join(d, "tier3")
        os.makedirs(save)
        if sc.fault.value != "tier3_full":
            yield save, ""
            return
        # A file system that can be filled without touching anyone else's: a small tmpfs, mounted for the
        # trial only. Needs CAP_SYS_ADMIN (root); without it the trial is reported as skipped.
        if os.geteuid() != 0:
            yield None, "tier3_full needs root to mount a small tmpfs (not covered on this host)"
            return
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TIER3_MB}m", "tmpfs", save],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            yield None, f"tier3_full: mounting a tmpfs failed ({proc.stderr.strip()}): not covered on this host"
            return
        try:
            yield save, ""
        finally:
            for _ in range(10):
                if subprocess.run(["umount", save], capture_output=True, timeout=30).returncode == 0:
                    break
                time.sleep(1)
