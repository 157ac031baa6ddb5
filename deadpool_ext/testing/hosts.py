"""Hosts on one machine: Linux network namespaces, each with its own address and its own /dev/shm.

The multi-host test bed (facts: ``../shared/notes/multihost.md``)::

    with HostBed(3) as bed:
        etcd = bed.start_etcd(token, members=3)       # a 3-member cluster on the bridge address
        p = bed.popen(0, Job(script=..., host=bed.addr(0), ...).argv())   # testing/jobs.py
        bed.cut(1); bed.heal(1)                        # a partition: the link down, processes alive
        bed.kill_host(2)                               # every process of host 2 SIGKILLed, its memory gone
        etcd.kill_member(0)

Layout of a bed with tag T (random, 4 hex digits): a bridge ``dpT`` in the root namespace with address
``10.A.B.254/24`` (a /24 no route of this machine uses), host i = namespace ``dpTh<i>`` with ``eth0`` at
``10.A.B.<i+1>`` (the veth's root end ``dpTv<i>`` on the bridge), ``lo`` up. Each host runs a holder process
(``sleep``) in a private mount namespace whose /dev/shm is a tmpfs of its own; every process started on the host
enters the holder's network and mount namespaces (``nsenter``), so they share that /dev/shm as the processes of
one machine do, and nothing of it is visible to another host. Only the bed's own addresses are used.

Teardown (``close``, also on an exception inside ``with``, and for a bed left by a killed run: a record per bed
under :data:`RECORDS` names its owner's pid, and a new bed sweeps the beds of dead owners) kills every process
in the namespaces, deletes them and the bridge, and stops etcd. Needs root, ``ip``, ``nsenter``, ``unshare``.
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

RECORDS = "/run/deadpool-hostbed"
START_DEADLINE_S = 20.0
_CMD_TIMEOUT_S = 20.0


class HostBedError(RuntimeError):
    pass


def missing_requirements() -> str | None:
    """Why a bed cannot be made here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns, mount)"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need the {tool!r} command"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and res.returncode != 0:
        raise HostBedError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    out = _run("ip", "-4", "-o", "addr", "show", check=False).stdout + _run("ip", "-4", "route", check=False).stdout
    nets = []
    for word in out.split():
        if "/" in word and word[0].isdigit():
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _subnets_in_use()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{secrets.randbelow(56) + 200}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise HostBedError("no free 10.200-255.x.0/24 subnet for the test bed")


