"""Which host am I: one command line for every host, from a DeepSpeed-style hostfile or SLURM's environment.

Pure logic (no sockets, no processes): the launcher passes in what it knows about the machine it runs on.

- Hostfile (DeepSpeed's format): one ``HOST slots=N`` per line, ``#`` comments, blank lines ignored. The host's
  rank is its line's index among the hosts; ``slots`` is ``--nproc-per-node`` (the same on every host). A line
  names this machine when it equals its hostname (short or full) or one of its addresses.
- SLURM: ``SLURM_NNODES`` hosts, this one ``SLURM_NODEID``, the names in ``SLURM_STEP_NODELIST`` (falling back to
  ``SLURM_JOB_NODELIST``) in SLURM's compressed form (``gpu[01-03,07],login1``); the job id from
  ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` (a requeued job's run is ``slurm<ID>r<N>``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_HOSTS = 65536
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}$")


class HostListError(ValueError):
    pass


@dataclass(frozen=True)
class HostPlan:
    """What this launcher derived: the job's hosts in rank order, its own rank and name, processes per host."""

    hosts: list[str]
    rank: int
    slots: int | None
    source: str           # "hostfile PATH" or "SLURM job N", for the log line
    job_id: str | None = None

    @property
    def me(self) -> str:
        return self.hosts[self.rank]


def place_nodes(active: list[str], spares: list[str], hosts: int) -> dict[str, int]:
    """Which host runs each node: the active nodes round-robin from host 0, the spares continuing the round where
    the active nodes left it (node i on host ``i % hosts``, spare j on host ``(len(active) + j) % hosts``). With as
    many hosts as nodes and spares (``sbatch --nodes N+S``), each spare has a host of its own; with as many hosts as
    active nodes, spare j shares host j."""
    return {n: i % hosts for i, n in enumerate(active)} | {n: (len(active) + j) % hosts for j, n in enumerate(spares)}


