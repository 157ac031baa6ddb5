"""deadpool-run's command line: the parser, and every flag checked before anything starts (one line per error)."""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import socket
import threading
from typing import Any, NoReturn

from ..memory.shm import SHM_ROOT
from ..store.base import parse_store_url
from .contract import MALLOC_ARENA_MAX
from .straggler import setting_error

MAX_NODES = 65536
MAX_PROCS_PER_NODE = 1024
MAX_WORKERS = 262144
"""Upper bound of (active + spare nodes) x processes per node: the launcher holds one record per worker."""
MAX_SECONDS = 7 * 24 * 3600
"""Upper bound of every duration flag (a week): beyond it is a typo or an ``inf`` that never fires."""
RESOLVE_TIMEOUT_S = 10.0
"""Deadline for resolving ``--host`` (a name lookup may hang on a broken resolver)."""
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DESCRIPTION = "deadpool-run: a torchrun-like launcher with pre-started spare nodes and runtime hot-swap."


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``deadpool-run: MESSAGE``), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


DEFAULT_MALLOC_ARENA_MAX = 2
"""Workers' glibc heap arenas (``--malloc-arena-max``). Measured (``benchmarks/results/inplace_swap.md``, GPT small,
5 consecutive in-place hot-swaps): survivor RSS x1.022-1.025 of its level before the first failure with 2 arenas,
x1.052 with glibc's default (one arena per thread that allocates, up to 8 per core)."""


def worker_arena_max(arena_max: int, environ: Any) -> str | None:
    """The ``MALLOC_ARENA_MAX`` the workers run with (the ``start`` event's): one already in ``environ``, else
    ``--malloc-arena-max`` (None: unset)."""
    return environ.get(MALLOC_ARENA_MAX) or (str(arena_max) if arena_max else None)


