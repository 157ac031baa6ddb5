"""Pytest fixtures that run a real etcd (Debian's etcd-server) on loopback for the coordination store tests.

Import the fixture into a test module (``from tests.store_fixtures import etcd_server``). The etcd
binary is required, not optional: CI installs it, so a missing binary FAILS with the install hint
rather than silently skipping the etcd half of the contract.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from deadpool_ext.store.etcd import bootstrap_etcd_auth
from deadpool_ext.testing.hosts import etcd_healthy

__all__ = ["EtcdEndpoint", "etcd_server", "etcd_command", "start_etcd", "stop_etcd", "free_port"]

START_DEADLINE_S = 20.0


class EtcdEndpoint(NamedTuple):
    """What the fixture yields; unpacks as ``(url, token)``."""

    url: str     # http://127.0.0.1:PORT (the gateway endpoint)
    token: str   # password of etcd user root, i.e. the job token

    @property
    def store_url(self) -> str:
        """The same endpoint as a `deadpool_ext.store.connect` URL."""
        return "etcd://" + self.url.removeprefix("http://")


def free_port() -> int:
    """A loopback port nobody listens on right now (racy by nature; `start_etcd` retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str:
    path = os.environ.get("DEADPOOL_ETCD_BIN") or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("the etcd binary was not found (looked at $DEADPOOL_ETCD_BIN and PATH); the etcd store tests "
                    "need it: `sudo apt-get install etcd-server` (CI installs it)", pytrace=False)
    return path


def etcd_command(binary: str, data_dir: str, client_port: int, peer_port: int,
                 name: str = "deadpool-test") -> list[str]:
    """A single-member etcd listening on 127.0.0.1 only (clients and peers), with its data in `data_dir`."""
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [binary, "--name", name, "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}", "--initial-cluster-state", "new",
            "--initial-cluster-token", f"{name}-{secrets.token_hex(4)}",
            "--logger", "zap", "--log-level", "warn"]


def stop_etcd(proc: subprocess.Popen[bytes]) -> None:
    """Terminate etcd and everything in its process group (it was started in its own session)."""
    if proc.poll() is None:
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    else:
        try:  # the leader exited; reap any stragglers left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_etcd(workdir: str, attempts: int = 3) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """Start etcd under `workdir`, wait for /health; returns (process, http endpoint, command line)."""
    binary = etcd_binary()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # ETCD_* would override flags
    problems = []
    for attempt in range(attempts):
        client_port, peer_port = free_port(), free_port()
        data_dir = os.path.join(workdir, f"data{attempt}")
        log_path = os.path.join(workdir, f"etcd{attempt}.log")
        cmd = etcd_command(binary, data_dir, client_port, peer_port)
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        url = f"http://127.0.0.1:{client_port}"
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and proc.poll() is None:
            if etcd_healthy(url):
                return proc, url, cmd
            time.sleep(0.05)
        stop_etcd(proc)
        with open(log_path, errors="replace") as fh:
            tail = fh.read()[-2000:]
        how = "no healthy /health" if proc.returncode in (None, -signal.SIGTERM) else f"exit {proc.returncode}"
        problems.append(f"attempt {attempt + 1}: {how} within {START_DEADLINE_S:g}s; command: {' '.join(cmd)}\n"
                        f"log tail:\n{tail}")
    pytest.fail("etcd did not become healthy on 127.0.0.1:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdEndpoint]:
    """A throwaway etcd on loopback with auth enabled; yields ``EtcdEndpoint(url, token)``."""
    workdir = str(tmp_path_factory.mktemp("etcd"))
    proc, url, _ = start_etcd(workdir)
    try:
        token = secrets.token_urlsafe(24)
        bootstrap_etcd_auth(url, token, timeout_s=10.0)
        yield EtcdEndpoint(url, token)
    finally:
        stop_etcd(proc)
