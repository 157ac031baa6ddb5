"""The simulator's report prints the swap cost it charges (issue 45, part 5): a swap is charged the built-ahead
cost for the share of nodes a spare shadows and the unready cost for the rest, not the built-ahead cost alone."""
from __future__ import annotations

from deadpool_ext.sim.costs import derive
from deadpool_ext.sim.params import Params
from deadpool_ext.sim.report import swap_cost_text


def test_the_report_prints_the_charge_not_the_built_ahead_floor():
    d = {"hotswap_fixed_s": 0.1, "hotswap_unready_s": 4.1, "spares": 2, "nodes": 200, "hotswap_s": 4.06,
         "built_ahead_fraction": 0.01}
    assert swap_cost_text(d) == ("hot-swap charged 4.06 s per swap (agree + rebuild: 0.10 s for the 1% of nodes a "
                                 "spare built ahead for, 4.10 s for the rest)")


def test_an_older_report_without_the_charge_has_it_computed_the_way_the_engine_does():
    p = Params()
    d = derive(p)
    older = {"hotswap_fixed_s": d.hotswap_fixed_s, "hotswap_unready_s": d.hotswap_unready_s, "spares": d.spares,
             "nodes": d.nodes}
    assert f"charged {d.hotswap_s:.2f} s per swap" in swap_cost_text(older)
