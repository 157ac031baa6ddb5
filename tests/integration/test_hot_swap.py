"""Hot-swap under deadpool-run: real worker processes killed (SIGKILL) or stopped (SIGSTOP) from outside;
survivors keep their process ids, a pre-started spare takes the failed node's ranks, and the loss trajectory
matches a run without failure bit for bit."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from deadpool_ext.chaos.at_step import ENV, harness_env
from deadpool_ext.recovery.timeline import phases, read_events
from deadpool_ext.testing.baselines import BASELINES
from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import read_metrics, run_job, wait_for_step
from tests.conftest import make_config, matrix
from tests.integration.helpers import worker_proc

pytestmark = pytest.mark.slow
ITERS = 10


def dprun_job(tmp_path, shm_root, *, stage=3, nnodes=3, spares=1, iters=ITERS, name="run", extra=(), env=None,
              nproc=1, **cfg) -> Job:
    """The tiny GPT job under deadpool-run: ``nnodes`` nodes of 1 worker, ``spares`` spares. ``env``: extra
    environment of the job (e.g. ``chaos.at_step.harness_env(...)``); ``cfg``: DeepSpeed config overrides."""
    config = make_config(tmp_path, stage=stage, deadpool={"local": {"shm_root": shm_root}}, **cfg)
    return Job(script="scripts/pretrain_gpt.py", nnodes=nnodes, nproc_per_node=nproc, spare_nodes=spares,
               shm_root=shm_root, timeline=os.path.join(str(tmp_path), f"{name}.timeline.jsonl"),
               launcher_flags=tuple(extra), config=config, args=("--train-iters", str(iters)),
               metrics=os.path.join(str(tmp_path), f"{name}.jsonl"), env_vars=dict(env or {}))


def dprun(tmp_path, shm_root, *, faults=(), name="run", **job):
    """faults: [(step, worker_id, signal)] applied in order once the metrics reach ``step``; ``job``: dprun_job's."""
    return run_dprun(tmp_path, dprun_job(tmp_path, shm_root, name=name, **job), faults=faults, name=name)


def run_dprun(tmp_path, job: Job, *, faults=(), name="run"):
    assert job.metrics is not None and job.timeline is not None and job.nnodes is not None
    metrics, timeline, nnodes = job.metrics, job.timeline, job.nnodes
    pids: dict[str, int] = {}

    def inject(proc):
        for wid in [f"node{i}.0" for i in range(nnodes)]:  # each polled for until the launcher has started it
            pids[wid] = worker_proc(proc.pid, wid).pid
        for step, wid, sig in faults:
            if isinstance(step, tuple):  # ("assignment", g): right after the launcher publishes generation g
                deadline = time.time() + 240
                while not any(e.get("event") == "assignment" and e.get("generation") == step[1]
                              for e in (read_events(timeline) if os.path.exists(timeline) else [])):
                    assert time.time() < deadline and proc.poll() is None, f"no assignment {step[1]}"
                    time.sleep(0.02)
            else:
                wait_for_step(metrics, step, timeout_s=240, proc=proc)
            target = worker_proc(proc.pid, wid)
            with open(timeline, "a") as fh:
                fh.write(json.dumps({"event": "fault", "time": time.time(), "worker": wid, "signal": int(sig),
                                     "source": "injector"}) + "\n")
            target.send_signal(sig)

    res = run_job(job.argv(), timeout_s=400, while_running=inject, env=job.env())
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, res.output[-4000:]
    events = read_events(timeline) if os.path.exists(timeline) else []
    return res, read_metrics(metrics), events, pids


def baseline(tmp_path, shm_root, stage):
    """The uninterrupted run of the module's job (3 nodes, no spare) from the one cache (testing/baselines.py)."""
    def run(job: Job) -> dict[int, float]:
        res, metrics, _, _ = run_dprun(tmp_path, job, name=f"base{stage}")
        assert res.returncode == 0, res.output[-3000:]
        assert sorted(metrics) == list(range(1, ITERS + 1))
        return metrics

    return BASELINES.get(dprun_job(tmp_path, shm_root, stage=stage, spares=0, name=f"base{stage}"), run)


