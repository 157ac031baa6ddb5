"""Security: what listens where, and what peers can make a rank do (issue 14, item 4: network).

Listening sockets are read from /proc/net/tcp{,6}; a process's own ones are matched through the socket
inodes in /proc/<pid>/fd, so other jobs on the machine do not disturb the checks.
"""
from __future__ import annotations

import base64
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deadpool_ext.cluster.comm import MAX_MESSAGE_BYTES, CommError, decode_message, encode_message
from deadpool_ext.cluster.netif import InterfaceError, interface_for, local_addresses
from deadpool_ext.snapshot.rng_json import RngStateError, rng_from_json, rng_to_json
from deadpool_ext.snapshot.state import capture_rng, restore_rng
from deadpool_ext.store.base import StoreError
from deadpool_ext.store.c10d import serve_c10d_store
from tests.security._proc_net import listeners

# Per test; the fuzz targets scale with the example count (DEADPOOL_FUZZ_EXAMPLES, 10,000 in the campaign).
pytestmark = pytest.mark.timeout(180 + int(os.environ.get("DEADPOOL_FUZZ_EXAMPLES", "200")) // 10)

REPO = Path(__file__).resolve().parents[2]


def _external_ipv4() -> str | None:
    for _name, addr in local_addresses():
        if ":" not in addr and not addr.startswith("127."):
            return addr
    return None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# -- (a) the per-generation c10d store ---------------------------------------------------------------------

def test_c10d_store_listens_only_on_the_given_host() -> None:
    import torch.distributed as dist

    store, port = serve_c10d_store("127.0.0.1", 2)
    bound = listeners(port=port)
    assert bound == [("127.0.0.1", port)], bound          # torch's own TCPStore(...) would show ("::", port)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    ext = _external_ipv4()
    if ext is not None:                                    # not reachable through another interface either
        with pytest.raises(OSError):
            socket.create_connection((ext, port), timeout=2).close()
    del client, store


def test_c10d_store_on_an_external_address_is_not_on_loopback() -> None:
    ext = _external_ipv4()
    if ext is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    store, port = serve_c10d_store(ext, 1)
    assert listeners(port=port) == [(ext, port)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    del store


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_c10d_store_refuses_a_wildcard_host(host: str) -> None:
    with pytest.raises(ValueError, match="every interface"):
        serve_c10d_store(host, 2)


def test_c10d_store_refuses_an_address_of_another_machine() -> None:
    with pytest.raises(StoreError, match="must be an address of this machine"):
        serve_c10d_store("192.0.2.254" if _external_ipv4() != "192.0.2.254" else "198.51.100.7", 2)


# -- (a2) deadpool-run --metrics-port: the Prometheus endpoint ---------------------------------------------

def _metrics_server(host: str, tmp_path: Path) -> tuple[Any, int]:
    from deadpool_ext.launcher.metrics import MetricsServer

    server = MetricsServer(host, 0, str(tmp_path / "timeline.jsonl"), "dp1")
    return server, server.start()


def test_metrics_endpoint_listens_only_on_the_given_address(tmp_path: Path) -> None:
    """deadpool-run serves it on --metrics-addr, by default --host (loopback); the launcher's own listeners in a
    real job are checked in tests/integration/test_metrics_prometheus.py."""
    server, port = _metrics_server("127.0.0.1", tmp_path)
    try:
        assert listeners(port=port) == [("127.0.0.1", port)]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        ext = _external_ipv4()
        if ext is not None:
            with pytest.raises(OSError):
                socket.create_connection((ext, port), timeout=2).close()
    finally:
        server.close()
    assert listeners(port=port) == []                      # closed with the launcher


def test_metrics_endpoint_on_an_external_address_is_not_on_loopback(tmp_path: Path) -> None:
    ext = _external_ipv4()
    if ext is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    server, port = _metrics_server(ext, tmp_path)
    try:
        assert listeners(port=port) == [(ext, port)]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        server.close()


# -- (b) gloo's listeners ------------------------------------------------------------------------------

_LISTENERS_OF_SELF = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from _proc_net import listeners
    def report(extra):
        print("LISTENERS " + json.dumps({{"listeners": listeners(pid=os.getpid()), **extra}}), flush=True)
""")


def _run(code: str, env: dict[str, str], timeout: float = 90) -> dict[str, Any]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TORCHELASTIC_"))}
    full_env.update(PYTHONPATH=str(REPO), **env)
    prelude = _LISTENERS_OF_SELF.format(tests=str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env=full_env, cwd=str(REPO))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("LISTENERS ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    out: dict[str, Any] = json.loads(lines[-1][len("LISTENERS "):])
    return out


_ENV_LAUNCH = """
    from deadpool_ext.distributed import init_distributed
    import torch.distributed as dist
    init_distributed(backend="gloo", timeout_s=30)
    side = dist.new_group([0], backend="gloo")   # a side group (snapshot replication) is pinned too
    report({"ifname": os.environ.get("GLOO_SOCKET_IFNAME")})
"""


def test_env_launch_serves_rendezvous_and_gloo_on_master_addr_only() -> None:
    """A launch through the environment (the deepspeed launcher's way): rank 0 used to serve the rendezvous on
    every interface (init_method="env://") and gloo on whatever the host name resolves to."""
    port = _free_port()
    out = _run(_ENV_LAUNCH, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
    got = [tuple(x) for x in out["listeners"]]
    assert ("127.0.0.1", port) in got, got                 # the rendezvous store, on MASTER_ADDR
    assert len(got) >= 3, got                              # + the default group's and the side group's gloo
    assert all(addr == "127.0.0.1" for addr, _ in got), got
    assert out["ifname"] == "lo"


def test_gloo_follows_master_addr_not_the_host_name() -> None:
    """MASTER_ADDR on a cluster interface: gloo listens there, not on the address the host name resolves to
    (torch's default device; on this machine the host name resolves to 127.0.0.1)."""
    ext = _external_ipv4()
    if ext is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = _free_port(ext)
    out = _run(_ENV_LAUNCH, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": ext,
                             "MASTER_PORT": str(port)})
    got = [tuple(x) for x in out["listeners"]]
    assert len(got) >= 3 and all(addr == ext for addr, _ in got), got


def test_hot_swap_generation_pins_gloo_to_the_launcher_host() -> None:
    """The deadpool-run path (rebuild.worker.init_process_group): the launcher's store on --host, gloo too."""
    code = """
        from deadpool_ext.cluster.assignment import Assignment
        from deadpool_ext.rebuild.worker import init_process_group
        from deadpool_ext.store.c10d import serve_c10d_store
        store, port = serve_c10d_store("127.0.0.1", 1)
        a = Assignment(generation=0, world_size=1, ranks={"w0": 0}, nodes={"w0": "n0"}, master_port=port,
                       master_addr="127.0.0.1")
        init_process_group(a, "w0", "gloo", 30.0)
        report({"ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "port": port})
    """
    out = _run(code, {})
    got = [tuple(x) for x in out["listeners"]]
    assert ("127.0.0.1", out["port"]) in got and len(got) >= 2, got
    assert all(addr == "127.0.0.1" for addr, _ in got), got
    assert out["ifname"] == "lo"


def test_gloo_interface_set_by_the_user_is_kept() -> None:
    port = _free_port()
    out = _run(_ENV_LAUNCH, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    assert out["ifname"] == "lo"


def test_unresolvable_master_addr_is_one_clear_error() -> None:
    with pytest.raises(InterfaceError, match="'no-such-host.invalid' does not resolve.*GLOO_SOCKET_IFNAME"):
        interface_for("no-such-host.invalid")


# -- (c) pickle from peers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peer_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One two-rank gloo job running every peer scenario of tests/security/_peer_job.py."""
    out_dir = tmp_path_factory.mktemp("peer")
    store, port = serve_c10d_store("127.0.0.1", 3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "MASTER_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    script = str(Path(__file__).parent / "_peer_job.py")
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port), str(out_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    del store
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    result: dict[str, Any] = json.loads((out_dir / "rank0.json").read_text())
    return result


def test_rng_gather_between_honest_ranks_is_exact(peer_job: dict[str, Any]) -> None:
    assert peer_job["honest_gather"] == {"ranks": ["0", "1"], "rank1_exact": True, "own_exact": True}


def test_broadcast_json_between_honest_ranks(peer_job: dict[str, Any]) -> None:
    assert peer_job["honest_broadcast"] == {"path": "/base/7", "layout": [1, 2, 1]}


def test_peer_pickle_in_rng_gather_is_never_unpickled(peer_job: dict[str, Any]) -> None:
    """The old rng_client_state called all_gather_object: the same bytes from the peer ran its payload."""
    assert peer_job["control_marker"] is True               # the payload is live: all_gather_object runs it
    assert peer_job["gather_marker"] is False
    assert peer_job["gather"].startswith("RngStateError: gathering the ranks' RNG states: rank 1 sent a control "
                                         "message that is not"), peer_job["gather"]


def test_peer_pickle_in_broadcast_is_never_unpickled(peer_job: dict[str, Any]) -> None:
    assert peer_job["broadcast_marker"] is False
    assert peer_job["broadcast"].startswith("CommError: rank 1 sent a control message that is not"), \
        peer_job["broadcast"]


def test_peer_announcing_a_huge_message_is_refused_before_allocating(peer_job: dict[str, Any]) -> None:
    assert peer_job["huge"] == (f"RngStateError: gathering the ranks' RNG states: rank 1 announced a control "
                                f"message of {1 << 40} bytes; allowed 0..{MAX_MESSAGE_BYTES}")


def _draws() -> tuple[list[float], list[float], list[float], list[float]]:
    return ([random.random() for _ in range(5)] + [random.gauss(0, 1)], np.random.random(5).tolist(),
            [float(np.random.standard_normal())], torch.rand(5).tolist())


def test_rng_state_round_trips_exactly_through_json() -> None:
    """RNG states sent as JSON restore to the very same streams (bit-identical losses after a resume)."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    random.gauss(0, 1)
    np.random.standard_normal()        # both leave a cached gaussian: part of the state
    state = capture_rng()
    wire = json.loads(json.dumps(rng_to_json(state)))
    back = rng_from_json(wire)
    expected = _draws()
    restore_rng(back)
    assert _draws() == expected
    assert back["python"] == state["python"] and torch.equal(back["torch"], state["torch"])
    assert back["numpy"][0] == state["numpy"][0] and (back["numpy"][1] == state["numpy"][1]).all()
    assert back["numpy"][2:] == tuple(state["numpy"][2:])
    fake_cuda = {**state, "cuda": [torch.arange(16, dtype=torch.uint8)]}
    assert torch.equal(rng_from_json(json.loads(json.dumps(rng_to_json(fake_cuda))))["cuda"][0],
                       fake_cuda["cuda"][0])


def test_malformed_rng_state_is_one_clear_error() -> None:
    good = rng_to_json(capture_rng())
    bad = {**good, "numpy": {**good["numpy"], "pos": 10_000}}
    with pytest.raises(RngStateError, match=r"rank 1's RNG state.numpy.pos must be an int in 0..624"):
        rng_from_json(bad, "rank 1's RNG state")
    with pytest.raises(RngStateError, match="unknown fields"):
        rng_from_json({**good, "__reduce__": 1})


# -- fuzz ------------------------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=5),
                           max_leaves=30)


@given(st.one_of(st.binary(max_size=2048),
                 st.builds(lambda n: b"[" * n, st.integers(0, 200_000)),
                 st.builds(lambda n: b"1" * n, st.integers(4000, 6000)),
                 json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_decode_message(data: bytes) -> None:
    """What a peer's control message decodes to: a JSON value, or CommError; nothing else escapes."""
    try:
        decode_message(data, "rank 1")
    except CommError:
        pass


@given(json_values)
def test_fuzz_encode_message_round_trip(value: Any) -> None:
    """Every JSON value survives the wire encoding unchanged (NaN compared as NaN)."""
    back = decode_message(encode_message(value), "rank 0")
    assert json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True)


def _mutations() -> st.SearchStrategy[Any]:
    good = rng_to_json(capture_rng())
    paths = [("python", "version"), ("python", "state"), ("python", "gauss"), ("numpy", "name"), ("numpy", "keys"),
             ("numpy", "pos"), ("numpy", "has_gauss"), ("numpy", "cached_gaussian"), ("torch",), ("cuda",)]

    def mutate(path: tuple[str, ...], value: Any) -> Any:
        doc = json.loads(json.dumps(good))
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
        return doc
    weird = json_values | st.integers(-2**70, 2**70) | st.lists(st.integers(-5, 2**33), min_size=623, max_size=626) \
        | st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
    return st.one_of(json_values, st.builds(mutate, st.sampled_from(paths), weird))


@given(_mutations())
def test_fuzz_rng_from_json(doc: Any) -> None:
    """An RNG state from a peer or a record: a restorable-shaped state, or RngStateError; nothing else."""
    try:
        state = rng_from_json(doc)
    except RngStateError:
        return
    random.Random().setstate(state["python"])              # what was accepted has the shapes restore needs
    np.random.RandomState().set_state(state["numpy"])


@given(st.integers(0, 2**32 - 1), st.integers(0, 20))
def test_fuzz_rng_json_round_trip_is_exact(seed: int, draws: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for _ in range(draws):
        random.gauss(0, 1)
        np.random.standard_normal()
        torch.rand(1)
    back = rng_from_json(json.loads(json.dumps(rng_to_json(capture_rng()))))
    expected = _draws()
    restore_rng(back)
    assert _draws() == expected
