"""One training job's command line, for every launcher the tests, chaos runs and benchmarks start jobs under.

A :class:`Job` names what a job is (the script and its arguments, its config, where its metrics go, how many
ranks) and under which launcher it runs; ``argv()`` spells the command line and ``env()`` its environment.
Nothing else in the tests, ``deadpool_ext/chaos`` or ``benchmarks`` writes ``-m deadpool_ext.launcher.cli``,
``-m torch.distributed.run`` or a launcher's path by hand::

    job = Job(script="scripts/pretrain_gpt.py", nnodes=3, spare_nodes=1, shm_root=shm, timeline=tl,
              config=cfg, metrics=m, args=("--train-iters", "12"))
    run_job(job.argv(), timeout_s=400, env=job.env())

The launchers, and the flags each one gets:

- ``deadpool-run`` (``python -m deadpool_ext.launcher.cli``): ``--nnodes``, ``--nproc-per-node``,
  ``--spare-nodes`` and the rest of the typed fields, each only when set (the launcher's default otherwise);
- ``torchrun`` (``python -m torch.distributed.run``): ``--nproc-per-node=N --nnodes=1 --max-restarts=R``,
  loopback rendezvous on ``port``, a 0.2 s monitor interval;
- ``deepspeed`` (the ``deepspeed`` script beside the interpreter): ``--num_gpus N --master_port P``;
- ``accelerate`` (``accelerate launch``): ``--main_process_port P``, then ``launcher_flags``.

An invalid combination (a deadpool-run flag under torchrun, no port for a rendezvous) is a ``ValueError`` with one
line naming the field and what is allowed, raised when the ``Job`` is made.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .launch import base_env

Launcher = Literal["deadpool-run", "torchrun", "deepspeed", "accelerate"]
LAUNCHERS: tuple[str, ...] = ("deadpool-run", "torchrun", "deepspeed", "accelerate")

DEADPOOL_RUN = (sys.executable, "-m", "deadpool_ext.launcher.cli")
"""``deadpool-run`` as the tests start it: the console script's module under this interpreter."""