@pytest.mark.parametrize("stage", matrix([1, 2, 3], ci=[3]))  # ZeRO-1: the busy-survivors test
def test_sigkill_hot_swap_identical_losses(tmp_path, shm_root, stage):
    base = baseline(tmp_path, shm_root, stage)
    res, metrics, events, pids = dprun(tmp_path, shm_root, stage=stage, faults=[(4, "node1.0", signal.SIGKILL)],
                                       name="swap")
    assert res.returncode == 0, res.output[-4000:]
    assert metrics == base
    rows = phases(events)
    assert len(rows) == 1, rows
    row = rows[0]
    for key in ("detect_s", "agree_s", "rebuild_s", "restore_s", "recompute_s", "total_s"):
        assert row[key] is not None and row[key] >= 0, (key, row)
    assert row["replaced"] == {"node1": "spare0"}
    # Survivors kept their processes; the spare is a different, pre-started one.
    assert row["survivor_pids"] == sorted([pids["node0.0"], pids["node2.0"]])
    assert len(row["spare_pids"]) == 1 and row["spare_pids"][0] not in pids.values()
    # The spare restored node1's state from the replica a survivor held (tier 2), verified before use.
    spare = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert [(e["rank"], e["restored_from"]) for e in spare] == [(1, "peer")], spare
    # The spare shadows node1 (the node after the first): its engine existed before the kill, for rank 1 of 3, and
    # the coordinator gave it node1's ranks for that reason; after its assignment it only joined and restored.
    [ready] = [e for e in events if e.get("event") == "spare_ready"]
    assert (ready["rank"], ready["world_size"], ready["node"]) == (1, 3, "node1") and ready["time"] < row_fault(events)
    [assigned] = [e for e in events if e.get("event") == "assignment" and e.get("generation") == 1]
    assert assigned["built_ahead"] == {"node1": True}
    assert row["spare_built_ahead"] is True and row["spare_s"] is not None and row["communicators_s"] is not None


@pytest.mark.full_matrix(covered_by="test_spare_takes_a_node_it_did_not_shadow_in_place[3] (one process a node) "
                                    "and tests/unit/test_spare_ahead.py (each process of a spare takes the rank of "
                                    "its local index)")
def test_each_process_of_a_spare_relabels_for_its_local_index(tmp_path, shm_root):
    """Two processes a node (6 ranks): the spare's processes built for node1's ranks 2 and 3 take node2's 4 and 5,
    each relabelled in place, and the losses equal an uninterrupted 6-rank run bit for bit."""
    def run(job: Job) -> dict[int, float]:
        res, metrics, _, _ = run_dprun(tmp_path, job, name="base_nproc2")
        assert res.returncode == 0, res.output[-3000:]
        return metrics

    base = BASELINES.get(dprun_job(tmp_path, shm_root, spares=0, nproc=2, name="base_nproc2"), run)
    job = dprun_job(tmp_path, shm_root, nproc=2, name="nproc2")
    res, metrics, events, _ = run_dprun(tmp_path, job, faults=[(4, "node2.0", signal.SIGKILL)], name="nproc2")
    assert res.returncode == 0, res.output[-4000:]
    assert metrics == base
    assigned = sorted((e["built_rank"], e["rank"], e["how"]) for e in events if e.get("event") == "spare_assigned")
    assert assigned == [(2, 4, "relabel"), (3, 5, "relabel")], assigned


def row_fault(events: list[dict]) -> float:
    return next(e["time"] for e in events if e.get("event") == "fault")


