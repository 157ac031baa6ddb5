import pytest

from deadpool_ext.cluster.assignment import Assignment, Worker
from deadpool_ext.cluster.membership import NoSpareError, initial_assignment, replace_failed


def _workers(nodes, nproc):
    return [Worker(f"{n}.{i}", n, i) for n in nodes for i in range(nproc)]


def test_initial_deals_ranks_by_node():
    ws = _workers(["a", "b", "s"], 2)
    a = initial_assignment(ws, ["a", "b"], ["s"])
    assert a.world_size == 4 and a.ranks == {"a.0": 0, "a.1": 1, "b.0": 2, "b.1": 3} and a.spares == ("s",)


def test_spare_takes_failed_ranks_survivors_keep_theirs():
    ws = _workers(["a", "b", "c", "s"], 1)
    a0 = initial_assignment(ws, ["a", "b", "c"], ["s"])
    a1 = replace_failed(a0, ws, {"b"})
    assert a1.generation == 1 and a1.ranks == {"a.0": 0, "s.0": 1, "c.0": 2}
    assert a1.replaced == {"b": "s"} and a1.spares == ()
    assert Assignment.from_json(a1.to_json()) == a1


def test_no_spare_left_is_a_clear_error():
    ws = _workers(["a", "b", "s"], 1)
    a1 = replace_failed(initial_assignment(ws, ["a", "b"], ["s"]), ws, {"a"})
    with pytest.raises(NoSpareError, match=r"only 0 spare node\(s\) are left"):
        replace_failed(a1, ws, {"b"})


def test_dead_spare_is_skipped():
    ws = _workers(["a", "b", "s1", "s2"], 1)
    a0 = initial_assignment(ws, ["a", "b"], ["s1", "s2"])
    a1 = replace_failed(a0, ws, {"a"}, dead_spares={"s1"})
    assert a1.ranks["s2.0"] == 0 and "s1" not in a1.spares


def test_successive_failures_use_spares_in_order():
    ws = _workers(["a", "b", "s1", "s2"], 2)
    a0 = initial_assignment(ws, ["a", "b"], ["s1", "s2"])
    a2 = replace_failed(replace_failed(a0, ws, {"b"}), ws, {"s1"})
    assert a2.node_ranks("s2") == [2, 3] and a2.generation == 2
