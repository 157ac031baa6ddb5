"""The goodput ledger where operators look: a real Prometheus server (Debian's ``prometheus``) scrapes a real
``deadpool-run --metrics-port`` job through a SIGKILLed worker that a spare replaces, and its HTTP query API shows
the recovery: the recoveries counter at 1, seconds lost, goodput below 1, lost + productive = wall, and the lost
seconds by cause equal to ``deadpool timeline``'s (the same ledger of the same events)."""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from deadpool_ext.chaos.at_step import ENV, StepFault, harness_env
from deadpool_ext.commands import timeline as timeline_command
from deadpool_ext.recovery.ledger import CAUSES, ledger
from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.launch import free_port, run_job, wait_for_step
from deadpool_ext.testing.wait import wait_until
from tests.integration.helpers import worker_proc
from tests.integration.test_hot_swap import dprun_job
from tests.security._proc_net import listeners

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMETHEUS = shutil.which("prometheus")
HOLD_STEP = 40
"""Rank 0 holds after this step until Prometheus has seen the recovery (the fault API's ``hold``), so the job
cannot end between two scrapes; the SIGKILL lands near step 3, far before it."""


def _query(port: int, expr: str) -> float | None:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server on loopback scraping ``127.0.0.1:<target>`` every second: yields (its port, target)."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package; scripts/test.sh installs it)")
    port, target = free_port(), free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
                   f"  - job_name: deadpool\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False
        wait_until(ready, 60, "Prometheus ready on its port", interval_s=0.1)
        yield port, target
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prometheus_scrapes_the_ledger_through_a_hot_swap(tmp_path, shm_root, prometheus, capsys):
    prom, target = prometheus
    marker = str(tmp_path / "hold")
    job = dprun_job(tmp_path, shm_root, nnodes=2, spares=1, iters=HOLD_STEP + 2, name="metrics",
                    extra=("--metrics-port", str(target)),
                    env=harness_env({ENV: StepFault("hold", HOLD_STEP, 0, marker).render()}))
    assert job.metrics is not None and job.timeline is not None
    seen: dict[str, float | None] = {}

    def inject(proc):
        wait_for_step(job.metrics, 3, timeout_s=120, proc=proc)
        victim = worker_proc(proc.pid, "node1.0")
        with open(job.timeline, "a") as fh:
            fh.write(json.dumps({"event": "fault", "time": time.time(), "worker": "node1.0",
                                 "signal": int(signal.SIGKILL), "source": "injector"}) + "\n")
        victim.send_signal(signal.SIGKILL)
        try:
            wait_until(lambda: (_query(prom, "sum(deadpool_recoveries_total)") or 0) >= 1, 90,
                       "Prometheus's sample of deadpool_recoveries_total to reach 1", interval_s=0.25)
            seen["listeners"] = listeners(pid=proc.pid)  # type: ignore[assignment]
            for name, expr in [("recoveries", "sum(deadpool_recoveries_total)"),
                               ("crash_tier2", 'deadpool_recoveries_total{cause="crash",tier="tier2"}'),
                               ("goodput", "deadpool_goodput_ratio"), ("wall", "deadpool_wall_seconds"),
                               ("productive", "deadpool_productive_seconds"), ("spares", "deadpool_spares_available"),
                               ("stragglers", "deadpool_stragglers_named_total"),
                               ("quarantined", "deadpool_versions_quarantined_total"),
                               ("snapshot_bytes", "deadpool_snapshot_bytes")] + \
                    [(f"lost_{c}", f'deadpool_lost_seconds{{cause="{c}"}}') for c in CAUSES]:
                seen[name] = _query(prom, expr)
        finally:
            with open(marker + ".release", "w") as fh:
                fh.write("released")

    res = run_job(job.argv(), timeout_s=200, while_running=inject, env=job.env())
    assert res.returncode == 0, res.output[-4000:]
    # what Prometheus stored from the scrape after the recovery
    lost = {c: seen[f"lost_{c}"] for c in CAUSES}
    assert seen["recoveries"] == 1 and seen["crash_tier2"] == 1, seen
    assert all(v is not None for v in lost.values()), lost
    assert sum(lost.values()) > 0 and lost["detect"] > 0 and lost["restore"] > 0, lost  # type: ignore[arg-type]
    assert seen["goodput"] is not None and 0 < seen["goodput"] < 1, seen
    total = seen["productive"] + sum(lost.values())  # type: ignore[operator,arg-type]
    assert abs(total - seen["wall"]) <= 0.01 * seen["wall"], (total, seen)  # type: ignore[operator]
    assert (seen["spares"], seen["stragglers"], seen["quarantined"]) == (0, 0, 0) and seen["snapshot_bytes"], seen
    # the recovery's seconds are deadpool timeline's: its phases of the finished job, and its ledger
    final = ledger(read_events(job.timeline), time.time())
    for cause in ("startup", "detect", "spare_wait", "communicators", "rebuild", "restore", "recompute"):
        assert lost[cause] == pytest.approx(final.lost_s[cause], abs=1e-6), (cause, lost, final.lost_s)
    capsys.readouterr()
    assert timeline_command.run(argparse.Namespace(path=job.timeline, json=True, ledger=False)) == 0
    [row] = json.loads(capsys.readouterr().out)
    for cause in ("detect", "restore", "recompute"):
        assert lost[cause] == pytest.approx(row[f"{cause}_s"], abs=1e-6), (cause, lost, row)
    assert lost["spare_wait"] + lost["communicators"] == pytest.approx(row["agree_s"], abs=1e-6), (lost, row)
    # the endpoint listened on the launcher's --host only (loopback), beside its store
    got = [tuple(x) for x in seen["listeners"]]  # type: ignore[union-attr]
    assert ("127.0.0.1", target) in got and all(addr == "127.0.0.1" for addr, _ in got), got