def test_survivors_busy_computing_are_stopped_by_the_launchers_notice(tmp_path, shm_root):
    # ZeRO-1 with 96 micro-batches per step: a survivor's forward/backward passes run for a while without any
    # collective (gradients are reduced at the boundary). Rank 1 dies right after step 2 (in-process fault, so
    # the survivors are at the start of step 3's micro-batches): they must leave on the launcher's notice, not
    # at the boundary's collective, and the losses stay identical to an uninterrupted run.
    long = {"gradient_accumulation_steps": 96}
    res0, base, _, _ = dprun(tmp_path, shm_root, stage=1, spares=0, iters=3, name="busy_base", **long)
    assert res0.returncode == 0, res0.output[-3000:]
    marker = os.path.join(str(tmp_path), "busy.fault")
    res, metrics, events, pids = dprun(tmp_path, shm_root, stage=1, iters=3, name="busy", **long,
                                       env=harness_env({ENV: f"kill@step=2,rank=1,marker={marker}"}))
    assert res.returncode == 0, res.output[-4000:]
    assert os.path.exists(marker)
    survivors = [e for e in events if e.get("event") == "recover" and e.get("role") == "survivor"]
    assert sorted((e["old_rank"], e["failed_step"], e["cause"]) for e in survivors) == [
        (0, 2, "launcher_notice"), (2, 2, "launcher_notice")], survivors
    assert metrics == base
    assert phases(events)[0]["survivor_pids"] == sorted([pids["node0.0"], pids["node2.0"]])


def test_sigstop_hang_is_detected_and_swapped(tmp_path, shm_root):
    base = baseline(tmp_path, shm_root, 3)
    res, metrics, events, pids = dprun(tmp_path, shm_root, faults=[(4, "node2.0", signal.SIGSTOP)], name="hang",
                                       extra=["--detect-timeout-s", "3"])
    assert res.returncode == 0, res.output[-4000:]
    failure = [e for e in events if e.get("event") == "failure"][0]
    assert "hung: no heartbeat" in failure["failed"]["node2.0"]["why"]
    assert metrics == base
    row = phases(events)[0]
    assert row["survivor_pids"] == sorted([pids["node0.0"], pids["node1.0"]])
    # The spare had built its engine for node1's rank 1: assigned rank 2, it relabelled that engine in place (no
    # start from the script's first line: same pid, built ahead), and the losses are still exact.
    [spare] = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    [ready] = [e for e in events if e.get("event") == "spare_ready"]
    assert ready["rank"] == 1 and spare["rank"] == 2 and spare["pid"] == ready["pid"] == row["spare_pids"][0]
    assert spare["relabelled_from"] == 1 and row["spare_built_ahead"] is True


@pytest.mark.parametrize("stage", matrix([0, 1, 2, 3], ci=[3]))  # ZeRO 0-2: test_takeover.py's relabel in CI (1)
def test_spare_takes_a_node_it_did_not_shadow_in_place(tmp_path, shm_root, stage):
    """Issue 44: the spare builds its engine ahead for node1's rank 1; node0 (rank 0, the metrics writer) is killed.
    The spare takes rank 0 with the engine it built for rank 1, relabelled (``integrations/deepspeed/takeover.py``),
    without starting its script again, restores rank 0's state from a survivor's replica, and the losses equal an
    uninterrupted run bit for bit."""
    base = baseline(tmp_path, shm_root, stage)
    csv = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "anynode"}
    res, metrics, events, pids = dprun(tmp_path, shm_root, stage=stage, faults=[(4, "node0.0", signal.SIGKILL)],
                                       name="anynode", csv_monitor=csv)
    assert res.returncode == 0, res.output[-4000:]
    assert metrics == base
    # DeepSpeed's monitor, open on rank 0 only, was opened by the spare once it became rank 0: the rows after the
    # swap follow a second header (its new writer) and go on to the last step
    rows = (tmp_path / "csv" / "anynode" / "Train_Samples_lr.csv").read_text().splitlines()
    heads = [i for i, r in enumerate(rows) if r.startswith("step,")]
    assert len(heads) == 2 and heads[1] < len(rows) - 1 and len(rows) >= len(heads) + ITERS, rows
    [ready] = [e for e in events if e.get("event") == "spare_ready"]
    assert (ready["rank"], ready["node"], ready["any_rank"]) == (1, "node1", True), ready
    [spare] = [e for e in events if e.get("event") == "recover" and e.get("role") == "spare"]
    assert (spare["rank"], spare["relabelled_from"], spare["restored_from"]) == (0, 1, "peer"), spare
    assert spare["pid"] == ready["pid"] and spare["built_ahead"] is True
    [assigned] = [e for e in events if e.get("event") == "spare_assigned"]
    assert (assigned["how"], assigned["built_rank"], assigned["rank"]) == ("relabel", 1, 0), assigned
    row = phases(events)[0]
    assert row["replaced"] == {"node0": "spare0"} and row["survivor_pids"] == sorted([pids["node1.0"], pids["node2.0"]])
    # the spare's life, one state machine (rebuild/spare.py), every transition in the timeline
    life = [(e["previous"], e["state"]) for e in events if e.get("event") == "spare_state"]
    assert life == [("starting", "building_ahead"), ("building_ahead", "waiting"), ("waiting", "joining"),
                    ("joining", "joined")], life