def _ns_pids(ns: str) -> list[int]:
    res = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _kill_ns(ns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in namespace ``ns`` until none is left (a dying launcher may still fork)."""
    end = time.monotonic() + deadline_s
    while True:
        pids = _ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise HostBedError(f"processes {pids} of host namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def sweep_stale() -> list[str]:
    """Tear down beds whose owner process is gone (a run killed before its teardown); returns their tags."""
    swept: list[str] = []
    if not os.path.isdir(RECORDS):
        return swept
    for name in os.listdir(RECORDS):
        path = os.path.join(RECORDS, name)
        try:
            with open(path) as fh:
                rec = json.load(fh)
            owner, tag, hosts = int(rec["owner"]), str(rec["tag"]), int(rec["hosts"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if psutil.pid_exists(owner):
            continue
        _teardown_names(tag, hosts, [int(p) for p in rec.get("etcd_pids", [])])
        os.unlink(path)
        swept.append(tag)
    return swept


def _teardown_names(tag: str, hosts: int, extra_pids: Sequence[int] = ()) -> None:
    for pid in extra_pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    marker = f"etcd-{tag}-m"   # the bed's etcd members by their data directories (restarted ones included)
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or ()):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for i in range(hosts):
        ns = f"dp{tag}h{i}"
        if os.path.exists(f"/run/netns/{ns}"):
            try:
                _kill_ns(ns)
            finally:
                _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", f"dp{tag}v{i}", check=False)
    _run("ip", "link", "del", f"dp{tag}", check=False)


@dataclass
class EtcdCluster:
    """A real etcd cluster on the bed's bridge address, auth on with the job's token."""

    host: str
    client_ports: list[int]
    peer_ports: list[int]
    procs: list[subprocess.Popen[bytes] | None]
    commands: list[list[str]]
    logs: list[str]
    token: str

    @property
    def endpoints(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.client_ports]

    @property
    def store_url(self) -> str:
        """The cluster as a deadpool store URL (every member: clients fail over between them)."""
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def kill_member(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def restart_member(self, i: int) -> None:
        """Start member ``i`` again on its data directory (it rejoins the cluster)."""
        if self.procs[i] is not None:
            raise HostBedError(f"etcd member {i} is running")
        self.procs[i] = _start_member(self.commands[i], self.logs[i])

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill_member(i)


def _start_member(cmd: list[str], log_path: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # ETCD_* would override flags
    with open(log_path, "ab") as log_fh:
        return subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def etcd_healthy(endpoint: str) -> bool:
    """Whether the etcd member at ``endpoint`` (http://host:port) answers /health with true, within 1 s."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(endpoint + "/health", timeout=1.0) as resp:
            return b'"true"' in resp.read()
    except OSError:
        return False


@dataclass
class HostBed:
    """N hosts as network namespaces; see the module docstring. Use as a context manager."""

    n_hosts: int
    shm_size: str = "3g"
    workdir: str = "/tmp"
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    net: ipaddress.IPv4Network | None = None
    holders: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    etcd: EtcdCluster | None = None

    # -- names ------------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"dp{self.tag}h{i}"

    def addr(self, i: int) -> str:
        """Host ``i``'s own address (its eth0)."""
        assert self.net is not None
        return str(self.net.network_address + i + 1)

    @property
    def bridge_addr(self) -> str:
        assert self.net is not None
        return str(self.net.network_address + 254)

    @property
    def bridge(self) -> str:
        return f"dp{self.tag}"

    # -- life cycle -------------------------------------------------------------------------------
    def __enter__(self) -> HostBed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        why = missing_requirements()
        if why is not None:
            raise HostBedError(why)
        if not 1 <= self.n_hosts <= 200:
            raise HostBedError(f"n_hosts {self.n_hosts}: must be in 1..200")
        sweep_stale()
        os.makedirs(RECORDS, exist_ok=True)
        self.net = _free_subnet()
        self._write_record()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(self.n_hosts):
                ns, veth = self.ns(i), f"dp{self.tag}v{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "set", veth, "master", self.bridge, "up")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                self.boot(i)
        except BaseException:
            self.close()
            raise

    def boot(self, i: int) -> None:
        """Start host ``i``'s holder: a private mount namespace with a fresh, empty /dev/shm (a machine booting)."""
        if i in self.holders and self.holders[i].poll() is None:
            raise HostBedError(f"host {i} is up")
        script = f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && exec sleep 2147483647"
        holder = subprocess.Popen(["ip", "netns", "exec", self.ns(i), "unshare", "--mount", "--propagation",
                                   "private", "--", "sh", "-c", script], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:  # up once the holder is `sleep` in a mount namespace of its own
            try:
                if psutil.Process(holder.pid).name() == "sleep":
                    break
            except psutil.NoSuchProcess:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                raise HostBedError(f"host {i}: its holder did not start (exit {holder.poll()})")
            time.sleep(0.01)
        self.holders[i] = holder

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        if self.etcd is not None:
            self.etcd.stop()
        _teardown_names(self.tag, self.n_hosts)
        for p in [*self.procs, *self.holders.values()]:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.unlink(self._record_path())
        except FileNotFoundError:
            pass

    def _record_path(self) -> str:
        return os.path.join(RECORDS, f"{self.tag}.json")

    def _write_record(self) -> None:
        rec = {"owner": os.getpid(), "tag": self.tag, "hosts": self.n_hosts,
               "etcd_pids": [p.pid for p in (self.etcd.procs if self.etcd else []) if p is not None]}
        tmp = self._record_path() + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh)
        os.replace(tmp, self._record_path())

    # -- processes --------------------------------------------------------------------------------
    def host_command(self, i: int, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` run inside host ``i`` (its network and its /dev/shm), in ``cwd`` (default: this one)."""
        holder = self.holders.get(i)
        if holder is None or holder.poll() is not None:
            raise HostBedError(f"host {i} is down (killed and not booted again)")
        return ["nsenter", "-t", str(holder.pid), "-m", "-n", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, i: int, argv: Sequence[str], *, cwd: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` in a session of its own; torn down with the bed."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(self.host_command(i, argv, cwd), cwd=cwd, **kwargs)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.host_command(i, argv), capture_output=True, text=True, timeout=timeout_s)

    def pids(self, i: int) -> list[int]:
        """Every process of host ``i`` (its holder included)."""
        return _ns_pids(self.ns(i))

    # -- faults -----------------------------------------------------------------------------------
    def kill_host(self, i: int) -> int:
        """Host ``i`` lost: every process in it SIGKILLed at once (its launcher too), its /dev/shm gone with
        its holder. Returns how many processes were killed. ``boot(i)`` brings up a fresh machine there."""
        n = len(self.pids(i))
        _kill_ns(self.ns(i))
        holder = self.holders.pop(i, None)
        if holder is not None:
            holder.wait(10)
        return n

    def cut(self, i: int) -> None:
        """Partition host ``i``: its link down (connections time out, its processes keep running)."""
        _run("ip", "link", "set", f"dp{self.tag}v{i}", "down")

    def heal(self, i: int) -> None:
        _run("ip", "link", "set", f"dp{self.tag}v{i}", "up")

    # -- etcd -------------------------------------------------------------------------------------
    def start_etcd(self, token: str, members: int = 3, binary: str | None = None) -> EtcdCluster:
        """An etcd cluster of ``members`` on the bridge address (reachable from every host, cut off from a
        partitioned one), authentication on with ``token`` as root's password."""
        from ..store.etcd import bootstrap_etcd_auth

        binary = binary or os.environ.get("DEADPOOL_ETCD_BIN") or shutil.which("etcd")
        if not binary:
            raise HostBedError("the etcd binary was not found ($DEADPOOL_ETCD_BIN, PATH): apt-get install etcd-server")
        host = self.bridge_addr
        ports = _free_ports(host, 2 * members)
        client_ports, peer_ports = ports[:members], ports[members:]
        names = [f"m{i}" for i in range(members)]
        cluster = ",".join(f"{n}=http://{host}:{p}" for n, p in zip(names, peer_ports))
        cluster_token = f"dp{self.tag}-{secrets.token_hex(4)}"
        commands, logs = [], []
        for i, name in enumerate(names):
            data_dir = os.path.join(self.workdir, f"etcd-{self.tag}-{name}")
            client, peer = f"http://{host}:{client_ports[i]}", f"http://{host}:{peer_ports[i]}"
            commands.append([binary, "--name", name, "--data-dir", data_dir,
                             "--listen-client-urls", client, "--advertise-client-urls", client,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", cluster, "--initial-cluster-state", "new",
                             "--initial-cluster-token", cluster_token, "--heartbeat-interval", "100",
                             "--election-timeout", "1000", "--logger", "zap", "--log-level", "warn"])
            logs.append(os.path.join(self.workdir, f"etcd-{self.tag}-{name}.log"))
        procs: list[subprocess.Popen[bytes] | None] = [_start_member(c, lg) for c, lg in zip(commands, logs)]
        self.etcd = EtcdCluster(host, client_ports, peer_ports, procs, commands, logs, token)
        self._write_record()
        deadline = time.monotonic() + START_DEADLINE_S
        while not all(etcd_healthy(e) for e in self.etcd.endpoints):
            if time.monotonic() > deadline or any(p is not None and p.poll() is not None for p in procs):
                tails = []
                for lg in logs:
                    with open(lg, errors="replace") as fh:
                        tails.append(fh.read()[-800:])
                raise HostBedError(f"etcd cluster on {host} not healthy within {START_DEADLINE_S:g}s:\n"
                                   + "\n".join(tails))
            time.sleep(0.05)
        bootstrap_etcd_auth(self.etcd.endpoints[0], token, timeout_s=10.0)
        return self.etcd


def _free_ports(host: str, n: int) -> list[int]:
    import socket

    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(int(s.getsockname()[1]))
    finally:
        for s in socks:
            s.close()
    return ports
