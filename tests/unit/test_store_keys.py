"""The coordination store's key contract (``deadpool_ext/launcher/keys.py``): no module spells a key, every value
a writer builds decodes through the schema its key names, key parts cannot be paths, and ``no_spare_policy`` has
one resolution that the launcher and the workers share."""
from __future__ import annotations

import ast
import os

import pytest

from deadpool_ext.cluster.assignment import Worker
from deadpool_ext.cluster.membership import initial_assignment
from deadpool_ext.launcher import keys, values
from deadpool_ext.launcher.contract import NO_SPARE_POLICY, HotSwapEnv

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deadpool_ext")
STORE_METHODS = {"get", "set", "set_json", "get_json", "wait", "list", "delete", "compare_set", "put_leased", "add",
                 "items", "decode"}


def _receiver(node: ast.expr) -> str:
    """The dotted name a method is called on (``self.store``, ``m.store``, ``self.values``), '' if not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _literal_keys(call: ast.Call) -> list[ast.expr]:
    if not call.args:
        return []
    first = call.args[0]
    found = [first] if isinstance(first, (ast.Constant, ast.JoinedStr)) and not (
        isinstance(first, ast.Constant) and not isinstance(first.value, str)) else []
    if isinstance(first, (ast.List, ast.Tuple)):  # store.wait([key, ...])
        found += [e for e in first.elts if isinstance(e, (ast.Constant, ast.JoinedStr))]
    return found


def _spelled(tree: ast.AST) -> list[str]:
    """``line: key`` of every literal key passed to a store client's or the value reader's method in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in STORE_METHODS):
            continue
        recv = _receiver(node.func.value).split(".")[-1].lower()
        if "store" not in recv and recv not in ("values", "_values"):
            continue
        out += [f"{node.lineno}: {ast.unparse(lit)}" for lit in _literal_keys(node)]
    return out


def test_the_check_sees_a_spelled_key():
    code = ("self.store.set(f'hb/{w}', b'1')\nm.store.wait(['gen/3'], 1)\nself.values.get('assignment', s)\n"
            "store.get(keys.heartbeat(w))\nd.get('x')\n")
    assert [ln.split(": ", 1)[1] for ln in _spelled(ast.parse(code))] == ["f'hb/{w}'", "'gen/3'", "'assignment'"]


def test_no_module_spells_a_store_key():
    """Every call on a coordination-store client or the launcher's value reader names its key through
    ``launcher/keys.py``: a key written as a literal in a second module is how the 20 keys drifted before."""
    bad = []
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            path = os.path.join(root, f)
            if not f.endswith(".py") or path.endswith(os.path.join("launcher", "keys.py")):
                continue
            with open(path) as fh:
                bad += [f"{os.path.relpath(path, PACKAGE)}:{hit}" for hit in _spelled(ast.parse(fh.read(), path))]
    assert not bad, "store keys spelled outside deadpool_ext/launcher/keys.py:\n" + "\n".join(bad)


def test_every_key_is_defined_once_with_its_writer_and_readers():
    names = [s.name for s in keys.SPECS]
    assert len(names) == len(set(names))
    for spec in keys.SPECS:
        assert spec.writer and spec.readers and spec.value, spec
    for n in names:  # no key is a prefix of another family: a list() of one family never returns another's
        assert not any(o != n and keys.BY_NAME[o].family and n.startswith(o) for o in names), n


@pytest.mark.parametrize("build", [keys.heartbeat, keys.done, keys.exit_of, keys.fence, keys.fenced, keys.dropped,
                                   keys.repaired, keys.join_request, keys.suspect])
def test_key_parts_are_names_never_paths(build):
    assert build("node0.1").endswith("/node0.1")
    for bad in ("../x", "a/b", "", "x" * 81, "sp ace"):
        with pytest.raises(ValueError, match="is not a name"):
            build(bad)


def test_a_refused_join_hears_why_under_the_name_it_used():
    assert keys.join_answer("../evil") == "join_ack/../evil"