def test_rank_alive_but_not_progressing_is_detected_by_progress(tmp_path, shm_root):
    """Rank 1's main thread blocks for good after step 4 (in-process fault) while its heartbeat thread runs on:
    the heartbeat alone would never catch it. The others wait for it in their next collective; after
    --progress-timeout-s without a finished step, the rank standing still outside any collective is fenced and
    replaced, well before the 60 s collective timeout, and the losses are those of a run without failure."""
    base = baseline(tmp_path, shm_root, 3)
    marker = os.path.join(str(tmp_path), "stuck.fault")
    res, metrics, events, pids = dprun(tmp_path, shm_root, name="stuck", extra=["--progress-timeout-s", "4"],
                                       env=harness_env({ENV: f"hang@step=4,rank=1,marker={marker}"}))
    assert res.returncode == 0, res.output[-4000:]
    assert os.path.exists(marker)
    failures = [e for e in events if e.get("event") == "failure"]
    assert len(failures) == 1 and list(failures[0]["failed"]) == ["node1.0"], failures
    why = failures[0]["failed"]["node1.0"]["why"]
    assert why.startswith("no progress") and "outside any collective" in why and "2 rank(s) wait" in why, why
    fired = float(open(marker).read() and os.path.getmtime(marker))
    assert failures[0]["detected_at"] - fired < 4 + 3, "detected within the progress timeout plus a heartbeat or so"
    assert metrics == base
    assert phases(events)[0]["survivor_pids"] == sorted([pids["node0.0"], pids["node2.0"]])


def test_successive_failures_and_a_dead_spare(tmp_path, shm_root):
    base = baseline(tmp_path, shm_root, 3)
    res, metrics, events, _ = dprun(tmp_path, shm_root, spares=3, name="multi", faults=[
        (2, "spare0.0", signal.SIGKILL), (3, "node1.0", signal.SIGKILL), (6, "node0.0", signal.SIGKILL)])
    assert res.returncode == 0, res.output[-4000:]
    assert [e["node"] for e in events if e.get("event") == "spare_lost"] == ["spare0"]
    assert ([e["replaced"] for e in events if e.get("event") == "assignment"]
            == [{"node1": "spare1"}, {"node0": "spare2"}])
    assert metrics == base


def test_failure_during_recovery(tmp_path, shm_root):
    # The spare that took rank 1 dies while everyone is rebuilding for generation 1: survivors go round to
    # generation 2, the second spare takes rank 1 and restores it from the replica still held by rank 0.
    base = baseline(tmp_path, shm_root, 3)
    res, metrics, events, pids = dprun(tmp_path, shm_root, spares=2, name="during", faults=[
        (4, "node1.0", signal.SIGKILL), (("assignment", 1), "spare0.0", signal.SIGKILL)])
    assert res.returncode == 0, res.output[-4000:]
    assert [e["replaced"] for e in events if e.get("event") == "assignment"] == [{"node1": "spare0"},
                                                                                   {"spare0": "spare1"}]
    assert metrics == base


