"""The contract between a launcher and its workers: every environment variable, named once, parsed once.

A worker reads its launcher's variables in exactly one place, :func:`worker_env` (parsed on first use into a
frozen :class:`WorkerEnv`, then passed down as plain values); no other module of deadpool_ext reads them, and
a process never hands state to itself through ``os.environ``. ``deadpool-run`` writes its variables with
:meth:`HotSwapEnv.to_environ`, so writer and reader cannot drift apart.

Which source wins:

- hot-swap (``DEADPOOL_STORE`` set, i.e. started by deadpool-run): the launcher's variables; the generation
  and the worker's current rank come from the membership protocol (``rebuild.worker.Membership``), never from
  the environment;
- the job id: ``DEADPOOL_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``, else :func:`job_id_from` this
  user's secret key (:func:`deadpool_ext.memory.trust.user_key`) and ``MASTER_ADDR:MASTER_PORT``: stable across
  restarts and relaunches of the same launch, unknown to other users of the node (who could otherwise create
  the job's shared-memory directory before it does); the config's ``job_id`` beats all;
- timeouts come from the config section (``hot_swap.*``, ``recovery.*``), not from the environment.

No torch import: the launcher and the command-line tools use this module too.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..memory.trust import derive_id, user_key

# -- set by any launcher (torchrun, the deepspeed launcher, deadpool-run) ---------------------------------
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
LOCAL_SIZE = "LOCAL_SIZE"
"""The deepspeed launcher's name for the local world size (it sets no LOCAL_WORLD_SIZE)."""
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
GROUP_RANK = "GROUP_RANK"
"""torchrun's node rank; deadpool-run writes it with each generation's world (frameworks such as Lightning derive
a worker's global rank from it and the local rank)."""
MALLOC_ARENA_MAX = "MALLOC_ARENA_MAX"
"""glibc's heap arena limit; deadpool-run sets it for its workers (``--malloc-arena-max``) unless it is set."""
# torchrun only
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
RUN_ID = "TORCHELASTIC_RUN_ID"

# -- set by deadpool-run for each worker ------------------------------------------------------------------
STORE = "DEADPOOL_STORE"
"""URL of the job's coordination store (``dp://host:port`` or ``etcd://host:port``); its presence means hot-swap."""
STORE_TOKEN = "DEADPOOL_STORE_TOKEN"
"""The job's secret: a client without it cannot join (also read by deadpool-run itself for many hosts)."""
JOB_ID = "DEADPOOL_JOB_ID"
WORKER_ID = "DEADPOOL_WORKER_ID"
NODE = "DEADPOOL_NODE"
"""The worker's failure domain (a simulated node on one host)."""
ROLE = "DEADPOOL_ROLE"
"""``active`` or ``spare`` (a pre-started worker that waits for an assignment)."""
LAUNCHER_PID = "DEADPOOL_LAUNCHER_PID"
HEARTBEAT_S = "DEADPOOL_HEARTBEAT_S"
WATCH_S = "DEADPOOL_WATCH_S"
SHM_ROOT = "DEADPOOL_SHM_ROOT"
NO_SPARE_POLICY = "DEADPOOL_NO_SPARE_POLICY"
"""deadpool-run's --no-spare-policy (fail, wait, shrink): with shrink, restores may reshard (docs/elastic.md)."""
SPARE_SLOTS = "DEADPOOL_SPARE_SLOTS"
"""deadpool-run's --spare-slots: ``prepare`` (a waiting spare makes its snapshot slots) or ``at-restore``."""
PREEMPT_GRACE_S = "DEADPOOL_PREEMPT_GRACE_S"
"""deadpool-run's --preempt-grace-s, when given: the drain budget after a SIGTERM (else the job's
``deadpool.preemption.grace_s``: ``preempt/decide.py`` ``resolve_grace``)."""
TIMELINE = "DEADPOOL_TIMELINE"
"""JSON-lines file the workers append recovery events to (``deadpool-run --timeline``)."""

