"""The seeded CI subset of the chaos suite (docs/chaos.md): two trials on ZeRO-3 under deadpool-run - a node
lost and the newest replica of its state corrupted, a worker SIGKILLed while its tier-1 slot is being written -
each compared step for step with one fault-free baseline (a survivor's corrupt tier-1 copy has its own test,
tests/integration/test_memory_tiers.py). About 40 s on an idle 2-core machine (one baseline + two jobs); the full
catalogue runs with `deadpool chaos --trials N`."""
from __future__ import annotations

import pytest

from deadpool_ext.chaos.campaign import run_campaign
from deadpool_ext.chaos.catalogue import Fault
from deadpool_ext.chaos.plan import plan_campaign
from deadpool_ext.chaos.report import format_table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SEED = 11
CI_FAULTS = [Fault.CORRUPT_TIER2, Fault.IN_SNAPSHOT]


def test_seeded_chaos_subset(tmp_path):
    scenarios = plan_campaign(SEED, 2, layouts=["zero3"], faults=CI_FAULTS)
    assert {s.fault for s in scenarios} == set(CI_FAULTS)
    report = run_campaign(scenarios, workdir=str(tmp_path), job_timeout_s=480)
    table = format_table(report["rows"], report["summary"])
    print(table)
    s = report["summary"]
    assert s["state_mismatches"] == 0, table
    assert s["failed"] == 0, table
    assert s["faults_injected"] >= 3, table  # 2 kills + the corruption actually landed
    assert s["hot_swaps"] >= 2, table
    # Every corrupt copy a restore used was refused first, and none was restored: the per-trial oracle
    # (chaos/check.py, counted in "failed") and the loss comparison ("state_mismatches"). How many copies are
    # refused depends on where the kill lands: a corrupted newest slot whose version no restore chose (the lost
    # rank had not completed it) is never read, so a count of refusals is not asserted here.


@pytest.mark.full_matrix(covered_by="tests/integration/test_hot_swap.py::test_rank_alive_but_not_progressing_is_"
                                    "detected_by_progress (the stuck fault: a main thread blocked for good, found by "
                                    "progress, losses identical), tests/multihost/test_host_faults.py (the host faults "
                                    "on the bed) and tests/unit/test_host_chaos_plan.py (the campaign's plan)")
def test_seeded_bed_subset(tmp_path):
    """The seeded CI subset of the host-level campaign (``deadpool chaos --bed``): one ``stuck`` trial on ZeRO-3 on
    the namespace bed (the other host-level faults are deterministic tests in tests/multihost)."""
    from deadpool_ext.chaos.hostfaults import HostFault, plan_host_trial, run_host_campaign
    from deadpool_ext.testing.hosts import missing_requirements

    why = missing_requirements()
    if why is not None:
        pytest.skip(f"multi-host bed: {why} (CI runs as root)")
    scenarios = [plan_host_trial(SEED, 0, ["zero3"], [HostFault.STUCK])]
    report = run_host_campaign(scenarios, workdir=str(tmp_path), job_timeout_s=300)
    table = format_table(report["rows"], report["summary"])
    print(table)
    s = report["summary"]
    assert s["failed"] == 0 and s["state_mismatches"] == 0 and s["recovered"] == 1, table
    assert s["hot_swaps"] == 1, table
