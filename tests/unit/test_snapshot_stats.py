"""The typed stats of the memory tiers (snapshot/stats.py) and the summary a runtime's stats() returns from them:
the keys benchmarks and job summaries read."""
from __future__ import annotations

from deadpool_ext.snapshot.stats import TIMINGS, SnapshotStats


def test_the_summary_of_a_fresh_manager_has_every_count_and_timing_and_no_restore():
    out = SnapshotStats().as_dict(committed_version=None, memory_bytes=0, worker_priority_boosts=0)
    assert {"snapshots", "diffs", "base_nbytes", "diff_nbytes", "committed_version", "memory_bytes",
            "worker_priority_boosts"} <= set(out)
    for name in TIMINGS:
        assert out[f"{name}_median"] is None and out[f"{name}_max"] is None and name not in out
    assert not {"restore", "restored_from", "restore_s", "checksum_fused", "worker_priority"} & set(out)


def test_timings_are_summarised_and_a_restore_is_reported_as_it_ran():
    st = SnapshotStats()
    for v in (0.3, 0.1, 0.2):
        st.add_timing("copy_s", v)
    st.snapshots, st.base_nbytes, st.checksum_fused = 3, 4096, True
    st.restore = {"outcome": "restored", "version": 7}
    st.restored_from, st.restored_version, st.replayed, st.restore_s = "peer", 7, 0, 0.5
    out = st.as_dict()
    assert (out["copy_s_median"], out["copy_s_max"]) == (0.2, 0.3)
    assert out["restore"] == {"outcome": "restored", "version": 7} and out["restored_from"] == "peer"
    assert (out["snapshots"], out["base_nbytes"], out["checksum_fused"], out["replayed"]) == (3, 4096, True, 0)
    assert st.copy_s == [0.3, 0.1, 0.2]  # the series themselves stay in order (benchmarks slice them)