def malloc_env(arena_max: int, environ: Any, *, log: bool) -> dict[str, str]:
    """The workers' ``MALLOC_ARENA_MAX`` (``--malloc-arena-max``; one already in ``environ`` wins, 0 sets none);
    ``log``: say which (once, when the first worker starts, after every start-up check passed)."""
    import logging

    out = {} if not arena_max or MALLOC_ARENA_MAX in environ else {MALLOC_ARENA_MAX: str(arena_max)}
    if log and MALLOC_ARENA_MAX in environ:
        logging.getLogger("deadpool_ext.launcher").info("workers: MALLOC_ARENA_MAX=%s from the environment",
                                                        environ[MALLOC_ARENA_MAX])
    elif log and out:
        logging.getLogger("deadpool_ext.launcher").info(
            "workers: MALLOC_ARENA_MAX=%d (--malloc-arena-max: a hot-swap's new communicator threads would otherwise "
            "each take a heap arena, and survivors' memory grow with failures)", arena_max)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deadpool-run", description=DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=None,
                   help="active nodes (required, unless --join; with --hostfile or --from-slurm: the hosts less "
                        "--spare-nodes, one node per host)")
    p.add_argument("--join", default=None, metavar="NAME",
                   help="add this machine to a running job as node NAME (with the job's --store-url, --job-id and "
                        "DEADPOOL_STORE_TOKEN): a spare, or the node a shrunk job grows back to (docs/elastic.md)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default 1; a hostfile's slots)")
    p.add_argument("--spare-nodes", type=int, default=0, help="pre-started spare nodes")
    p.add_argument("--job-id", default=None, help="names shared memory and store keys (default: random)")
    p.add_argument("--host", default=None,
                   help="this host's address: the stores it serves listen there (default: loopback on one host; the "
                        "hostfile's or SLURM's name for this host)")
    p.add_argument("--store-url", default=None,
                   help="coordination store to use instead of the embedded one: etcd://HOST:PORT (many hosts), or "
                        "the leader's dp://HOST:PORT for a follower launcher. The token comes from "
                        "DEADPOOL_STORE_TOKEN")
    p.add_argument("--store-port", type=int, default=0,
                   help="port of the embedded store (leader); 0 = any free port. With --hostfile or --from-slurm "
                        "and no --store-url: host 0 serves it on this port and the other hosts connect to it there")
    p.add_argument("--hostfile", default=None,
                   help="DeepSpeed-style hostfile ('HOST slots=N' per line): --hosts, --host-rank, --host and "
                        "--nproc-per-node derived from it (the line naming this machine), one command for every host")
    p.add_argument("--from-slurm", action="store_true",
                   help="derive --hosts, --host-rank, --host and --job-id from SLURM's environment (SLURM_NNODES, "
                        "SLURM_NODEID, SLURM_STEP_NODELIST, SLURM_JOB_ID); run one launcher per host with srun")
    p.add_argument("--hosts", type=int, default=None, help="launchers in the job, one per host; node i runs on host "
                                                        "i %% hosts, spare j on host (nnodes + j) %% hosts")
    p.add_argument("--host-rank", type=int, default=None,
                   help="this launcher's index; 0 publishes the first assignment. On an etcd store every launcher "
                        "can take the coordinator role over (docs/multi-host.md)")
    p.add_argument("--leader-ttl-s", type=int, default=10,
                   help="etcd store: the lease of each launcher (its host's liveness and the coordinator role). A "
                        "lost coordinator is replaced within this time; a launcher cut off from the store for "
                        "longer than 80%% of it stops its workers and leaves")
    p.add_argument("--shm-root", default=SHM_ROOT)
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument("--watch-s", type=float, default=0.5,
                   help="longest single wait of a worker's heartbeat thread on the store for the launcher's notice "
                        "of a new generation (capped at --heartbeat-s). The notice itself arrives at once: the wait "
                        "blocks on the store and returns when the key appears")
    p.add_argument("--detect-timeout-s", type=float, default=3.0,
                   help="a worker whose heartbeat is older than this is declared hung and fenced")
    p.add_argument("--suspect-age-s", type=float, default=None,
                   help="once a live worker reported that a collective of its generation failed (a peer's sockets "
                        "closed: a lost host), a worker whose heartbeat has not been heard for this long is failed at "
                        "once instead of after --detect-timeout-s; a report alone never fails a worker whose "
                        "heartbeat is fresh. Default: 1.5 x --heartbeat-s (at most --detect-timeout-s); 0: off")
    p.add_argument("--store-outage-s", type=float, default=120.0,
                   help="etcd store: a host that cannot renew its lease pauses its workers (SIGSTOP) and resumes them "
                        "when the store answers again with the lease intact; past this many seconds unreachable it "
                        "stops them for good")
    p.add_argument("--progress-timeout-s", type=float, default=30.0,
                   help="a rank whose main thread stands still outside any collective while the others wait in one, "
                        "with no rank finishing a step for this long, is hung (alive but not training) and is fenced; "
                        "0 turns this detection off (the collective timeout remains)")
    p.add_argument("--no-spare-policy", choices=["fail", "wait", "shrink"], default=None,
                   help="a node lost with no spare left: fail (stop the job), wait (--spare-wait-s for a spare) or "
                        "shrink (continue on fewer data-parallel ranks, the state resharded from memory; "
                        "docs/elastic.md); default: the job's deadpool.elastic.no_spare_policy, else fail")
    p.add_argument("--spare-wait-s", type=float, default=60.0)
    p.add_argument("--repair-after-s", type=float, default=0.0,
                   help="with --no-spare-policy shrink: start a dropped node's processes again this long after the "
                        "shrink (a repaired machine; the job grows back to it); 0 (default): never")
    p.add_argument("--spare-slots", choices=["prepare", "at-restore"], default="prepare",
                   help="prepare (default): a waiting spare makes and pre-faults its two snapshot slots once their "
                        "size is known (two slots of the largest rank's size in /dev/shm per spare process while it "
                        "waits; its restore is that much faster); at-restore: made when it takes a node's place")
    p.add_argument("--preempt-grace-s", type=float, default=None,
                   help="the budget after a SIGTERM (a preemption): every rank stops at its next step boundary, the "
                        "step is persisted to tier 3 (persist.url / --save) and verified, and the job exits with "
                        "status 75 and a line saying which step is safe (docs/operations.md). Default: the job's "
                        "deadpool.preemption.grace_s (25 s); keep it below the orchestrator's grace period")
    p.add_argument("--straggler-action", default=None,
                   help="a node slower than the others' median (its ranks' time per step outside collectives, by "
                        "--straggler-factor over --straggler-window seconds): report (name it: log, timeline, "
                        "metrics), swap (also replace it by a spare in place, never with no spare left, at most once "
                        "per window) or off. Default: the job's deadpool.straggler.action, else report")
    p.add_argument("--straggler-factor", type=float, default=None,
                   help="how many times the other nodes' median a node's busy time per step must reach to be named "
                        "(> 1; default: deadpool.straggler.factor, else 2)")
    p.add_argument("--straggler-window", type=float, default=None, metavar="SECONDS",
                   help="the window busy times are measured over, and the least time between two evictions "
                        "(default: deadpool.straggler.window_s, else 30)")
    p.add_argument("--timeline", default=None, help="JSON lines of failures and recovery phases")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port: the goodput ledger (productive and lost seconds by "
                        "cause, recoveries, snapshots, spares; docs/operations.md); 0: any free port (logged). "
                        "Default: no metrics endpoint")
    p.add_argument("--metrics-addr", default=None,
                   help="the address the metrics endpoint listens on (default: --host, where the stores listen: "
                        "loopback on one host); a wildcard (0.0.0.0, ::) listens on every interface, only when "
                        "given here")
    p.add_argument("--malloc-arena-max", type=int, default=DEFAULT_MALLOC_ARENA_MAX,
                   help="MALLOC_ARENA_MAX for the workers (glibc heap arenas): every hot-swap starts new communicator "
                        "threads, each of which would get an arena of its own, so a survivor's memory grows with "
                        f"failures; 0 leaves glibc's default; a MALLOC_ARENA_MAX already in the environment wins "
                        f"(default {DEFAULT_MALLOC_ARENA_MAX})")
    p.add_argument("--keep-memory-on-failure", action="store_true",
                   help="do not drop a failed node's shared memory (a process crash on a healthy node)")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error at start-up (also DEADPOOL_LOG_LEVEL=DEBUG); by default it "
                        "is one line")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _resolve(host: str) -> list[tuple[int, tuple[Any, ...]]]:
    """``host``'s addresses (family, sockaddr), within :data:`RESOLVE_TIMEOUT_S`; OSError if there are none."""
    out: list[Any] = []

    def lookup() -> None:
        try:
            out.append([(i[0], i[4]) for i in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)])
        except (OSError, UnicodeError) as exc:  # gaierror is an OSError; a bad IDNA name a UnicodeError
            out.append(exc)

    t = threading.Thread(target=lookup, name="deadpool-run-resolve", daemon=True)
    t.start()
    t.join(RESOLVE_TIMEOUT_S)
    if not out:
        raise OSError(f"no answer from the resolver within {RESOLVE_TIMEOUT_S:g}s")
    if isinstance(out[0], Exception):
        raise OSError(getattr(out[0], "strerror", None) or str(out[0]))
    return list(out[0])