def parse_hostfile(text: str, path: str = "hostfile") -> list[tuple[str, int]]:
    """``[(host, slots), ...]`` in file order; every malformed line is an error naming its number."""
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise HostListError(f"{path}:{n}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, slots_s = parts[0], parts[1][len("slots="):]
        if not _HOST_RE.match(host):
            raise HostListError(f"{path}:{n}: {host!r} is not a host name or address")
        if not slots_s.isdigit() or not 1 <= int(slots_s) <= 1024:
            raise HostListError(f"{path}:{n}: slots={slots_s!r}: must be an integer in 1..1024")
        if host in seen:
            raise HostListError(f"{path}:{n}: host {host} is listed twice")
        seen.add(host)
        out.append((host, int(slots_s)))
    if not out:
        raise HostListError(f"{path}: no hosts (expected lines of 'HOST slots=N')")
    if len(out) > MAX_HOSTS:
        raise HostListError(f"{path}: {len(out)} hosts, at most {MAX_HOSTS}")
    return out


def expand_nodelist(spec: str) -> list[str]:
    """SLURM's compressed node list (``a[1-3,07],b``, ranges keep their zero padding) as names, in order."""
    names: list[str] = []
    i, n = 0, len(spec)
    while i < n:
        j = i
        depth = 0
        while j < n and (spec[j] != "," or depth):
            depth += {"[": 1, "]": -1}.get(spec[j], 0)
            if depth < 0 or depth > 1:
                raise HostListError(f"node list {spec!r}: unbalanced or nested brackets")
            j += 1
        if depth:
            raise HostListError(f"node list {spec!r}: unbalanced brackets")
        names.extend(_expand_one(spec[i:j], spec))
        i = j + 1
        if len(names) > MAX_HOSTS:
            raise HostListError(f"node list {spec!r}: more than {MAX_HOSTS} hosts")
    if not names:
        raise HostListError(f"node list {spec!r}: no hosts")
    return names


def _expand_one(item: str, spec: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
    if m is None:
        if not item or "[" in item or "]" in item or not _HOST_RE.match(item):
            raise HostListError(f"node list {spec!r}: bad entry {item!r}")
        return [item]
    prefix, ranges, suffix = m.groups()
    out: list[str] = []
    for r in ranges.split(","):
        lo, sep, hi = r.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostListError(f"node list {spec!r}: bad range {r!r} in {item!r}")
        width = len(lo)
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > MAX_HOSTS:
            raise HostListError(f"node list {spec!r}: bad range {r!r} in {item!r}")
        out.extend(f"{prefix}{k:0{width}d}{suffix}" for k in range(a, b + 1))
    return out


def rank_in(hosts: list[str], local_names: Iterable[str], local_addresses: Iterable[str], what: str) -> int:
    """The index of the one entry naming this machine (a hostname or one of its addresses); an error if none or
    several do (two entries for one machine would make two launchers there)."""
    mine = {n.lower() for n in local_names if n} | {a for a in local_addresses if a}
    hits = [i for i, h in enumerate(hosts) if h.lower() in mine or h.lower().split(".", 1)[0] in mine]
    if not hits:
        raise HostListError(f"{what}: no entry names this machine (its names and addresses: "
                            f"{', '.join(sorted(mine)) or 'none'}); add it, or pass --host-rank and --host")
    if len(hits) > 1:
        raise HostListError(f"{what}: entries {', '.join(hosts[i] for i in hits)} all name this machine")
    return hits[0]


def from_hostfile(text: str, path: str, local_names: Iterable[str], local_addresses: Iterable[str]) -> HostPlan:
    entries = parse_hostfile(text, path)
    slots = {s for _, s in entries}
    if len(slots) != 1:
        raise HostListError(f"{path}: every host must have the same slots (--nproc-per-node); got "
                            f"{', '.join(f'{h} slots={s}' for h, s in entries)}")
    hosts = [h for h, _ in entries]
    return HostPlan(hosts, rank_in(hosts, local_names, local_addresses, f"hostfile {path}"), slots.pop(),
                    f"hostfile {path}")


def from_slurm(env: Mapping[str, str]) -> HostPlan:
    """The plan from SLURM's variables (``srun``/``sbatch`` set them on every host of the step)."""
    missing = [k for k in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID") if not env.get(k)]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        missing.append("SLURM_STEP_NODELIST")
    if missing:
        raise HostListError(f"--from-slurm: SLURM's environment lacks {', '.join(missing)} (run the launcher "
                            "under srun, one task per host)")
    for k in ("SLURM_NNODES", "SLURM_NODEID"):
        if not env[k].isdigit():
            raise HostListError(f"--from-slurm: {k}={env[k]!r} is not a non-negative integer")
    hosts = expand_nodelist(str(nodelist))
    n, rank = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    if n != len(hosts):
        raise HostListError(f"--from-slurm: SLURM_NNODES={n} but the node list {nodelist!r} names {len(hosts)} "
                            "hosts")
    if rank >= n:
        raise HostListError(f"--from-slurm: SLURM_NODEID={rank} is not below SLURM_NNODES={n}")
    restarts = env.get("SLURM_RESTART_COUNT") or "0"
    if not restarts.isdigit():
        raise HostListError(f"--from-slurm: SLURM_RESTART_COUNT={restarts!r} is not a non-negative integer")
    job = re.sub(r"[^A-Za-z0-9_-]", "-", env["SLURM_JOB_ID"])[:48]
    # a requeued job keeps its SLURM_JOB_ID: its store keys (generations, leases, assignments) must not be the
    # previous run's, so each run of it is a job of its own to the store; tier 3 is found by its directory
    job_id, source = f"slurm{job}", f"SLURM job {env['SLURM_JOB_ID']}"
    if int(restarts):
        job_id, source = f"{job_id}r{int(restarts)}", f"{source} (requeued {int(restarts)}x)"
    return HostPlan(hosts, rank, None, source, job_id=job_id)