def test_no_spare_left_stops_with_clear_error(tmp_path, shm_root):
    """Out of spares: the job stops with one line naming the lost node and which step is safe on which tier (issue
    47): the script writes a tier-3 base every 2 steps (``--save``), and the line names the newest one published and
    verified that rank 0's heartbeat carried, which is on storage, and the steps trained since (none when the kill
    lands after step 8's base is verified)."""
    from deadpool_ext.persist.layout import COMMIT, version_tag

    ckpt = os.path.join(str(tmp_path), "ckpt")
    job = dprun_job(tmp_path, shm_root, spares=0, name="nospare")
    job = job.replace(args=(*job.args, "--save", ckpt, "--save-interval", "2"))
    res, metrics, events, _ = run_dprun(tmp_path, job, faults=[(8, "node1.0", signal.SIGKILL)], name="nospare")
    assert res.returncode != 0
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert stopped and "only 0 spare node(s) are left" in stopped[-1]["reason"] and "--spare-nodes" in \
        stopped[-1]["reason"]  # the final line says it too (unit: test_the_launchers_final_line_names_the_real_cause)
    tier3, trained = stopped[-1]["tier3_step"], stopped[-1]["trained_step"]
    # as rank 0's last heartbeat (every 0.5 s) said: the base of step 8 may be verified before the kill lands
    assert tier3 in (2, 4, 6, 8) and trained >= tier3, stopped[-1]
    assert f"Safe on tier 3: step {tier3}, its newest verified base when the job stopped" in stopped[-1]["reason"]
    assert (f"steps {tier3 + 1}-{trained} trained since were in memory only" in stopped[-1]["reason"]) \
        == (trained > tier3), stopped[-1]
    # a base in flight at the stop may land after it, and the writer keeps the newest 2 (persist.keep_last): the
    # named step or a newer one is on storage. Newer than the heartbeat's trained step too: on a loaded host rank 0's
    # last heartbeat can be steps behind its training (a full suite run: trained 5, tier 3 4, the bases of 6 and 8
    # written, the base of 4 collected)
    assert any(os.path.exists(os.path.join(ckpt, version_tag(v), COMMIT)) for v in range(tier3, max(metrics) + 1)), \
        (stopped[-1], os.listdir(ckpt))


def test_node_and_its_replica_holder_lost_is_a_clear_error(tmp_path, shm_root):
    # Ring placement on 3 nodes: rank 1's replica lives on node2. Lose both at once.
    res, _, events, _ = dprun(tmp_path, shm_root, spares=2, name="bothlost",
                              faults=[(3, "node1.0", signal.SIGKILL), (3, "node2.0", signal.SIGKILL)])
    assert res.returncode != 0
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert stopped and "no snapshot version is complete for every rank" in stopped[-1]["reason"]


from tests.store_fixtures import etcd_server  # noqa: E402,F401  (pytest fixture)


@pytest.mark.full_matrix(covered_by="tests/multihost (every bed job runs one launcher per host joined through a "
                                    "real etcd cluster)")
