"""The launcher's one decoder of store values (launcher/values.py), pure: every schema against nested, huge, wrongly
typed and non-finite values; each refusal is a BadValue naming the key, in one line that shortens what it echoes."""
from __future__ import annotations

import json

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment
from deadpool_ext.launcher import values
from deadpool_ext.launcher.values import BadValue

NESTED = b"[" * 100_000 + b"]" * 100_000
HUGE = b'"' + b"x" * (1 << 20) + b'"'

SCHEMAS = {
    "hb/node0.0": values.heartbeat, "exit/node0.0": values.exit_rc, "dropped/node1": values.record_time,
    "joined/extra0": values.join_nproc, "join_ack/extra0": values.join_ack, "config/no_spare_policy": values.policy,
    "dead_spares": values.node_list, "leader": values.leader, "assignment": values.assignment,
    "client_state/0": values.client_state,
}
HOSTILE = [NESTED, HUGE, b"\xff\xfe", b"", b"null", b"[]", b"{}", b"NaN", b'{"t": Infinity}', b"1" * 5000,
           b'{"rc": 1e999}', b"[[[[[[[[1]]]]]]]]", b'{"a": {"b": {"c": {"d": {"e": 1}}}}}']


@pytest.mark.parametrize("key", sorted(SCHEMAS))
@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
def test_every_schema_refuses_hostile_values_with_one_short_line(key, raw):
    if (key, raw) == ("dead_spares", b"[]"):
        assert SCHEMAS[key](key, raw) == []   # no dead spare: a good value
        return
    with pytest.raises(BadValue) as exc:
        SCHEMAS[key](key, raw)
    line = str(exc.value)
    assert exc.value.key == key and line.startswith(f"store key {key!r}: ")
    assert "\n" not in line and len(line) < 400


def test_a_deep_value_is_refused_without_exhausting_the_stack():
    with pytest.raises(BadValue, match="nested too deeply"):
        values.decode_json("joined/x", NESTED, max_bytes=len(NESTED))
    with pytest.raises(BadValue, match="nested more than 4 levels"):
        values.decode_json("joined/x", b"[[[[[1]]]]]")
    with pytest.raises(BadValue, match="value of 4097 bytes, at most 4096 allowed"):
        values.decode_json("hb/w.0", b" " * 4097)


def test_good_values_decode():
    assert values.heartbeat("hb/a.0", b"12.5")["t"] == 12.5
    beat = values.heartbeat("hb/a.0", b'{"t": 1, "step": 2, "step_at": 3, "coll": true, "still_s": 0.5, "new": 1}')
    assert beat["step"] == 2 and beat["coll"] is True and beat["new"] == 1
    assert values.exit_rc("exit/a.0", b'{"rc": -9, "time": 1}') == -9
    assert values.record_time("dropped/n", b'{"time": 5, "generation": 2}') == 5.0
    assert values.join_nproc("joined/x", b'{"nproc": 2, "time": 0}') == 2
    assert values.join_ack("join_ack/x", b'{"ok": true, "as": "grow"}') == values.JoinAck(True, "", "grow")
    assert values.policy("config/no_spare_policy", b'"shrink"') == "shrink"
    assert values.node_list("dead_spares", b'["spare0", "extra1"]') == ["spare0", "extra1"]
    assert values.leader("leader", b'{"host_rank": 1, "host": "10.0.0.2"}')["host_rank"] == 1
    assert values.host_index("host/3") == 3 and values.host_index("host/x") is None
    assert values.host_index("host/" + "9" * 50) is None
    rec = values.client_state("client_state/1", b'{"saved": {"step": 2, "cfg": {"a": [1]}}, "at": {"global_steps": 2}}')
    assert rec == values.ClientState({"step": 2, "cfg": {"a": [1]}}, {"global_steps": 2})


@pytest.mark.parametrize("raw,needle", [
    (b'{"saved": {}, "at": {}}', "'at' must name global_steps"),
    (b'{"saved": {}, "at": {"global_steps": 1, "epoch": 2}}', "'at' must name global_steps"),
    (b'{"saved": {}, "at": {"global_steps": -1}}', "'at.global_steps' must be an int"),
    (b'{"saved": [], "at": {"global_steps": 1}}', "must be a JSON object"),
    (b'{"saved": {}, "at": {"global_steps": 1}, "code": "x"}', "unknown field"),
])
def test_a_wrong_client_state_record_is_refused_naming_the_field(raw, needle):
    with pytest.raises(BadValue, match=needle):
        values.client_state("client_state/0", raw)


def test_an_assignment_round_trips_and_a_stop_message_is_kept():
    workers = [Worker(f"{n}.{i}", n, i) for n in ("node0", "node1", "spare0") for i in range(2)]
    a = initial_assignment(workers, ["node0", "node1"], ["spare0"])
    assert values.assignment("assignment", json.dumps(a.to_json()).encode()).assignment == a
    pub = values.assignment("assignment", json.dumps({**a.to_json(), "stop": "no spare"}).encode())
    assert pub.stop == "no spare"


@pytest.mark.parametrize("change,needle", [
    ({"ranks": {"node0.0": 0, "node0.1": 0}}, "every rank 0..1 must be held once"),
    ({"ranks": {"node0.0": 0, "node0.1": 7}}, "'ranks[node0.1]' must be an int in [0, 1]"),
    ({"nodes": {"node0.0": "../x", "node0.1": "node0"}}, "nodes[node0.0] must match"),
    ({"nodes": {"node0.0": "node1", "node0.1": "node0"}}, "worker node0.0 must be on node node0"),
    ({"ranks": {"a/b.0": 0, "node0.1": 1}, "nodes": {"a/b.0": "a", "node0.1": "node0"}}, "a worker id must match"),
    ({"spares": ["ok", 3]}, "every name in 'spares' must match"),
    ({"generation": True}, "'generation' must be an int"),
    ({"world_size": 10**30}, "'world_size' must be an int in [1, 262144]"),
    ({"master_port": 70000}, "'master_port' must be an int in [0, 65535]"),
    ({"stop": "x" * 5000}, "'stop' must be a string of at most 4000 characters"),
    ({"evil": 1}, "unknown field(s)"),
])
def test_a_wrong_assignment_is_refused_naming_the_field(change, needle):
    workers = [Worker(f"node0.{i}", "node0", i) for i in range(2)]
    doc = {**initial_assignment(workers, ["node0"], []).to_json(), **change}
    with pytest.raises(BadValue) as exc:
        values.assignment("assignment", json.dumps(doc).encode())
    assert needle in str(exc.value) and len(str(exc.value)) < 400


def test_bad_values_are_logged_once_per_key_and_read_as_absent(caplog):
    class Store:
        data = {"hb/a.0": b"[[[[[[1]]]]]]", "exit/a.0": b'{"rc": "x"}', "exit/b.0": b'{"rc": 3}',
                "exit/../x": b'{"rc": 1}'}

        def get(self, key):
            return self.data.get(key)

        def list(self, prefix):
            return {k: v for k, v in self.data.items() if k.startswith(prefix)}

    reader = values.StoreValues(Store())
    with caplog.at_level("WARNING", logger="deadpool_ext.launcher"):
        for _ in range(5):
            assert reader.get("hb/a.0", values.heartbeat) is None
            assert reader.items("exit/", values.exit_rc, values.WORKER_RE) == {"b.0": 3}
    # hb/a.0, exit/a.0, exit/../x: one line each, not one per read
    assert reader.warned == ["exit/../x", "exit/a.0", "hb/a.0"] and len(caplog.records) == 3
    assert reader.refused == 15