LOG_LEVEL = "DEADPOOL_LOG_LEVEL"
"""deadpool-run's own log level (INFO by default); workers take theirs from the config's ``log_level``."""

ROLES = ("active", "spare")
NO_SPARE_POLICIES = ("fail", "wait", "shrink")
SPARE_SLOT_MODES = ("prepare", "at-restore")


class LaunchEnvError(ValueError):
    """A launcher variable is malformed; the message names it and what is allowed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HotSwapEnv:
    """What deadpool-run hands each worker (every field one variable above)."""

    store_url: str
    token: str
    job_id: str
    worker_id: str
    node: str
    role: str
    launcher_pid: int
    heartbeat_s: float = 0.5
    watch_s: float = 0.5
    shm_root: str | None = None
    no_spare_policy: str | None = None
    """``--no-spare-policy`` when the launcher was given it, else None (the job's config then decides:
    :func:`deadpool_ext.launcher.keys.resolve_no_spare_policy`)."""
    spare_slots: str = "prepare"
    preempt_grace_s: float | None = None
    """``--preempt-grace-s`` when the launcher was given it, else None (the job's config then decides)."""

    def to_environ(self) -> dict[str, str]:
        env = {STORE: self.store_url, STORE_TOKEN: self.token, JOB_ID: self.job_id, WORKER_ID: self.worker_id,
               NODE: self.node, ROLE: self.role, LAUNCHER_PID: str(self.launcher_pid),
               HEARTBEAT_S: repr(self.heartbeat_s), WATCH_S: repr(self.watch_s), SPARE_SLOTS: self.spare_slots}
        if self.no_spare_policy is not None:
            env[NO_SPARE_POLICY] = self.no_spare_policy
        if self.shm_root:
            env[SHM_ROOT] = self.shm_root
        if self.preempt_grace_s is not None:
            env[PREEMPT_GRACE_S] = repr(float(self.preempt_grace_s))
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HotSwapEnv | None:
        url = environ.get(STORE)
        if not url:
            return None
        missing = [k for k in (STORE_TOKEN, JOB_ID, WORKER_ID, NODE) if not environ.get(k)]
        if missing:
            raise LaunchEnvError(f"{STORE} is set but {missing} are not: start workers with deadpool-run")
        role = environ.get(ROLE, "active")
        if role not in ROLES:
            raise LaunchEnvError(f"{ROLE}={role!r}: allowed {list(ROLES)}")
        policy = environ.get(NO_SPARE_POLICY) or None
        if policy is not None and policy not in NO_SPARE_POLICIES:
            raise LaunchEnvError(f"{NO_SPARE_POLICY}={policy!r}: allowed {list(NO_SPARE_POLICIES)}")
        slots = environ.get(SPARE_SLOTS, "prepare")
        if slots not in SPARE_SLOT_MODES:
            raise LaunchEnvError(f"{SPARE_SLOTS}={slots!r}: allowed {list(SPARE_SLOT_MODES)}")
        grace = _float(environ, PREEMPT_GRACE_S, 0.0) if environ.get(PREEMPT_GRACE_S) else None
        return cls(store_url=url, token=environ[STORE_TOKEN], job_id=environ[JOB_ID],
                   worker_id=environ[WORKER_ID], node=environ[NODE], role=role,
                   launcher_pid=_int(environ, LAUNCHER_PID, 0), heartbeat_s=_float(environ, HEARTBEAT_S, 0.5),
                   watch_s=_float(environ, WATCH_S, 0.5), shm_root=environ.get(SHM_ROOT) or None,
                   no_spare_policy=policy, spare_slots=slots, preempt_grace_s=grace)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """A worker's view of how it was launched, parsed once (:func:`worker_env`)."""

    rank: int | None
    """Global rank at start (under hot-swap the current rank comes from the assignment)."""
    world_size: int | None
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    """torchrun's restart attempt (the process group's store is prefixed by it: pytorch/pytorch#135712)."""
    max_restarts: int | None = None
    """torchrun's ``--max-restarts`` (None: not under torchrun)."""
    agent_store: bool = False
    """torchrun shares its agent's TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    run_id: str | None = None
    job_id: str | None = None
    timeline: str | None = None
    hot_swap: HotSwapEnv | None = None
    launcher_pid: int = 0
    """The process whose exit ends the job: deadpool-run's pid, else the worker's parent (torchrun's agent or
    the deepspeed launcher)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        hs = HotSwapEnv.from_environ(env)
        return cls(rank=_opt_int(env, RANK), world_size=_opt_int(env, WORLD_SIZE),
                   local_rank=_int(env, LOCAL_RANK, 0),
                   local_world_size=_int(env, LOCAL_WORLD_SIZE, _int(env, LOCAL_SIZE, 1)),
                   master_addr=env.get(MASTER_ADDR), master_port=_opt_int(env, MASTER_PORT),
                   restart_count=_int(env, RESTART_COUNT, 0), max_restarts=_opt_int(env, MAX_RESTARTS),
                   agent_store=env.get(USE_AGENT_STORE) == "True",
                   run_id=env.get(RUN_ID) or None, job_id=env.get(JOB_ID) or None,
                   timeline=env.get(TIMELINE) or None, hot_swap=hs,
                   launcher_pid=hs.launcher_pid if hs is not None and hs.launcher_pid else os.getppid())

    def missing_for_init(self) -> list[str]:
        """The variables ``init_process_group`` needs from a launcher that are not set."""
        return [name for name, value in ((RANK, self.rank), (WORLD_SIZE, self.world_size),
                                         (MASTER_ADDR, self.master_addr), (MASTER_PORT, self.master_port))
                if value is None]

    def default_job_id(self, key: bytes | None = None) -> str:
        """A name shared by every rank of one job on a node, stable across restarts of the job's workers: the
        launcher's id if it gives one, else :func:`job_id_from` ``key`` (default: this user's secret key,
        :func:`deadpool_ext.memory.trust.user_key`) and the master address. Without the key nobody can tell
        the name from what is public (the master address and port): a hash of those alone let another user
        of the node create the job's directory first."""
        for value in (self.job_id, self.run_id):
            if value and value != "none":
                return "".join(c if c.isalnum() or c in "_-" else "_" for c in value)[:64]
        addr = f"{self.master_addr or 'localhost'}:{self.master_port or 0}"
        return job_id_from(user_key() if key is None else key, addr)

    def node_name(self) -> str:
        """Failure-domain name of this process: the launcher's simulated node, else the host name."""
        return self.hot_swap.node if self.hot_swap is not None else os.uname().nodename


def job_id_from(secret_material: bytes | str, public: str = "") -> str:
    """A job id (``j`` + 24 hex digits, HMAC-SHA256 of ``public`` under ``secret_material``): the same for
    everyone holding the same secret and ``public``, unguessable without the secret. ``secret_material``: at
    least 16 bytes (a key, or a random token the job's ranks share through the launcher's store)."""
    raw = secret_material.encode() if isinstance(secret_material, str) else bytes(secret_material)
    if len(raw) < 16:
        raise ValueError(f"job_id_from: secret material must be at least 16 bytes, got {len(raw)}")
    return derive_id(raw, public)


_CURRENT: WorkerEnv | None = None  # process-wide: the environment a process started with, parsed once


def worker_env() -> WorkerEnv:
    """This process's :class:`WorkerEnv`, parsed from the environment on first use."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = WorkerEnv.from_environ()
    return _CURRENT


def reset_worker_env() -> None:
    """Forget the parsed environment (tests that change it within one process)."""
    global _CURRENT
    _CURRENT = None


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = _opt_int(env, key)
    return default if value is None else value


def _opt_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{key}={raw!r}: expected an integer") from None


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LaunchEnvError(f"{key}={raw!r}: expected a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise LaunchEnvError(f"{key}={raw!r}: expected a finite number of seconds > 0")
    return value