def test_two_launchers_joined_through_etcd(tmp_path, shm_root, etcd_server):  # noqa: F811 - the fixture above
    """Multi-host shape on one machine: two deadpool-run launchers (hosts) share an etcd store; a worker on the
    follower host dies, the coordinator fences that node through the store and a spare on its own host takes
    over."""
    import subprocess

    from deadpool_ext.testing.launch import kill_tree

    base = baseline(tmp_path, shm_root, 3)
    cfg = make_config(tmp_path, stage=3, deadpool={"local": {"shm_root": shm_root}})
    metrics = os.path.join(str(tmp_path), "mh.jsonl")
    timeline = os.path.join(str(tmp_path), "mh.timeline.jsonl")
    job = Job(script="scripts/pretrain_gpt.py", nnodes=3, nproc_per_node=1, spare_nodes=1, hosts=2, job_id="mhjob",
              store_url=etcd_server.store_url, shm_root=shm_root, config=cfg, args=("--train-iters", str(ITERS)),
              metrics=metrics, env_vars={"DEADPOOL_STORE_TOKEN": etcd_server.token})
    from deadpool_ext.testing.launch import REPO
    logs = [open(os.path.join(str(tmp_path), f"mh{i}.log"), "w") for i in (0, 1)]
    leader = subprocess.Popen(job.replace(host_rank=0, timeline=timeline).argv(), cwd=REPO, env=job.env(),
                              stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
    follower = subprocess.Popen(job.replace(host_rank=1).argv(), cwd=REPO, env=job.env(), stdout=logs[1],
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_step(metrics, 4, timeout_s=240, proc=leader)
        worker_proc(follower.pid, "node1.0").kill()
        assert leader.wait(300) == 0
        assert follower.wait(60) == 0
    finally:
        kill_tree(leader.pid)
        kill_tree(follower.pid)
        for fh in logs:
            fh.close()
    out = open(os.path.join(str(tmp_path), "mh0.log")).read()
    assert read_metrics(metrics) == base, out[-3000:]
    events = read_events(timeline)
    assert [e["replaced"] for e in events if e.get("event") == "assignment"] == [{"node1": "spare0"}]
    assert any(e.get("event") == "start" and e["store"].startswith("etcd://") for e in events)


def test_killed_launcher_leaves_no_shared_memory(tmp_path, shm_root):
    """Even a SIGKILLed launcher (no chance to clean up) leaves nothing in /dev/shm: the node agents remove the
    job's directories once the launcher is gone."""
    import subprocess

    from deadpool_ext.testing.launch import REPO, kill_tree

    cfg = make_config(tmp_path, stage=3, deadpool={"local": {"shm_root": shm_root}})
    metrics = os.path.join(str(tmp_path), "k.jsonl")
    job = Job(script="scripts/pretrain_gpt.py", nnodes=2, shm_root=shm_root, job_id="leakcheck", config=cfg,
              args=("--train-iters", "50"), metrics=metrics)
    proc = subprocess.Popen(job.argv(), cwd=REPO, env=job.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_step(metrics, 2, timeout_s=240, proc=proc)
        assert [d for d in os.listdir(shm_root) if d.startswith("deadpool.leakcheck.")]
        workers = [p for p in psutil.Process(proc.pid).children() if "python" in p.name()]
        proc.kill()  # the launcher only: its workers notice they are orphaned and leave
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers still running after their launcher died: {alive}"
    finally:
        kill_tree(proc.pid)
    deadline = time.time() + 15
    while time.time() < deadline and [d for d in os.listdir(shm_root) if d.startswith("deadpool.leakcheck.")]:
        time.sleep(0.2)
    assert not [d for d in os.listdir(shm_root) if d.startswith("deadpool.leakcheck.")]


def test_embedded_store_with_many_hosts_warns_that_host_0_is_a_single_point_of_failure(tmp_path):
    """No failover without etcd: a multi-host job on the embedded store says so at start, naming the fix."""
    import subprocess

    from deadpool_ext.testing.launch import REPO, kill_tree

    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(60)\n")
    job = Job(script=str(script), nnodes=2, hosts=2, host_rank=0, job_id="embwarn",
              env_vars={"DEADPOOL_STORE_TOKEN": "t" * 32})
    proc = subprocess.Popen(job.argv(), cwd=REPO, env=job.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.time() + 60
        while time.time() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "single" in line or "ends the job" in line or not line:
                break
        text = "".join(lines)
        assert ("--hosts 2 on the embedded store" in text and "losing host 0 ends the job" in text  # log-interface:
                and "--store-url etcd://" in text), text  # the warning's words tell the user the fix (etcd)
    finally:
        kill_tree(proc.pid)