def _host_error(host: str, flag: str = "--host") -> str | None:
    """Why ``--host`` cannot serve the stores, or None: it must be one of this host's own addresses (binding a
    socket to it is the test), never a wildcard that listens on every interface."""
    wildcard = (f"{flag} {host!r}: a wildcard address listens on every interface; pass the address of the "
                "interface the stores should listen on (127.0.0.1, the default, when the job runs on one host)")
    if not host.strip():
        return wildcard
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return wildcard
    except ValueError:
        pass  # a host name: resolved below
    try:
        addresses = _resolve(host)
    except OSError as exc:
        return f"{flag} {host}: cannot resolve it: {exc}"
    last = "no address"
    for family, sockaddr in addresses:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        if ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]).is_unspecified:
            return wildcard
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0, *sockaddr[2:]))
            return None
        except OSError as exc:
            last = exc.strerror or str(exc)
    return (f"{flag} {host}: not an address of this host (binding to it fails: {last}); pass the address of one "
            "of this host's interfaces")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an address that listens on every interface (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _metrics_error(args: argparse.Namespace) -> str | None:
    """Why ``--metrics-port`` / ``--metrics-addr`` cannot serve, or None. The address defaults to ``--host``; a
    wildcard only when given (the launcher then warns that the endpoint is on every interface)."""
    if args.metrics_port is None:
        return "--metrics-addr needs --metrics-port PORT" if args.metrics_addr is not None else None
    if not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port {args.metrics_port}: must be an integer in 0..65535 (0: any free port)"
    if args.metrics_addr is None or is_wildcard(args.metrics_addr):
        return None
    return _host_error(args.metrics_addr, "--metrics-addr")


def _script_error(path: str) -> str | None:
    """Why the training script cannot run, or None: it must be a readable file that Python compiles."""
    if not os.path.exists(path):
        return f"script {path}: no such file"
    if os.path.isdir(path):
        return f"script {path}: is a directory, not a Python script"
    if not os.path.isfile(path):  # a FIFO or a device: opening it could block, running it makes no sense
        return f"script {path}: not a regular file"
    try:
        with open(path, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        return f"script {path}: cannot read it: {exc.strerror or exc}"
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"script {path}: not a runnable Python script: {exc.msg} (line {exc.lineno})"
    except ValueError as exc:  # null bytes
        return f"script {path}: not a runnable Python script: {exc}"
    return None


def _local_identity() -> tuple[list[str], list[str]]:
    """This machine's names and addresses, to find its line in a hostfile."""
    import psutil

    names = [socket.gethostname(), socket.getfqdn()]
    addresses = [a.address.split("%", 1)[0] for nic in psutil.net_if_addrs().values() for a in nic
                 if a.family in (socket.AF_INET, socket.AF_INET6)]
    return names, addresses


def apply_host_plan(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    environ: dict[str, str] | None = None) -> str | None:
    """``--hostfile`` / ``--from-slurm``: fill in the flags they derive (a flag also given must agree); then the
    defaults of the flags left unset. Returns the log line saying what was derived, or None."""
    from . import hostlist

    if args.hostfile and args.from_slurm:
        parser.error("--hostfile and --from-slurm: pass one of them")
    plan = None
    try:
        if args.hostfile:
            try:
                with open(args.hostfile) as fh:
                    text = fh.read(1 << 20)
            except OSError as exc:
                parser.error(f"--hostfile {args.hostfile}: cannot read it: {exc.strerror or exc}")
            plan = hostlist.from_hostfile(text, args.hostfile, *_local_identity())
        elif args.from_slurm:
            plan = hostlist.from_slurm(dict(os.environ) if environ is None else environ)
    except hostlist.HostListError as exc:
        parser.error(str(exc))
    if plan is not None:
        derived = {"hosts": len(plan.hosts), "host_rank": plan.rank, "host": plan.me}
        if plan.slots is not None:
            derived["nproc_per_node"] = plan.slots
        if plan.job_id is not None:
            derived["job_id"] = plan.job_id
        for dest, value in derived.items():
            given = getattr(args, dest)
            if given is None:
                setattr(args, dest, value)
            elif dest not in ("host", "job_id") and given != value:
                parser.error(f"--{dest.replace('_', '-')} {given}: {plan.source} says {value}; drop the flag")
        if not args.store_url and len(plan.hosts) > 1 and args.join is None:
            # one command line on every host: host 0 serves the embedded store on --store-port, the others find it
            # under host 0's name
            if not args.store_port:
                parser.error(f"{plan.source}: {len(plan.hosts)} hosts and no --store-url: pass --store-port PORT "
                             "(host 0 serves the job's store there) or --store-url etcd://HOST:PORT")
            if plan.rank > 0:
                args.store_url = f"dp://{plan.hosts[0]}:{args.store_port}"
        if args.nnodes is None and args.join is None:
            args.nnodes = len(plan.hosts) - (args.spare_nodes or 0)
            if args.nnodes < 1:
                parser.error(f"--spare-nodes {args.spare_nodes}: {plan.source} has {len(plan.hosts)} host(s), which "
                             "leaves no active node; pass fewer spares or --nnodes")
    for dest, default in (("hosts", 1), ("host_rank", 0), ("host", "127.0.0.1"), ("nproc_per_node", 1)):
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if plan is None:
        return None
    return (f"{plan.source}: host {plan.rank} of {len(plan.hosts)} ({plan.me}), --host {args.host}, "
            f"{args.nproc_per_node} process(es) per node")


def _check_join(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--join NAME``: the job's size and hosts are the running job's, so those flags are refused."""
    from .join import JOIN_RE

    if not JOIN_RE.fullmatch(args.join):
        parser.error(f"--join {args.join!r}: a node name of 1-63 characters of [A-Za-z0-9_-], the first a letter")
    given = [f for f, v in (("--nnodes", args.nnodes), ("--spare-nodes", args.spare_nodes or None),
                            ("--hostfile", args.hostfile), ("--from-slurm", args.from_slurm or None),
                            ("--repair-after-s", args.repair_after_s or None)) if v is not None]
    if given or args.hosts != 1 or args.host_rank != 0:
        parser.error(f"--join: {', '.join(given) or '--hosts/--host-rank'} belong to the job's own launchers; "
                     "drop them (a joining machine brings one node)")
    if not args.store_url or not args.job_id:
        parser.error("--join needs the running job's --store-url and --job-id (and DEADPOOL_STORE_TOKEN)")
    args.nnodes = 0


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag in range before anything starts; a bad one exits through ``parser.error`` (one line, code 2)."""
    args.host_plan = apply_host_plan(parser, args)
    for dest, value in vars(args).items():
        if isinstance(value, list) and dest != "script_args":  # argparse reads "--nnodes=--" as an empty list
            parser.error(f"--{dest.replace('_', '-')}: expected one value, got none")
    if args.join is not None:
        _check_join(parser, args)
    elif args.nnodes is None:
        parser.error("--nnodes is required (or --join NAME, to add this machine to a running job)")
    for flag, value, low, high in (("--nnodes", args.nnodes, 0 if args.join else 1, MAX_NODES),
                                   ("--nproc-per-node", args.nproc_per_node, 1, MAX_PROCS_PER_NODE),
                                   ("--spare-nodes", args.spare_nodes, 0, MAX_NODES),
                                   ("--hosts", args.hosts, 1, MAX_NODES),
                                   ("--store-port", args.store_port, 0, 65535),
                                   ("--leader-ttl-s", args.leader_ttl_s, 2, 3600),
                                   ("--malloc-arena-max", args.malloc_arena_max, 0, 1024)):
        if not low <= value <= high:
            parser.error(f"{flag} {value}: must be an integer in {low}..{high}")
    workers = (args.nnodes + args.spare_nodes) * args.nproc_per_node
    if workers > MAX_WORKERS:
        parser.error(f"--nnodes {args.nnodes} + --spare-nodes {args.spare_nodes} nodes of --nproc-per-node "
                     f"{args.nproc_per_node}: {workers} workers, at most {MAX_WORKERS}")
    if not 0 <= args.host_rank < args.hosts:
        parser.error(f"--host-rank {args.host_rank}: must be in 0..{args.hosts - 1} (--hosts {args.hosts})")
    for name in ("heartbeat_s", "watch_s", "detect_timeout_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds (finite, at most "
                         f"{MAX_SECONDS}), got {value}")
    if not (math.isfinite(args.store_outage_s) and 1 <= args.store_outage_s <= MAX_SECONDS):
        parser.error(f"--store-outage-s {args.store_outage_s}: must be a finite number of seconds in "
                     f"1..{MAX_SECONDS}")
    if not (math.isfinite(args.progress_timeout_s) and 0 <= args.progress_timeout_s <= MAX_SECONDS):
        parser.error(f"--progress-timeout-s {args.progress_timeout_s}: must be a finite number of seconds in "
                     f"0..{MAX_SECONDS} (0: off)")
    if 0 < args.progress_timeout_s <= args.heartbeat_s:
        parser.error(f"--progress-timeout-s ({args.progress_timeout_s}) must be longer than --heartbeat-s "
                     f"({args.heartbeat_s}), or 0 (off)")
    if args.preempt_grace_s is not None and not (math.isfinite(args.preempt_grace_s)
                                                 and 0 < args.preempt_grace_s <= MAX_SECONDS):
        parser.error(f"--preempt-grace-s {args.preempt_grace_s}: must be a finite number of seconds in "
                     f"(0, {MAX_SECONDS}]")
    for flag, value, why in (
            ("--straggler-action", args.straggler_action, setting_error(args.straggler_action, None, None)),
            ("--straggler-factor", args.straggler_factor, setting_error(None, args.straggler_factor, None)),
            ("--straggler-window", args.straggler_window, setting_error(None, None, args.straggler_window))):
        if why is not None:
            parser.error(f"{flag} {value}: {why.split(', got ')[0]}")
    if args.detect_timeout_s <= args.heartbeat_s:
        parser.error(f"--detect-timeout-s ({args.detect_timeout_s}) must be longer than --heartbeat-s "
                     f"({args.heartbeat_s}): a healthy worker would be declared hung between two heartbeats")
    if args.suspect_age_s is None:
        args.suspect_age_s = min(1.5 * args.heartbeat_s, args.detect_timeout_s)
    elif not (math.isfinite(args.suspect_age_s)
              and (args.suspect_age_s == 0 or args.heartbeat_s < args.suspect_age_s <= args.detect_timeout_s)):
        parser.error(f"--suspect-age-s {args.suspect_age_s}: must be a number of seconds longer than --heartbeat-s "
                     f"({args.heartbeat_s}) and at most --detect-timeout-s ({args.detect_timeout_s}), or 0 (off)")
    if not (math.isfinite(args.repair_after_s) and 0 <= args.repair_after_s <= MAX_SECONDS):
        parser.error(f"--repair-after-s {args.repair_after_s}: must be a finite number of seconds in 0..{MAX_SECONDS}")
    if args.repair_after_s and args.no_spare_policy not in (None, "shrink"):
        parser.error("--repair-after-s needs --no-spare-policy shrink (a repaired node grows a shrunk job back)")
    if not (math.isfinite(args.spare_wait_s) and 0 <= args.spare_wait_s <= MAX_SECONDS):
        parser.error(f"--spare-wait-s {args.spare_wait_s}: must be a finite number of seconds in 0..{MAX_SECONDS}")
    if args.job_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", args.job_id):
        parser.error(f"--job-id {args.job_id!r}: must be 1-64 characters of [A-Za-z0-9_-], the first a letter or "
                     "digit (it names shared memory and store keys)")
    if not args.shm_root:
        parser.error("--shm-root '': must be a directory path")
    if args.store_url is not None:
        try:
            parse_store_url(args.store_url)
        except ValueError as exc:
            parser.error(f"--store-url {args.store_url!r}: {exc}")
    host_error = _host_error(args.host)
    if host_error is not None:
        parser.error(host_error)
    metrics_error = _metrics_error(args)
    if metrics_error is not None:
        parser.error(metrics_error)
    script_error = _script_error(args.script)
    if script_error is not None:
        parser.error(script_error)

