"""One contract, two backends: every `CoordinationStore` must behave the same (embedded in-process; etcd real).

etcd comes from `tests.store_fixtures.etcd_server` (a real etcd-server on loopback with auth on).
"""
from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from deadpool_ext.store import (
    CoordinationStore,
    EmbeddedStoreServer,
    StoreAuthError,
    StoreError,
    StoreTimeout,
    bootstrap_etcd_auth,
    connect,
)
from tests.store_fixtures import etcd_server, free_port  # noqa: F401  (etcd_server is a fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def embedded_server() -> Iterator[tuple[str, str]]:
    token = secrets.token_urlsafe(16)
    with EmbeddedStoreServer(token=token) as server:
        yield server.url, token


class Backend:
    """Opens stores for one test on one backend and closes them afterwards."""

    def __init__(self, name: str, url: str, token: str) -> None:
        self.name, self.url, self.token = name, url, token
        self.namespace = f"job-{uuid.uuid4().hex[:8]}"
        self._opened: list[CoordinationStore] = []

    def open(self, namespace: str | None = None, token: str | None = None, timeout_s: float = 5.0) -> CoordinationStore:
        store = connect(self.url, self.token if token is None else token, namespace or self.namespace, timeout_s)
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        for store in self._opened:
            store.close()


@pytest.fixture(params=["embedded", "etcd"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "embedded":
        url, token = request.getfixturevalue("embedded_server")
    else:
        endpoint = request.getfixturevalue("etcd_server")
        url, token = endpoint.store_url, endpoint.token
    b = Backend(request.param, url, token)
    yield b
    b.close_all()


@pytest.fixture
def store(backend: Backend) -> CoordinationStore:
    return backend.open()


@pytest.fixture
def store_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that sees "deadpool_ext" records even if another test set propagate=False on that logger."""
    logger = logging.getLogger("deadpool_ext")
    attach = not logger.propagate
    if attach:
        logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="deadpool_ext")
    yield caplog
    if attach:
        logger.removeHandler(caplog.handler)


class TestStoreContract:
    def test_set_get_overwrite_and_missing(self, store: CoordinationStore) -> None:
        assert store.get("nope") is None
        store.set("a", b"\x00\xffbinary")
        assert store.get("a") == b"\x00\xffbinary"
        store.set("a", b"")
        assert store.get("a") == b""
        store.set_json("cfg", {"rank": 3, "spares": [7, 8]})
        assert store.get_json("cfg") == {"rank": 3, "spares": [7, 8]}
        assert store.get_json("missing") is None

    def test_bad_arguments_are_clear_errors(self, store: CoordinationStore) -> None:
        with pytest.raises(TypeError, match="bytes"):
            store.set("k", "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="non-empty str"):
            store.get("")
        with pytest.raises(ValueError, match="positive finite"):
            store.wait(["k"], 0)
        with pytest.raises(ValueError, match="positive finite"):
            store.wait(["k"], float("inf"))
        store.set("text", b"not-a-number")
        with pytest.raises(StoreError, match="not an integer counter"):
            store.add("text", 1)

    def test_add_is_atomic_under_threads(self, backend: Backend) -> None:
        stores = [backend.open() for _ in range(2)]   # two clients, two threads each
        errors: list[BaseException] = []

        def bump(s: CoordinationStore) -> None:
            try:
                for _ in range(50):
                    s.add("counter", 1)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=bump, args=(stores[i % 2],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and not any(t.is_alive() for t in threads)
        assert stores[0].get("counter") == b"200"
        assert stores[1].add("counter", -201) == -1
        assert stores[0].add("fresh", 5) == 5

    def test_compare_set(self, store: CoordinationStore) -> None:
        assert store.compare_set("leader", None, b"r0") is True
        assert store.compare_set("leader", None, b"r1") is False
        assert store.compare_set("leader", b"r9", b"r1") is False
        assert store.get("leader") == b"r0"
        assert store.compare_set("leader", b"r0", b"r1") is True
        assert store.get("leader") == b"r1"
        assert store.compare_set("absent", b"x", b"y") is False
        assert store.get("absent") is None

    def test_compare_set_race_has_one_winner(self, store: CoordinationStore) -> None:
        results: list[bool] = []
        lock = threading.Lock()

        def claim(i: int) -> None:
            won = store.compare_set("spare/7", None, f"rank{i}".encode())
            with lock:
                results.append(won)
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(results) == [False] * 5 + [True]

    def test_delete(self, store: CoordinationStore) -> None:
        store.set("gone", b"1")
        assert store.delete("gone") is True
        assert store.get("gone") is None
        assert store.delete("gone") is False

    def test_list_by_prefix(self, store: CoordinationStore) -> None:
        store.set("alive/0", b"a")
        store.set("alive/1", b"b")
        store.set("alive2", b"c")
        store.set("dead/3", b"d")
        assert store.list("alive/") == {"alive/0": b"a", "alive/1": b"b"}
        assert store.list() == {"alive/0": b"a", "alive/1": b"b", "alive2": b"c", "dead/3": b"d"}
        assert store.list("zzz") == {}

    def test_namespaces_isolate_jobs(self, backend: Backend) -> None:
        job_a, job_b = backend.open(namespace=backend.namespace + "a"), backend.open(namespace=backend.namespace + "ab")
        job_a.set("k", b"A")
        assert job_b.get("k") is None
        assert job_b.add("k", 1) == 1
        assert job_a.get("k") == b"A"
        assert job_a.list() == {"k": b"A"} and job_b.list() == {"k": b"1"}

    def test_wait_returns_when_keys_appear_later(self, backend: Backend, store: CoordinationStore) -> None:
        other = backend.open()

        def later() -> None:
            time.sleep(0.3)
            other.set("ready/0", b"x")
            store.set("ready/1", b"y")   # same client while its other connection waits: must not block
        t = threading.Thread(target=later)
        start = time.monotonic()
        t.start()
        got = store.wait(["ready/0", "ready/1"], timeout_s=10)
        t.join(5)
        assert got == {"ready/0": b"x", "ready/1": b"y"}
        assert 0.25 < time.monotonic() - start < 5

    def test_wait_timeout_names_missing_keys(self, store: CoordinationStore) -> None:
        store.set("here", b"1")
        start = time.monotonic()
        with pytest.raises(StoreTimeout) as info:
            store.wait(["here", "never/1"], timeout_s=0.5)
        elapsed = time.monotonic() - start
        assert 0.45 <= elapsed < 2.0
        assert info.value.missing == ["never/1"] and "never/1" in str(info.value) and "0.5s" in str(info.value)
        assert isinstance(info.value, TimeoutError)

    def test_wrong_token_is_refused_and_logged(self, backend: Backend, store_log: pytest.LogCaptureFixture) -> None:
        bad = "not-the-" + secrets.token_hex(4)
        with pytest.raises(StoreAuthError, match="wrong token"):
            backend.open(token=bad)
        warnings = [r.getMessage() for r in store_log.records if r.levelno == logging.WARNING]
        expect = "127.0.0.1:" if backend.name == "embedded" else backend.url.removeprefix("etcd://")
        assert any("wrong token" in m and expect in m for m in warnings) and not any(  # log-interface: the audit
            bad in m or backend.token in m for m in store_log.messages), warnings  # line names where, never a token

    def test_dead_address_fails_fast(self, backend: Backend) -> None:
        scheme = backend.url.split("://")[0]
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"127.0.0.1:{(port := free_port())}"):
            connect(f"{scheme}://127.0.0.1:{port}", backend.token, "job", timeout_s=2.0)
        assert time.monotonic() - start < 2.5


def test_unknown_scheme_and_empty_token_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"'redis'.*dp://host:port, etcd://host:port"):
        connect("redis://127.0.0.1:6379", "t", "job", 1.0)
    with pytest.raises(ValueError, match="token"):
        connect("dp://127.0.0.1:1234", "", "job", 1.0)
    with pytest.raises(ValueError, match="namespace"):
        connect("dp://127.0.0.1:1234", "t", "bad/ns", 1.0)
    with pytest.raises(ValueError, match="host:port"):
        connect("dp://127.0.0.1", "t", "job", 1.0)


def test_embedded_refuses_all_interfaces_without_flag() -> None:
    for host in ("0.0.0.0", "", "::"):
        with pytest.raises(ValueError, match="allow_all_interfaces"):
            EmbeddedStoreServer(host=host, token="t")
    EmbeddedStoreServer(host="0.0.0.0", token="t", allow_all_interfaces=True)  # explicit opt-in: accepted (not started)
    with pytest.raises(ValueError, match="token"):
        EmbeddedStoreServer(token="")
    with EmbeddedStoreServer(token="t") as server:
        assert server.address[0] == "127.0.0.1" and server.address[1] > 0


def test_embedded_server_stop_surfaces_as_store_error() -> None:
    server = EmbeddedStoreServer(token="tok").start()
    store = connect(server.url, "tok", "job", timeout_s=5.0)
    waiter_error: list[BaseException] = []

    def waiter() -> None:
        try:
            store.wait(["never"], timeout_s=20)
        except BaseException as exc:  # noqa: BLE001 - checked below
            waiter_error.append(exc)
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    server.stop()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - start < 3
    assert isinstance(waiter_error[0], StoreError) and not isinstance(waiter_error[0], StoreTimeout)
    with pytest.raises(StoreError, match=server.url.removeprefix("dp://")):
        store.get("x")
    store.close()


def test_embedded_survives_garbage_and_silent_peers(store_log: pytest.LogCaptureFixture) -> None:
    with EmbeddedStoreServer(token="tok", auth_timeout_s=0.5) as server:
        host, port = server.address
        with socket.create_connection((host, port), timeout=2) as raw:
            raw.recv(4096)                                    # the challenge
            raw.sendall(struct.pack(">I", 1 << 30) + b"xx")   # absurd frame size before auth
            assert raw.recv(4096) == b""                      # dropped
        with socket.create_connection((host, port), timeout=3) as silent:
            silent.recv(4096)                                 # ...and never answers the challenge
            start = time.monotonic()
            assert silent.recv(4096) == b""                   # closed after auth_timeout_s, not held forever
            assert time.monotonic() - start < 2.5
        with connect(server.url, "tok", "job", timeout_s=2.0) as store:
            store.set("still", b"ok")
            assert store.get("still") == b"ok"
        reasons = [reason for _, reason in server.refusals]
    assert len(reasons) == 2 and all(r.startswith("bad handshake") for r in reasons), reasons  # garbage, silence


def test_etcd_bootstrap_is_idempotent_and_checks_token(etcd_server) -> None:  # noqa: F811
    assert bootstrap_etcd_auth(etcd_server.url, etcd_server.token, timeout_s=5.0) is False
    with pytest.raises(StoreAuthError, match="wrong token"):
        bootstrap_etcd_auth(etcd_server.url, "other-token", timeout_s=5.0)