# The fields only deadpool-run has, with their flags (in the order the command line gets them).
_DEADPOOL_RUN_FLAGS: tuple[tuple[str, str], ...] = (
    ("spare_nodes", "--spare-nodes"), ("no_spare_policy", "--no-spare-policy"), ("job_id", "--job-id"),
    ("store_url", "--store-url"), ("hosts", "--hosts"), ("host_rank", "--host-rank"), ("host", "--host"),
    ("shm_root", "--shm-root"), ("timeline", "--timeline"), ("detect_timeout_s", "--detect-timeout-s"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A training job under one launcher. ``argv()`` is its command line, ``env()`` its environment."""

    script: str
    """The training script (a path), or with ``wrap`` the script the wrapper module runs."""
    args: tuple[str, ...] = ()
    """The script's own arguments, verbatim (steps, seed, model size, ...)."""
    config: str | None = None
    """The job's config file, passed to the script as ``config_flag CONFIG`` (after ``args``)."""
    config_flag: str = "--deepspeed_config"
    """The script's flag for ``config``: ``--deepspeed_config`` (pretrain_gpt.py), ``--deadpool-config``
    (pretrain_gpt_megatron.py)."""
    metrics: str | None = None
    """Where the script writes its losses (``--metrics-out``, last on the command line)."""
    launcher: Launcher = "deadpool-run"
    """``deadpool-run``, ``torchrun``, ``deepspeed`` or ``accelerate``."""
    wrap: str | None = None
    """A module that runs the script (``-m deadpool_ext.run SCRIPT ...``, the Lightning CPU shim)."""
    nnodes: int | None = 1
    """Nodes: deadpool-run's active nodes (``None``: no ``--nnodes``, as with ``--join``), torchrun's nodes."""
    nproc_per_node: int | None = None
    """Processes per node (``None``: deadpool-run's default, 1; torchrun, deepspeed: 1)."""
    port: int | None = None
    """torchrun's ``--master-port``, deepspeed's ``--master_port``, accelerate's ``--main_process_port`` (each
    needs one), deadpool-run's ``--store-port`` (optional)."""
    max_restarts: int = 0
    """torchrun's ``--max-restarts`` (torchrun only)."""
    # deadpool-run only: each passed only when set
    spare_nodes: int | None = None
    no_spare_policy: str | None = None
    job_id: str | None = None
    store_url: str | None = None
    hosts: int | None = None
    host_rank: int | None = None
    host: str | None = None
    join: str | None = None
    shm_root: str | None = None
    timeline: str | None = None
    detect_timeout_s: float | None = None
    launcher_flags: tuple[str, ...] = ()
    """Further launcher flags, verbatim, after the typed ones (``--progress-timeout-s 200``, accelerate's
    ``--config_file F``, ...)."""
    env_vars: Mapping[str, str] = field(default_factory=dict)
    """Added to the environment every job gets (``launch.base_env``): a fault injector's harness variables, a
    store token."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"Job: launcher={self.launcher!r}: must be one of {', '.join(LAUNCHERS)}")
        if self.launcher != "deadpool-run":
            set_only_there = [name for name, _ in _DEADPOOL_RUN_FLAGS if getattr(self, name) is not None]
            if self.join is not None:
                set_only_there.append("join")
            if set_only_there:
                raise ValueError(f"Job: {', '.join(set_only_there)} set with launcher={self.launcher!r}: only "
                                 f"deadpool-run has them (launcher='deadpool-run')")
            if self.port is None:
                raise ValueError(f"Job: launcher={self.launcher!r} needs port= (its rendezvous port: free_port())")
        if self.max_restarts and self.launcher != "torchrun":
            raise ValueError(f"Job: max_restarts={self.max_restarts} with launcher={self.launcher!r}: only "
                             f"torchrun restarts a job")
        if self.join is not None and self.nnodes is not None:
            raise ValueError(f"Job: join={self.join!r} with nnodes={self.nnodes}: a joining launcher takes the "
                             f"job's nodes from its store (nnodes=None)")
        if self.launcher in ("deepspeed", "accelerate") and self.nnodes not in (None, 1):
            raise ValueError(f"Job: nnodes={self.nnodes} with launcher={self.launcher!r}: one node only here")

    @property
    def ranks(self) -> int:
        """The world size the job starts with (spares not counted)."""
        return (self.nnodes or 1) * (self.nproc_per_node or 1)

    def replace(self, **changes: object) -> Job:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def script_argv(self) -> list[str]:
        """What follows the launcher's own flags: ``[-m WRAP] SCRIPT ARGS [CONFIG_FLAG CONFIG] [--metrics-out M]``."""
        out = ["-m", self.wrap] if self.wrap else []
        out += [self.script, *self.args]
        if self.config is not None:
            out += [self.config_flag, self.config]
        if self.metrics is not None:
            out += ["--metrics-out", self.metrics]
        return out

    def launcher_argv(self) -> list[str]:
        """The launcher and its flags, without the script."""
        if self.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc_per_node or 1}",
                    f"--nnodes={self.nnodes or 1}", f"--max-restarts={self.max_restarts}",
                    "--master-addr=127.0.0.1", f"--master-port={self.port}", "--monitor-interval=0.2",
                    *self.launcher_flags]
        bindir = os.path.dirname(sys.executable)
        if self.launcher == "deepspeed":
            return [os.path.join(bindir, "deepspeed"), "--num_gpus", str(self.nproc_per_node or 1), "--master_port",
                    str(self.port), *self.launcher_flags]
        if self.launcher == "accelerate":
            return [os.path.join(bindir, "accelerate"), "launch", "--main_process_port", str(self.port),
                    *self.launcher_flags]
        out = list(DEADPOOL_RUN)
        if self.join is not None:
            out += ["--join", self.join]
        if self.nnodes is not None:
            out += ["--nnodes", str(self.nnodes)]
        if self.nproc_per_node is not None:
            out += ["--nproc-per-node", str(self.nproc_per_node)]
        for name, flag in _DEADPOOL_RUN_FLAGS:
            value = getattr(self, name)
            if value is not None:
                out += [flag, str(value)]
        if self.port is not None:
            out += ["--store-port", str(self.port)]
        return out + list(self.launcher_flags)

    def argv(self) -> list[str]:
        """The whole command line."""
        return self.launcher_argv() + self.script_argv()

    def env(self) -> dict[str, str]:
        """The job's environment: this process's, with the test bed's settings (``base_env``) and ``env_vars``."""
        return base_env(dict(self.env_vars))


def deadpool_run(*flags: str) -> list[str]:
    """``deadpool-run FLAGS...`` verbatim: for the tests of its own command-line checks, whose flags are
    deliberately wrong (a :class:`Job` is for jobs that run)."""
    return [*DEADPOOL_RUN, *flags]


__all__ = ["DEADPOOL_RUN", "LAUNCHERS", "Job", "Launcher", "deadpool_run"]
