"""Kubernetes (issue 47, part 3): the StatefulSet example's container command
(``scripts/k8s/deadpool-statefulset.yaml``) run verbatim on 3 namespace hosts, only the pod environment set as the
kubelet sets it (the manifest's env entries, the downward API's ``POD_IP``, the pod's ``HOSTNAME``, ``$(VAR)``
expanded in the command). A whole host is lost and its pod restarted at once with the same command line: the
restarted launcher comes back as a spare of the running job by itself (``launcher/join.py`` ``count_start``), is
given the lost node's ranks, and the losses equal a run without failure, bit for bit."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time

import pytest
import yaml

from deadpool_ext.recovery.timeline import read_events
from deadpool_ext.testing.launch import REPO, base_env, read_metrics, wait_for_step
from tests.multihost.jobs import LEADER_TTL_S, training_job
from tests.multihost.test_host_faults import baseline

pytestmark = pytest.mark.slow
MANIFEST = os.path.join(REPO, "scripts", "k8s", "deadpool-statefulset.yaml")


def _container() -> dict:
    [sts] = [d for d in yaml.safe_load_all(open(MANIFEST)) if d and d.get("kind") == "StatefulSet"]
    [trainer] = sts["spec"]["template"]["spec"]["containers"]
    return trainer


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in a container's command, as the kubelet expands it from the container's environment."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_a_pod_restarted_by_kubernetes_rejoins_the_running_job_as_a_spare(host_bed, tmp_path):
    base = baseline(host_bed, tmp_path)
    bed = host_bed(3)
    job = training_job(tmp_path, name="k8s")
    assert bed.etcd is not None and job.metrics is not None
    trainer = _container()
    timeline = os.path.join(str(tmp_path), "k8s.timeline.jsonl")
    manifest_env = {e["name"]: str(e["value"]) for e in trainer["env"] if "value" in e}
    site = {"NPROC": "1", "JOB": "k8s", "STORE_URL": bed.etcd.store_url,
            "TRAIN_ARGS": shlex.join(job.script_argv()[1:]),
            "LAUNCHER_FLAGS": f"--timeline {timeline} --leader-ttl-s {LEADER_TTL_S} --detect-timeout-s 8"}

    def pod_env(h: int) -> dict[str, str]:
        env = base_env({**manifest_env, **site, "POD_IP": bed.addr(h), "HOSTNAME": f"deadpool-{h}",
                        "DEADPOOL_STORE_TOKEN": bed.etcd.token})
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the image's deadpool-run
        return env

    def start_pod(h: int, log: str):
        env = pod_env(h)
        command = [_kubelet_expand(a, env) for a in trainer["command"]]
        with open(log, "a") as fh:
            return bed.popen(h, command, cwd=REPO, env=env, stdout=fh, stderr=fh)

    logs = [os.path.join(str(tmp_path), f"k8s.host{h}.log") for h in range(3)]
    pods = [start_pod(h, logs[h]) for h in range(3)]
    try:
        wait_for_step(job.metrics, 4, timeout_s=300, proc=pods[0])
        with open(timeline, "a") as fh:
            fh.write(json.dumps({"event": "fault", "time": time.time(), "source": "injector",
                                 "fault": "pod deadpool-2 lost"}) + "\n")
        bed.kill_host(2)          # the pod's node gone, its processes and its /dev/shm with it
        bed.boot(2)               # Kubernetes starts the pod again: a fresh machine, the same command line
        pods[2] = start_pod(2, logs[2])
        rcs = [p.wait(300) for p in pods]
    finally:
        for p in pods:
            if p.poll() is None:
                p.kill()
    tails = "\n".join(f"--- host {h} ---\n{open(log, errors='replace').read()[-3000:]}" for h, log in enumerate(logs))
    assert rcs == [0, 0, 0], tails
    assert read_metrics(job.metrics) == base, tails
    events = read_events(timeline)
    assigned = [e for e in events if e.get("event") == "assignment"]
    assert [e["replaced"] for e in assigned] == [{"node2": "host2-1"}], assigned
    spare = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert [(e["rank"], e["restored_from"]) for e in spare] == [(2, "peer")], spare
