"""benchmarks/recovery_nodes.py (issue 44): every node killed in turn, the worst node as the headline, the expected
value and the best beside it against relaunch + load, how the spare took over, the losses per run."""
from __future__ import annotations

import importlib
import os
import sys

from pytest import approx

from deadpool_ext.testing.launch import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
nodes = importlib.import_module("recovery_nodes")

RECORDS = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 7)]


def _run(node: str, rep: int, restored: float, how: str = "relabel", records=None) -> dict:
    spare = {"event": "recover", "role": "spare", "built_ahead": how != "start_again",
             **({"relabelled_from": 1} if how == "relabel" else {})}
    return {"tag": f"{node}_r{rep}", "records": RECORDS if records is None else records, "timeline": [spare],
            "phases": {"detect_s": 0.1, "agree_s": 0.1, "rebuild_s": 0.0, "restore_s": restored - 0.2},
            "raw_s": restored + 2.7, "minus_step_s": restored + 0.1}


def _entry(node0=(0.5, 0.6, 0.7), node1=(0.4, 0.45, 0.5), node2=(0.9, 0.8, 1.2), bad=None) -> dict:
    base = [{"tag": f"baseline_r{i}", "records1": RECORDS[:3], "records2": RECORDS[2:],
             "breakdown": {"detect_s": 0.5, "relaunch_s": 0.0, "startup_and_load_s": 7.5}} for i in range(3)]
    return {"runs": {"hotswap": [_run("hotswap", i, r, "as_built") for i, r in enumerate(node1)],
                     "per_node": {"node0": [_run("node0", i, r) for i, r in enumerate(node0)],
                                  "node2": [_run("node2", i, r, records=bad if i == 1 else None)
                                            for i, r in enumerate(node2)]},
                     "baseline": base, "reference": {"records": RECORDS}}}


def test_the_worst_node_is_the_headline_with_the_expected_value_and_the_best_beside_it():
    an = nodes.analyze_nodes(_entry(), "node1")
    assert (an["worst"], an["best"]) == ("node2", "node1")
    assert an["worst_s"] == approx(0.9) and an["best_s"] == approx(0.45)
    assert an["expected_s"] == approx((0.6 + 0.45 + 0.9) / 3)
    assert an["baseline_restored_s"] == 8.0 and an["speedup_worst"] == approx(8.0 / 0.9)
    row = an["nodes"]["node2"]
    assert [row["restored_s"][k] for k in ("min", "median", "max")] == approx([0.8, 0.9, 1.2])
    assert an["nodes"]["node1"]["takeover"] == ["as_built"] * 3 and an["nodes"]["node0"]["takeover"] == ["relabel"] * 3
    t = an["targets"]
    assert t["restored_every_node"]["met"] and not t["speedup_every_node"]["met"]  # 8.9x < 10x
    assert t["losses_identical_every_run"]["met"]
    text = "\n".join(nodes.render_nodes(an))
    assert "worst node **node2 900.0 ms**" in text and "best node node1" in text and "| node0 | 3 |" in text


def test_one_run_off_by_one_loss_fails_its_node_and_the_target():
    bad = [dict(r, loss=r["loss"] + (1e-7 if r["step"] == 5 else 0)) for r in RECORDS]
    an = nodes.analyze_nodes(_entry(bad=bad), "node1")
    assert not an["nodes"]["node2"]["losses_identical"] and an["nodes"]["node0"]["losses_identical"]
    assert not an["targets"]["losses_identical_every_run"]["met"]
    assert "| NO |" in "\n".join(nodes.render_nodes(an))


def test_a_single_node_is_no_per_node_result():
    entry = _entry()
    entry["runs"]["per_node"] = {}
    assert nodes.analyze_nodes(entry, "node1") is None and nodes.render_nodes(None) == []


def test_the_relaunchs_floor_one_rank_alone_gives_the_conservative_speedup():
    """Beside relaunch + load (every rank at once on this host), the floor: one rank's start-up alone, loading
    nothing; the worst node's speedup against it is the conservative figure. A failed floor run is left out and
    named; without floor runs (results from before) nothing is claimed."""
    entry = _entry()
    entry["runs"]["solo"] = [{"tag": f"solo_r{i}", "startup_s": s} for i, s in enumerate((4.6, 4.5, 4.8))]
    entry["runs"]["solo"].append({"tag": "solo_r3", "startup_s": None, "failed": "exited rc=1"})
    an = nodes.analyze_nodes(entry, "node1")
    assert an["floor_s"]["median"] == approx(4.6) and an["floor_s"]["n"] == 3 and an["floor_failed"] == ["exited rc=1"]
    assert an["speedup_worst_floor"] == approx(4.6 / 0.9)
    assert "the worst node is **5.1x**" in "\n".join(nodes.render_nodes(an))
    plain = nodes.analyze_nodes(_entry(), "node1")
    assert plain["speedup_worst_floor"] is None and "floor" not in "\n".join(nodes.render_nodes(plain))


def test_the_spares_restore_is_split_where_its_recover_event_says():
    entry = _entry()
    for i, run in enumerate(entry["runs"]["per_node"]["node0"]):
        run["timeline"][0]["restore_parts"] = {"plan_s": 0.01 * (i + 1), "obtain_s": 0.1 * (i + 1), "apply_s": 0.2}
    an = nodes.analyze_nodes(entry, "node1")
    assert an["nodes"]["node0"]["spare_restore"] == approx({"plan_s": 0.02, "obtain_s": 0.2, "apply_s": 0.2})
    assert an["nodes"]["node2"]["spare_restore"] == {"plan_s": None, "obtain_s": None, "apply_s": None}
    text = "\n".join(nodes.render_nodes(an))
    assert "| 20.0 ms / 200.0 ms / 200.0 ms |" in text and "| relabel | - |" in text
