"""Typed configuration of the ``"deadpool"`` section of a DeepSpeed config.

Every component has its own dataclass; every field has a docstring-style comment; unknown keys and bad values
stop start-up with an error that names the full key path and what is allowed. This is deliberately strict:
a misspelt ``"replication_factr"`` that is silently ignored leaves a job unprotected, and users only find out
when a node dies.

Example::

    "deadpool": {
        "enabled": true,
        "snapshot": {"interval": 1},
        "replication": {"factor": 1}
    }
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SECTION = "deadpool"
MAX_SECONDS = 7 * 24 * 3600
"""Upper bound of every duration in the section (a week): a longer one is a typo, or an ``Infinity`` that would
keep memory or a wait forever (Python's own waits overflow not far above it)."""
MAX_CHUNK_MB = 4096
"""Upper bound of ``snapshot.chunk_mb`` (4 GiB): the worker copies one chunk at a time."""
MAX_STEPS = 10**9
"""Upper bound of every interval counted in optimizer steps: longer than any run (31 years at a step a second);
``1e30`` is a typo that would silently turn the feature off."""
MAX_NODES = 65536
"""The most nodes a job has (``deadpool-run --nnodes`` takes as many): ``replication.factor`` is at most one less,
since a rank's replicas go to other nodes (placement checks the job's real node count at start)."""
MAX_PROCS_PER_HOST = 1024
"""The most processes on one host (``deadpool-run --nproc-per-node``): ``local.simulate_nodes`` splits them."""
MAX_RING = 1024
"""Upper bound of ``differential.base_interval`` and ``replay_batch``: the ring holds base_interval - 1 differentials,
each about a quarter of the rank's state (fp32 Adam), in shared memory; 1024 is already ~256 x the state."""
MAX_KEEP = 1000
"""Upper bound of ``persist.keep_last``: each kept base is a whole checkpoint on storage."""
MAX_MB_S = 1 << 20
"""Upper bound of ``persist.max_mb_s`` (1 TiB/s, beyond any storage a host writes to)."""
MAX_PATH = 4096
"""Longest path or URL (Linux's PATH_MAX): ``local.shm_root``, ``persist.url``."""
_T = typing.TypeVar("_T", bound="DataclassInstance")


DEFAULT_KEY_ENV = "DEADPOOL_CHECKPOINT_KEY"
"""Where the checkpoint key is read from unless ``deadpool.key_env`` names another variable."""


class ConfigError(ValueError):
    """A bad ``deadpool`` config: the message names the key and the allowed values; ``key`` names it alone (the
    config key or command-line flag, when one is to blame), for records such as the timeline's ``refused`` event."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _fail(path: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"deadpool config: {path}: {msg}", key=path)


@dataclass(kw_only=True, slots=True)
class SnapshotConfig:
    """In-memory snapshot of each rank's whole training state (tier 1)."""

    interval: int = 1
    """Take a snapshot every ``interval`` optimizer steps (1 = every iteration, as DeadPool does)."""
    chunk_mb: int = 16
    """Copy granularity of the background worker, in MiB: small enough to interleave with compute, large
    enough that per-chunk overhead is negligible."""
    verify_on_restore: bool = True
    """Check every tensor's checksum before a snapshot is used. Turning this off is for benchmarks only."""
    background: bool = True
    """Copy in a background worker overlapped with the next iteration (the design). ``false`` copies inline
    in ``after_step``: a debugging aid and the baseline the benchmark compares against."""
    worker_priority: str = "normal"
    """CPU priority of the background snapshot worker thread (copy, checksums, replication, commit): ``normal``
    (as the training threads), ``idle`` (Linux ``SCHED_IDLE``: only cycles nothing else wants; nice 19 where
    unavailable), ``low`` (nice 19), or ``auto``: ``idle`` where this process can raise the worker back to normal
    (root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE`` >= 20), else ``normal``. A step that must wait for a lowered worker
    (the next optimizer step would overwrite what it copies) raises it to normal for the rest of that work; it
    lowers itself again at its next snapshot. Measured on the 2-core CI host (GPT small, 20 interleaved pairs):
    the step-time ratio 1.024 at ``auto`` against 1.035 at ``normal`` with 4 ranks, no difference with 2; but on a
    host whose every core trains the lowered worker's replication then lags: a rank killed 1.7 s into the next
    step found the previous snapshot still replicating, so the recovery fell back one more step (two steps
    redone instead of one), and such a worker can be blocked in that transfer (now abandoned after
    ``snapshot.manager.ABANDON_AFTER_S``). Hence ``normal`` by default; ``auto`` or ``idle`` suit hosts whose CPUs
    wait on accelerators."""
    derive_params: bool = True
    """Do not copy DeepSpeed's low-precision parameter buffers: after every step they are the fp32 masters cast
    to their dtype, so a restore rebuilds them the same way and checks the result against checksums taken at
    capture. Saves a quarter of the snapshot (fp32 ZeRO) in every tier-1 slot and tier-2 replica, and the time
    to copy, hash and replicate it. ZeRO 1-3 with parameters in host memory; other layouts capture them."""

    def __post_init__(self) -> None:
        _integer("interval", self.interval, 1, MAX_STEPS)
        _integer("chunk_mb", self.chunk_mb, 1, MAX_CHUNK_MB)
        if not isinstance(self.worker_priority, str) or self.worker_priority not in ("auto", "idle", "low", "normal"):
            _fail("worker_priority", f"must be one of auto, idle, low, normal; got {_show(self.worker_priority)}")


@dataclass(kw_only=True, slots=True)
class ReplicationConfig:
    """Copies of each rank's snapshot in other nodes' memory (tier 2)."""

    factor: int = 1
    """Number of peer replicas per rank, each on a different node than the rank itself. 0 disables tier 2."""
    double_buffer: bool = True
    """Keep two replica buffers per source so a complete replica exists while the next one streams in.
    Memory: 2 x (1 + factor) x state. ``false`` lowers it to (2 + factor) x state but a source lost while its
    replica is in transit (a kill mid-transfer) has no complete copy in peer memory."""
    timeout_s: float = 120.0
    """Deadline for one replica transfer; a transfer that misses it is reported and the version is not
    counted as replicated."""

    def __post_init__(self) -> None:
        _integer("factor", self.factor, 0, MAX_NODES - 1, why=" (replicas go to other nodes than the rank's)")
        _seconds("timeout_s", self.timeout_s)


@dataclass(kw_only=True, slots=True)
class LocalConfig:
    """Where tier-1 buffers live."""

    shm_root: str = "/dev/shm"
    """Directory of node-local shared memory (a tmpfs). Buffers are files here so they outlive a crashed
    worker and are found again by its replacement."""

    simulate_nodes: int = 0
    """Split the processes of each host into this many simulated nodes (failure domains), so tier-2 replicas
    and lost-node recovery can be exercised on one machine under torchrun. 0: one node per host. deadpool-run
    names nodes itself and ignores this."""

    keep_after_exit_s: float = 0.0
    """Keep the job's tier-1 memory this many seconds after its launcher exits, so that relaunching the same
    job (same job id: the same ``--master_port``/``MASTER_ADDR``, or ``DEADPOOL_JOB_ID``) within that time
    restores from memory. For launchers that end the whole job when a worker dies and do not restart it,
    such as DeepSpeed's ``deepspeed`` launcher. 0 (default): removed as soon as the job ends. The node agent
    holds the memory meanwhile, and removes it when the window passes with no relaunch."""

    def __post_init__(self) -> None:
        _integer("simulate_nodes", self.simulate_nodes, 0, MAX_PROCS_PER_HOST, why=" (at most one per process)")
        _seconds("keep_after_exit_s", self.keep_after_exit_s, zero_ok=True)
        if not isinstance(self.shm_root, str) or not self.shm_root or "\0" in self.shm_root \
                or len(self.shm_root) > MAX_PATH:
            _fail("shm_root", f"must be a directory path of at most {MAX_PATH} characters, got {_show(self.shm_root)}")


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """What a (re)starting worker does with snapshots it finds."""

    restore_on_start: bool = True
    """On start-up, look for this job's snapshots in tier 1 / tier 2 and resume from the newest version that
    every rank can restore. A hot-swap (a generation after the first under deadpool-run) restores whatever
    this says: a rebuilt engine has no other state to continue from."""
    timeout_s: float = 120.0
    """Deadline for the agreement and transfers of one restore."""

    def __post_init__(self) -> None:
        _seconds("timeout_s", self.timeout_s)


@dataclass(kw_only=True, slots=True)
class HotSwapConfig:
    """Runtime replacement of failed nodes by spares (needs the deadpool-run launcher)."""

    enabled: bool = True
    """Under deadpool-run, survive a failed node by rebuilding communicators in-process with a spare."""
    assignment_timeout_s: float = 120.0
    """How long a survivor waits for the launcher's next assignment after a collective error."""
    collective_timeout_s: float = 60.0
    """Timeout of training collectives: the backstop that turns a silently vanished peer (no TCP reset)
    into an error; crashed processes and fenced hung ones are seen at once."""

    teardown_timeout_s: float = 30.0
    """Deadline for destroying the old process groups on a survivor; past it the survivor leaves and is
    replaced like a failed node (never a silent hang)."""
    in_place: bool = True
    """DeepSpeed engines: survivors keep their engine, optimizer and scheduler objects; only the communicators
    beneath their process groups are replaced (``rebuild/swap.py``) and the state is restored in place, and the
    spare builds its engine locally before joining. ``false``: every rank rebuilds its engine through the
    script's ``set_rebuild`` factory (the older path). Megatron-Core jobs always rebuild."""
    spare_build_ahead: bool = True
    """With ``in_place``: a deadpool-run spare runs the script up to its engine (``deepspeed.initialize``, built alone
    for the ranks of the node it shadows) *before* any failure, then waits; assigned those ranks, it only joins the
    survivors' communicators and restores. Assigned other ranks, it starts again from the script's first line
    (logged). ``false`` (memory-tight spare hosts): the spare waits before its script and builds after the
    assignment (``rebuild/spare.py``, docs/hot-swap.md)."""
    release_memory: bool = True
    """After an in-place recovery, give the C heap's free memory back to the OS (glibc ``malloc_trim``), twice: right
    after the recovery (what the dead communicators' threads and the interrupted step's frames left) and once the
    redone step is complete (the interrupted step's autograd graph, held from C++, is freed only then). Measured
    (GPT small, 5 consecutive swaps, ``benchmarks/results/inplace_swap.md``): survivor RSS x1.02-1.04 of its level
    before the first failure with both and deadpool-run's 2 heap arenas, x1.05 with glibc's arena default, x1.08-1.13
    with the first trim only, x1.10-1.12 with none. Its price: the steps after each trim fault those pages in again
    (about 110,000 more page faults per survivor, ~0.1 s: ``docs/hot-swap.md``, "The first step after a swap").
    ``false`` where memory is plentiful and those steps matter more."""

    def __post_init__(self) -> None:
        _seconds("teardown_timeout_s", self.teardown_timeout_s)
        _seconds("assignment_timeout_s", self.assignment_timeout_s)
        _seconds("collective_timeout_s", self.collective_timeout_s)


@dataclass(kw_only=True, slots=True)
class DifferentialConfig:
    """TierCheck differential checkpoints in memory (tiers 1 and 2): a full base snapshot every
    ``base_interval`` steps, and between bases only what the optimizer consumed at each step (the rank's
    reduced, partitioned gradients plus the scalars of the step), from which the steps are replayed."""

    enabled: bool = False
    """Take differentials between in-memory bases instead of a full snapshot at every step."""
    base_interval: int = 10
    """Full in-memory snapshot every K steps; differentials cover the steps between two bases."""
    compression: str = "none"
    """``none`` (exact: replay is bit for bit the original training) or ``bf16`` (gradients rounded to
    bfloat16: half the size, replayed states differ from the original by the rounding of each gradient,
    relative error <= 2**-8 per element per step; never the default)."""
    replay_batch: int = 8
    """Differentials read and replayed per batch during recovery (bounds the memory replay needs)."""
    replay: str = "fused"
    """``fused``: multi-step, cache-blocked replay of each batch, parameters synced once at the end.
    ``stepwise``: one step at a time, parameters synced after each (what replaying through the engine's step
    does); same result, slower; kept as the benchmark's baseline."""

    def __post_init__(self) -> None:
        _integer("base_interval", self.base_interval, 2, MAX_RING,
                 why=" (a base every K steps, K - 1 differentials between, each held in shared memory)")
        _integer("replay_batch", self.replay_batch, 1, MAX_RING)
        if not isinstance(self.replay, str) or self.replay not in ("fused", "stepwise"):
            _fail("replay", f"must be one of fused, stepwise; got {_show(self.replay)}")
        if not isinstance(self.compression, str) or self.compression not in ("none", "bf16"):
            _fail("compression", f"must be one of none, bf16; got {_show(self.compression)}")


@dataclass(kw_only=True, slots=True)
class PersistConfig:
    """Tier 3: base checkpoints migrated in the background to persistent storage (any fsspec URL)."""

    url: str | None = None
    """Where base checkpoints go: a local or shared file-system path (default scheme) or an fsspec URL such
    as ``s3://bucket/run`` (needs s3fs). ``None``: tier 3 off. ``--save URL`` overrides it."""
    interval: int = 0
    """Persist a base every K optimizer steps (0: never). ``--save-interval K`` overrides it."""
    keep_last: int = 2
    """Complete bases kept in tier 3; older ones are deleted only once a newer one is complete and verified."""
    max_mb_s: float = 0.0
    """Upper bound on the background write rate in MiB/s (0: no fixed cap, only the adaptive throttle)."""
    adaptive: bool = True
    """Slow the background writer down while it measurably stretches the training step (the foreground never
    waits for tier 3)."""
    timeout_s: float = 1800.0
    """Deadline for one base to be written and published; a base that misses it is abandoned, never
    published."""
    when_busy: str = "skip"
    """What a base due while the previous one is still being written does: ``skip`` (default: training never
    waits for tier 3; the skip is logged and counted) or ``wait`` (the step waits, at most ``timeout_s``, so that
    every K-th step's base is written: for jobs that must keep a fixed checkpoint cadence)."""

    def __post_init__(self) -> None:
        if self.url is not None and (not isinstance(self.url, str) or "\0" in self.url or len(self.url) > MAX_PATH):
            _fail("url", f"must be a path or fsspec URL of at most {MAX_PATH} characters (or null: tier 3 off), got "
                  f"{_show(self.url)}")
        _integer("interval", self.interval, 0, MAX_STEPS)
        _integer("keep_last", self.keep_last, 1, MAX_KEEP)
        if not _finite(self.max_mb_s) or not 0 <= self.max_mb_s <= MAX_MB_S:
            _fail("max_mb_s", f"must be a finite number in 0..{MAX_MB_S} MiB/s (0: no fixed cap), got "
                  f"{_show(self.max_mb_s)}")
        _seconds("timeout_s", self.timeout_s)
        if not isinstance(self.when_busy, str) or self.when_busy not in ("skip", "wait"):
            _fail("when_busy", f"must be one of skip, wait; got {_show(self.when_busy)}")


MAX_CANARY_FACTOR = 1e6
"""Upper bound of ``canary.factor``: beyond it a bound catches nothing a finite check does not."""


@dataclass(kw_only=True, slots=True)
class CanaryConfig:
    """The numerical canary after every restore (docs/operations.md, "A numerical canary after every restore"):
    the first steps after a restore from memory or tier 3 are checked against bounds learned from the run before
    it (carried in each snapshot's header as JSON); a version that fails is quarantined in every tier and the next
    older one restored."""

    enabled: bool = True
    """Check the first steps after every restore; ``false``: no check, no bounds kept, snapshots and tier 3 go on
    right after a restore."""
    factor: float = 10.0
    """A checked step fails when its loss (or gradient norm) is not finite, or its magnitude exceeds ``factor``
    times the largest of the recent values the restored version carries. A larger factor misses subtler poison; a
    smaller one may take a genuine loss spike for a bad restore (which, replayed from the older version too,
    ends in the crash-loop guard)."""
    steps: int = 3
    """How many steps after a restore are checked. Snapshots and tier-3 bases are held during them (a poisoned
    version must not overwrite the older one it falls back to)."""
    window: int = 16
    """How many recent values of each (loss, gradient norm) the bounds keep."""
    max_rollbacks: int = 2
    """How many versions one job may quarantine; the next failed check stops the job with one line and exit
    status 6 (a crash-loop guard), as does a failed check with no older version in memory."""

    def __post_init__(self) -> None:
        if not _finite(self.factor) or not 1.0 < self.factor <= MAX_CANARY_FACTOR:
            _fail("factor", f"must be a number > 1 and <= {MAX_CANARY_FACTOR:g}, got {_show(self.factor)}")
        _integer("steps", self.steps, 1, 1000)
        _integer("window", self.window, 1, 1000)
        _integer("max_rollbacks", self.max_rollbacks, 0, 100)


DEFAULT_GRACE_S = 25.0
"""``preemption.grace_s`` (and ``deadpool-run --preempt-grace-s``) by default: 5 s short of the 30 s that Slurm
(``KillWait``) and Kubernetes (``terminationGracePeriodSeconds``) leave between SIGTERM and SIGKILL by default, so
that the processes exit and the launcher says its line before the SIGKILL."""


@dataclass(kw_only=True, slots=True)
class PreemptionConfig:
    """A SIGTERM (a preemption: Slurm, Kubernetes, a spot instance) drains the job instead of killing it: every rank
    stops at the next step boundary, the newest version is persisted to tier 3 (``persist.url``), signed and
    verified, and the job exits with status 75 (docs/operations.md)."""

    enabled: bool = True
    """Catch SIGTERM in the workers and drain; false: SIGTERM ends a worker at once, as without the extension."""
    grace_s: float = DEFAULT_GRACE_S
    """The budget from SIGTERM to the end of the job, in seconds: what is not persisted and verified within it is
    not published. ``deadpool-run --preempt-grace-s`` overrides it. Keep it below the orchestrator's grace period
    (Slurm ``KillWait``, Kubernetes ``terminationGracePeriodSeconds``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            _fail("enabled", f"must be true or false, got {_show(self.enabled)}")
        _seconds("grace_s", self.grace_s)


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """Stragglers (docs/operations.md, "Stragglers"): a node whose ranks work longer per step, outside collectives,
    than the other nodes' median by ``factor`` over ``window_s`` seconds is named; with ``action`` swap it is
    replaced by a spare in place. ``deadpool-run --straggler-action/-factor/-window`` win over these."""

    action: str = "report"
    """``report`` (name it: a WARNING line, the timeline's ``straggler`` event, the metrics), ``swap`` (also replace
    its node by a spare through the failed-node path; never with no spare left, at most once per window) or
    ``off``."""
    factor: float = 2.0
    """How many times the other nodes' median busy time per step a node's must reach to be named."""
    window_s: float = 30.0
    """The window the busy times are measured over, in seconds; a node is named at most once per window."""

    def __post_init__(self) -> None:
        from .launcher.straggler import ACTIONS, setting_error

        if not isinstance(self.action, str) or self.action not in ACTIONS:
            _fail("action", f"must be one of {', '.join(ACTIONS)}; got {_show(self.action)}")
        why = setting_error(None, self.factor, None)
        if why is not None:
            _fail("factor", why)
        _seconds("window_s", self.window_s)


NO_SPARE_POLICIES = ("fail", "wait", "shrink")


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """What happens when a node is lost and no spare is left (docs/elastic.md)."""

    no_spare_policy: str | None = None
    """``fail`` (stop the job), ``wait`` (for a spare, ``--spare-wait-s``) or ``shrink`` (continue on fewer
    data-parallel ranks, the state resharded from memory). Unset: ``deadpool-run --no-spare-policy`` decides
    (default ``fail``); set, it is what deadpool-run does unless its flag is given explicitly."""
    allow_batch_change: bool = False
    """A shrink keeps the global batch size by raising gradient accumulation; where that cannot be exact
    (the global batch is not a multiple of micro batch x the new data-parallel size) it is refused, unless this
    is true: then micro batch and accumulation stay and the global batch changes (logged)."""

    def __post_init__(self) -> None:
        if self.no_spare_policy is not None and self.no_spare_policy not in NO_SPARE_POLICIES:
            _fail("no_spare_policy",
                  f"must be one of {', '.join(NO_SPARE_POLICIES)}; got {_show(self.no_spare_policy)}")


@dataclass(kw_only=True, slots=True)
class DeadpoolConfig:
    """The whole ``"deadpool"`` section."""

    enabled: bool = True
    """Master switch; a present section with ``enabled: false`` leaves DeepSpeed exactly as it was."""
    job_id: str | None = None
    """Names this job's shared memory and store keys so that two jobs on a host never collide. Default: the
    launcher's run id (``DEADPOOL_JOB_ID``, ``TORCHELASTIC_RUN_ID``) or a hash of the master address and port."""
    log_level: str = "info"
    """Log level of the ``deadpool_ext`` logger: one of debug, info, warning, error."""
    key_env: str = DEFAULT_KEY_ENV
    """The environment variable that holds the checkpoint key (at least 16 bytes, the same on every rank and for
    whoever loads or exports): it signs tier-3 commit records and manifests and the snapshot blobs that cross the
    peer channel (``docs/security.md``). Unset or empty: no key, integrity checks only. The key itself never
    goes into the config (DeepSpeed prints its config); a variable named here other than the default must be
    set."""
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    hot_swap: HotSwapConfig = field(default_factory=HotSwapConfig)
    differential: DifferentialConfig = field(default_factory=DifferentialConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        if self.job_id is not None and not (isinstance(self.job_id, str)
                                            and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.job_id)):
            _fail("job_id", f"must be 1-64 characters of [A-Za-z0-9_-], got {_show(self.job_id)}")
        if not isinstance(self.log_level, str) or self.log_level not in ("debug", "info", "warning", "error"):
            _fail("log_level", f"must be one of debug, info, warning, error; got {_show(self.log_level)}")
        if not isinstance(self.key_env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", self.key_env):
            _fail("key_env", "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got "
                  + _show(self.key_env))
        if self.key_env != DEFAULT_KEY_ENV and not os.environ.get(self.key_env):
            _fail("key_env", f"names {self.key_env}, which is not set (or empty) in this process's environment; set "
                  f"it on every rank, or remove key_env to use {DEFAULT_KEY_ENV} (unset: no key)")
        if self.straggler.action == "swap" and not self.hot_swap.enabled:
            _fail("straggler.action", "swap replaces a slow node by a spare through the hot-swap, which "
                  "hot_swap.enabled false turns off (an eviction would end the job): use report, or enable it")
        if self.differential.enabled and self.snapshot.interval != 1:
            _fail("differential.enabled", "differentials chain consecutive steps: snapshot.interval must be 1 "
                  f"(it is {self.snapshot.interval}); use differential.base_interval for the base interval")

    @classmethod
    def from_dict(cls, data: Any) -> DeadpoolConfig:
        """The section from its parsed JSON (a dict); anything else, ``None`` included, is a :class:`ConfigError`:
        ``"deadpool": null`` is not a way to turn the extension off (``{"enabled": false}`` is)."""
        if data is None:
            _fail(SECTION, NULL_SECTION)
        return _build(cls, data, SECTION)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NULL_SECTION = ('is null; to turn the extension off write "deadpool": {"enabled": false}, or remove the section '
                "(no section: DeepSpeed without the extension)")

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


def _show(value: Any) -> str:
    """The value in an error message: short, and never an error itself (a 5000-digit integer, a deep list)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > _REPR.maxstring:
        return f"{_REPR.repr(value)} ({len(value)} characters)"
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"


def _finite(value: Any) -> bool:
    """A real number (not a bool), not NaN or +-Infinity. Integers are finite however large."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _integer(path: str, value: Any, low: int, high: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f">= {low} and <= {high}"
        _fail(path, f"must be an integer {bound}{why}, got {_show(value)}")


def _seconds(path: str, value: Any, *, zero_ok: bool = False) -> None:
    """A duration: a finite number of seconds > 0 (>= 0 with ``zero_ok``), at most :data:`MAX_SECONDS`."""
    if not _finite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS:
        _fail(path, f"must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, at most {MAX_SECONDS} "
              f"(a week), got {_show(value)}")


def _build(cls: type[_T], data: Any, path: str) -> _T:
    if not isinstance(data, dict):
        _fail(path, f"must be a JSON object, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            _fail(path, f"keys must be strings, got {_show(key)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = unknown[0] if re.fullmatch(r"[A-Za-z0-9_]{1,64}", unknown[0]) else _show(unknown[0])
        _fail(f"{path}.{key}", f"unknown key; allowed keys are {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}")
    try:
        obj = cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ names the bare field; prefix the section path so the user sees the full key.
        raise ConfigError(str(exc).replace("deadpool config: ", f"deadpool config: {path}.", 1),
                          key=f"{path}.{exc.key}" if exc.key else None) from None
    for name in kwargs:  # the backstop for a number field whose own check forgot NaN / Infinity
        value = getattr(obj, name)
        if isinstance(value, float) and not math.isfinite(value):
            _fail(f"{path}.{name}", f"must be a finite number, got {_show(value)}")
    return obj


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type, hint), value, path)  # a dataclass type: hints are types, not instances
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            _fail(path, f"must be true or false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"must be an integer, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, f"must be a number, got {_show(value)}")
        try:
            return float(value)  # NaN and +-Infinity pass here: the field's own check names what it allows
        except OverflowError:
            _fail(path, f"must be a finite number, got {_show(value)}")
    if hint is str:
        if not isinstance(value, str):
            _fail(path, f"must be a string, got {_show(value)}")
        return value
    return value


def split_deepspeed_config(
        config: str | os.PathLike[str] | dict[str, Any]) -> tuple[dict[str, Any], DeadpoolConfig | None]:
    """Load a DeepSpeed config (path or dict) and split off the ``deadpool`` section.

    Returns ``(deepspeed_config_without_section, DeadpoolConfig or None)``. The section is removed so that
    DeepSpeed never sees a key it does not know.
    """
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as fh:
                config = json.load(fh)
        except OSError as exc:
            raise ConfigError(f"DeepSpeed config {path}: cannot read it: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError: both ValueErrors
            raise ConfigError(f"DeepSpeed config {path}: not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config must be a JSON object, got {type(config).__name__}")
    ds_config = dict(config)
    if SECTION not in ds_config:
        return ds_config, None
    section = ds_config.pop(SECTION)
    if section is None:
        _fail(SECTION, NULL_SECTION)
    return ds_config, DeadpoolConfig.from_dict(section)