def test_what_each_writer_builds_its_readers_decode():
    a = initial_assignment([Worker("node0.0", "node0", 0), Worker("node1.0", "node1", 0),
                            Worker("spare0.0", "spare0", 0)], ["node0", "node1"], ["spare0"])
    beat = values.heartbeat(keys.heartbeat("node0.0"), _raw(keys.heartbeat_value(
        {"step": 3, "step_at": 1.0, "coll": False, "still_s": 0.0})))
    assert beat["step"] == 3
    assert values.exit_rc(keys.exit_of("node0.0"), _raw(keys.exit_value(-9))) == -9
    assert values.record_time(keys.dropped("node1"), _raw(keys.dropped_value(2))) > 0
    assert values.record_time(keys.repaired("node1"), _raw(keys.repaired_value(joined=True))) > 0
    assert values.join_nproc(keys.join_request("late0"), _raw(keys.join_request_value(2))) == 2
    ack = values.join_ack(keys.join_answer("late0"), _raw(keys.join_answer_value(True, role="spare")))
    assert ack.ok and ack.role == "spare"
    no = values.join_ack(keys.join_answer("late0"), _raw(keys.join_answer_value(False, why="taken")))
    assert not no.ok and no.why == "taken"
    stopped = values.assignment(keys.ASSIGNMENT, _raw(keys.stopped_assignment(a.to_json(), "out of spares")))
    assert stopped.assignment == a and stopped.stop == "out of spares"
    assert values.fatal_text(keys.FATAL, keys.fatal_value("x" * 9000)) == "x" * values.MAX_TEXT
    assert values.slot_size(keys.slot_size(1), _raw(123)) == 123
    with pytest.raises(values.BadValue, match="slots/1"):
        values.slot_size(keys.slot_size(1), _raw(0))
    assert keys.BY_NAME[keys.HEARTBEATS].schema is values.heartbeat
    rep = values.suspect(keys.suspect("node0.0"), _raw(keys.suspect_value(3, "RuntimeError: " + "x" * 900)))
    assert rep.generation == 3 and rep.time > 0 and len(rep.what) == values.MAX_REPORT
    assert keys.BY_NAME[keys.SUSPECTS].schema is values.suspect
    assert keys.suspect("node0.0") in keys.worker_keys("node0.0")   # cleared before the node starts again


@pytest.mark.parametrize("raw,why", [
    (b'{"generation": 1, "time": 5.0, "what": "x", "rank": 2}', "unknown field(s)"),
    (b'{"generation": -1, "time": 5.0}', "'generation' must be an int"),
    (b'{"generation": true, "time": 5.0}', "'generation' must be an int"),
    (b'{"generation": 1, "time": NaN}', "not JSON"),
    (b'{"generation": 1}', "'time' must be a number"),
    (b'{"generation": 1, "time": 5.0, "what": 7}', "'what' must be a string of at most 300"),
    (b'[1, 5.0]', "must be a JSON object"),
    (b'{"generation": 1, "time": 5.0, "what": "' + b"y" * 5000 + b'"}', "at most 4096 allowed"),
    (b"\x80\x04pickle", "not JSON"),
])
def test_a_malformed_report_is_refused_in_one_line_naming_the_key(raw, why):
    with pytest.raises(values.BadValue) as err:
        values.suspect(keys.suspect("node1.0"), raw)
    line = str(err.value)
    assert "\n" not in line and line.startswith("store key 'suspect/node1.0': ") and why in line, line


def _raw(v: object) -> bytes:
    import json

    return json.dumps(v).encode()


@pytest.mark.parametrize("flag,job,policy,source", [
    (None, None, "fail", "the default"),
    (None, "shrink", "shrink", "deadpool.elastic.no_spare_policy"),
    ("fail", "shrink", "fail", "--no-spare-policy"),      # the flag wins, for the workers too
    ("wait", None, "wait", "--no-spare-policy"),
    (None, "bogus", "fail", "the default"),
])
def test_no_spare_policy_has_one_resolution(flag, job, policy, source):
    assert keys.resolve_no_spare_policy(flag, job) == keys.NoSparePolicy(policy, source)


def test_workers_tell_an_explicit_flag_from_none():
    """The launcher hands ``--no-spare-policy`` to its workers only when it was given: a worker then resolves
    exactly as the coordinator does (before, an absent flag reached workers as ``fail``)."""
    base = dict(store_url="embedded://127.0.0.1:1", token="t" * 32, job_id="j", worker_id="node0.0", node="node0",
                role="active", launcher_pid=1)
    env = HotSwapEnv(**base).to_environ()
    assert NO_SPARE_POLICY not in env and HotSwapEnv.from_environ(env).no_spare_policy is None
    env = HotSwapEnv(**base, no_spare_policy="fail").to_environ()
    assert HotSwapEnv.from_environ(env).no_spare_policy == "fail"
