#!/usr/bin/env python
"""Which files in ``benchmarks/results/`` are the current results, and ``results/INDEX.md`` written from them.

``results/`` holds one current result per measurement, under a stable name, plus ``REPORT.md``; every older or
intermediate run lives in ``results/archive/`` under the name it was written with. ``CURRENT`` below is the one
list of what is current: ``run_all.py`` reads the report's inputs from it, the simulator's calibration
(``deadpool_ext/sim/calibration.py``) reads the files it names, and ``tests/unit/test_report.py`` checks that
every file at the top of ``results/`` belongs to an entry (so a new run cannot silently sit beside the current
one).

    python benchmarks/results_index.py            # rewrite results/INDEX.md
    python benchmarks/results_index.py --check    # exit 1 if a file is unaccounted for or INDEX.md is out of date

When a new run replaces a current result: ``git mv`` the old files into ``results/archive/``, give the new ones
the entry's stable name (``--name`` of the benchmark), update the entry here if its command or meaning changed,
and rewrite INDEX.md. Nothing here runs a benchmark; it reads the JSON files (command, machine, time) and git.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import REPO, RESULTS_DIR  # noqa: E402


@dataclass(frozen=True, slots=True)
class Current:
    stem: str
    """``results/<stem>.json`` and ``<stem>.md`` (only the ``.md`` when ``md_only``)."""
    benchmark: str
    """The report's name for it (``bench_<benchmark>.py``; ``chaos``: ``deadpool chaos``; ``report``: run_all)."""
    title: str
    """A few words for the summary table."""
    measures: str
    """What it measures, in one or two sentences."""
    companions: tuple[str, ...] = ()
    """Other files (relative to results/) that belong to this result: job logs, figures."""
    md_only: bool = False
    command: str | None = None
    """The command, where the result has no JSON that records it."""
    note: str = ""
    """Anything a reader must know: renamed from, stale, a quick run."""


CURRENT: tuple[Current, ...] = (
    Current("snapshot_overhead_recommended", "recommended",
            "overhead as recommended: deadpool-run + spare vs plain DeepSpeed, whole process tree",
            "Issue 45: GPT small, ZeRO-3, 2 ranks; 10 rounds of one fresh job per mode (order rotating): plain "
            "DeepSpeed with no extension (torchrun), attached but off (torchrun -m deadpool_ext.run, snapshots "
            "inactive), and deadpool-run --nnodes 2 --spare-nodes 1 (spare built ahead, a snapshot every step, "
            "replica on the other node); 8-step windows after 3 warm-up steps; CPU of the whole process tree from "
            "a cgroup made for each job (launcher, ranks, spare, helpers), split by process; every ratio paired "
            "with plain round by round (paired.py).",
            companions=("snapshot_overhead_recommended_logs",),
            note="Re-measured with the floor by `python -m benchmarks.refresh --only snapshot_overhead_recommended` "
                 "(rounds 1-5 under other engineers' load: window/step up to 3.2 s, then 1.2-1.3 s); the first run, "
                 "without the floor and under lighter load from round 4 (step 1.023 [0.891, 1.036], CPU 1.025 "
                 "[1.014, 1.033]), is `archive/snapshot_overhead_recommended_20261205.*`. DeepSpeed's CPU "
                 "shared-memory allreduce off in every mode (no LOCAL_SIZE), as under deadpool-run."),
    Current("snapshot_overhead_small_n2", "snapshot_overhead", "overhead counted whole: small, 2 ranks, every peer",
            "Issue 'honest numbers': GPT small, ZeRO-3, 2 CPU ranks on 2 simulated nodes (replica on), the shipped "
            "defaults with a snapshot every step; 10 interleaved rounds of 8-step windows of none / deadpool / "
            "DeepSpeed default / DeepSpeed decoupled (PYTHON writer: FAST needs a GPU) / DCP async_save (the "
            "captured tensors) / DLRover flash, each window ending when its last checkpoint is complete; window "
            "and CPU ratios with 90% CIs over rounds, the CPU floor and where the extra CPU goes.",
            companions=("snapshot_overhead_small_n2_small.log",),
            note="Run from a clean worktree with `--out /tmp/results` and copied here."),
    Current("snapshot_overhead_small_n4", "snapshot_overhead", "overhead counted whole: small, 4 ranks, every peer",
            "Issue 'honest numbers': the small_n2 job on 4 CPU ranks (2 per simulated node, 2 cores shared by all), "
            "the shipped defaults with a snapshot every step; 10 interleaved rounds of 8-step windows of none / "
            "deadpool / DeepSpeed default / DeepSpeed decoupled (PYTHON writer) / DCP async_save (the captured "
            "tensors) / DLRover flash; window and CPU ratios with 90% CIs, the CPU floor and where the extra CPU goes.",
            companions=("snapshot_overhead_small_n4_small.log",),
            note="Run from a clean worktree with `--out /tmp/results_n4` and copied here."),
    Current("snapshot_overhead_medium_n2", "snapshot_overhead", "overhead counted whole: medium, 2 ranks, DLRover",
            "Issue 'honest numbers': GPT medium (~125M), ZeRO-3 with activation checkpointing, 2 CPU ranks on 2 "
            "simulated nodes (replica on), the shipped defaults with a snapshot every step; 10 interleaved rounds of "
            "8-step windows of none / deadpool / DLRover flash; window and CPU ratios with 90% CIs, the CPU floor and "
            "where the extra CPU goes.",
            companions=("snapshot_overhead_medium_n2_medium.log",),
            note="Run from a clean worktree with `--out /tmp/results_m2` and copied here."),
    Current("snapshot_overhead_medium_n4", "snapshot_overhead", "overhead counted whole: medium, 4 ranks",
            "Issue 'honest numbers': GPT medium (~125M), ZeRO-3 with activation checkpointing, 4 CPU ranks (2 per "
            "simulated node, 2 cores shared by all, replica on), the shipped defaults with a snapshot every step; 10 "
            "interleaved rounds of 8-step windows of none / deadpool; window and CPU ratios with 90% CIs, the CPU "
            "floor and where the extra CPU goes.",
            companions=("snapshot_overhead_medium_n4_medium.log",),
            note="Run from a clean worktree with `--out /tmp/results_m4` and copied here. No peer in this job (a "
                 "round of two modes takes ~9 minutes): the peers are beside deadpool in the other three runs."),
    Current("snapshot_overhead_small_n2_differential", "snapshot_overhead",
            "diagnostic: TierCheck differentials, counted whole, small, 2 ranks",
            "The same job as snapshot_overhead_small_n2 with `differential.enabled: true` (a base every 10 steps, "
            "differentials of the gradients between) and modes none / deadpool / DLRover flash: whether "
            "differentials by default would lower the overhead counted whole (issue 'honest numbers', part 5). The "
            "gradient tap runs in deadpool's windows only. Not a headline: a diagnostic for a default not taken.",
            companions=("snapshot_overhead_small_n2_differential_small.log",),
            note="Written as `snapshot_overhead_small_n2_diff.*` (`--name`) into /tmp and renamed here: the archive "
                 "already holds an older `snapshot_overhead_small_n2_diff`."),
    Current("recovery", "recovery", "SIGKILL -> restored / next step: in place (spare built ahead, and not) vs "
            "rebuild vs relaunch, small + medium",
            "SIGKILL of one of 3 ranks, GPT small and medium, ZeRO-3, 3 nodes + 1 spare: the default path "
            "(hot_swap.in_place and spare_build_ahead true; the killed node is the one the spare built its engine "
            "for) beside the same path killing another node (the spare starts its script again), hot_swap.in_place "
            "false and kill + relaunch + DeepSpeed load_checkpoint in one run; phases from each job's timeline "
            "(agree split into assign, spare, communicators), kill -> every rank restored, kill -> next step, losses "
            "against the relaunched run and an uninterrupted one.",
            companions=("recovery_logs",),
            note="Run in the checkout with the default `--out`; the JSON was then re-analysed with `--rerender` "
                 "after a fix of the rerender path (no job re-run)."),
    Current("recovery_nodes", "recovery", "SIGKILL -> restored on every node in turn (issue 44): worst, expected, best",
            "GPT small, ZeRO-3, 3 nodes + 1 spare (built ahead for node1), the default config: each active node's "
            "worker SIGKILLed mid-step in turn, 3 runs per node, beside the rebuild path and kill + relaunch + "
            "DeepSpeed load_checkpoint in the same run (bench_recovery.py --per-node, the default); per node min / "
            "median / max of kill -> every rank restored and of kill -> next step, how the spare took the ranks "
            "(as built, relabelled in place, started again), losses against the relaunched and an uninterrupted run; "
            "the worst node is the headline, the expected value and the best beside it.",
            companions=("recovery_nodes_logs",),
            note="`python benchmarks/bench_recovery.py --sizes small --repeats 3 --settle-s 20 --name recovery_nodes`, "
                 "run with --out elsewhere and copied here. The run before on the same behaviour (recovery_nodes_"
                 "0c7f157, before a refactor) met the restore target but not 10x on its worst node (9.4x): the "
                 "speedup of the worst node sits near 10x and moves with the host's load."),
    Current("recovery_nodes_medium", "recovery", "SIGKILL -> restored on every node in turn, GPT medium (issue 44)",
            "The same as recovery_nodes for GPT medium (124.9M parameters): each active node killed in turn, 3 runs "
            "per node, beside the rebuild path and kill + relaunch + load_checkpoint in the same run; the issue's "
            "target for medium is 2.0 s on every node.",
            companions=("recovery_nodes_medium_logs",),
            note="`python benchmarks/bench_recovery.py --sizes medium --repeats 3 --settle-s 20 --name "
                 "recovery_nodes_medium` (39 min)."),
    Current("five_swaps", "five_swaps", "five consecutive hot-swaps, each spare replaced by a joining machine",
            "Issue 'the spare ready', part 4: GPT small, ZeRO-3, 3 nodes + 1 spare under deadpool-run; five times "
            "the worker holding rank 1 SIGKILLed once the waiting spare has built its engine, then a machine joins "
            "(--join) and becomes the next spare; per swap kill -> restored and -> next step from the timeline, "
            "the survivors' RSS before the first kill and at the last step, losses against an uninterrupted run.",
            companions=("five_swaps_logs",)),
    Current("five_swaps_any_node", "five_swaps", "five consecutive hot-swaps killing a different node each time",
            "Issue 44: bench_five_swaps.py with --kill-ranks 1,2,1,2,1 (the default): GPT small, ZeRO-3, 3 nodes + "
            "1 spare; five SIGKILLs of the holder of rank 1, 2, 1, 2, 1 in turn (a different process and node each "
            "time), each spare replaced by a joining machine that builds ahead for rank 1, so two of five swaps take "
            "ranks the spare did not build for (relabelled in place) and rank 0's holder survives all five; per swap "
            "how the spare took the ranks, kill -> restored and -> next step; the memory of rank 0's holder, which "
            "survives all five, against the same job run without kills over the same windows by step (its RSS, and "
            "glibc's bytes in use from benchmarks/heap_probe/, the judged figure); losses against an uninterrupted "
            "run.",
            companions=("five_swaps_any_node_logs",),
            note="One run of four on this code (2026-12-07): the next-step target was missed by one swap in two of "
                 "them (archive five_swaps_any_node_rss_control, and this one), met for every swap in the other "
                 "two (five_swaps_any_node_7aa236d, five_swaps_any_node_rss_control2). Survivor RSS against the run "
                 "without kills in the three runs with a control: x1.065, x1.030, x1.009; bytes in use (this run "
                 "only) x1.001."),
    Current("recovery_trainer", "trainer_recovery", "an unmodified HF Trainer job: hot-swap vs its own relaunch",
            "Issue 'the spare ready', part 3: scripts/examples/hf_trainer.py (GPT-2 of 2 layers, ZeRO-3 through "
            "Accelerate), 2 ranks + 1 spare under deadpool-run, a worker SIGKILLed mid step: the node the spare "
            "built for, another node, and torchrun + the Trainer's own per-step checkpoint relaunched with "
            "resume_from_checkpoint; kill -> restored, kill -> next step, losses against an uninterrupted run; "
            "2 repeats, kinds rotated.",
            companions=("recovery_trainer_logs",),
            note="Run with `--out /tmp/trainer_freeze` and copied here (the run after the in-place runtime's "
                 "gc.freeze at attach; the run before it: 0.13 s to restored, 0.86 s to the next step)."),
    Current("regression_issue31", "regression", "no regression from issue 31's redesign (recovery, overhead)",
            "Issue 'one recovery path': the recovery (GPT small, 3 ranks + 1 spare, in-place hot-swap, SIGKILL; 2 "
            "rounds per commit, order swapped) and overhead (GPT small, 2 ranks, none/deadpool, 10 interleaved "
            "rounds of 8-step windows) benchmarks of the commit before the work (d4c3917) and of the finished work "
            "(fe894dd: all eight parts; it also holds issue 32's spare built ahead, hence the faster recovery), "
            "each commit with its own code, alternated in one run on one machine.",
            note="The runs took 881 s (16:36-16:51 UTC). The first analysis read no figures: the benchmarks, "
                 "each run in its worktree, had written their results under a relative --out there. The check "
                 "now makes --out absolute and never says 'no regression' without figures; the analysis was run "
                 "again with --reuse on the same runs (the 'total wall 2 s' and the load are that re-run's). The "
                 "earlier runs (c8ee75b at 05:53, a71277d at 11:13) also found no regression; this one replaces "
                 "them."),
    Current("recovery_hosts", "hosts", "recovery across hosts (namespace bed): host and coordinator lost",
            "Issue 'many hosts': 3 hosts as network namespaces with a 3-member etcd, one deadpool-run per host, GPT "
            "small, ZeRO-3, 3 nodes + 2 spares: a follower host and the coordinator's host SIGKILLed whole, beside "
            "the same job on one host losing one worker; phases, takeover time, losses bit for bit; 2 repeats."),
    Current("recovery_hosts_reports", "hosts", "a follower host lost: detection with the survivors' reports off and on",
            "Issue 'the spare ready', part 2: a follower host SIGKILLed whole on the namespace bed (3 hosts, 3-member "
            "etcd, GPT tiny, ZeRO-3, 3 nodes + 2 spares), --suspect-age-s 0 (reports off: the heartbeat timeout) "
            "and the default (1.5 x --heartbeat-s) alternated repeat by repeat in one run, 3 repeats each; phases "
            "from the timeline, losses bit for bit.",
            note="Run with `--out /tmp/hosts_cmp` and copied here. Detection is what changed; the next generation "
                 "is still published when the dead host's lease lapses (--leader-ttl-s 4), so the total is not "
                 "shorter."),
    Current("chaos_bed", "chaos", "host-level chaos on the namespace bed, 24 trials",
            "`deadpool chaos --bed`: host loss, coordinator loss, partition with heal, etcd member loss, etcd quorum "
            "loss and a stuck rank, each on a fresh 3-host bed with a 3-member etcd, over ZeRO-1/2/3 and Megatron "
            "TP2; losses bit for bit against a fault-free run on a bed.",
            command="deadpool chaos --bed --trials 24 --seed 0 --json",
            note="Two rows failed on the checker (a stuck rank 0 never logs its step's loss line) and were replayed "
                 "with the fixed checker; both rows and replays are in the JSON."),
    Current("chaos_200", "chaos_200", "the 200-trial campaign over every fault kind (in pieces)",
            "150 single-host trials (the catalogue's eleven faults over ZeRO-1/2/3 and Megatron TP2) and 50 bed "
            "trials (the six host-level faults), seed 200: recovered, fallbacks per tier, state mismatches, silent "
            "hangs; run across sessions from the journal.",
            companions=("chaos_200.jsonl",),
            note="The `.md` says how many of the 244 trials are done (200 + 44 planner-2 cover trials of seed 201, "
                 "every fault on every layout); `bench_chaos_200.py` continues the rest."),
    Current("elastic", "elastic", "elastic shrink vs relaunch at fewer ranks, GPT small",
            "A node of two ranks SIGKILLed with no spare left, dp 4 -> 2, ZeRO-1 and ZeRO-3: SIGKILL to the first "
            "step after it with --no-spare-policy shrink (resharded from memory) against stopping and relaunching "
            "on 2 ranks with --load (DeepSpeed's universal checkpoint conversion); shrink losses against the "
            "uninterrupted run."),
    Current("spare_slots", "spare_slots", "a spare's slots made while it waits vs at its restore",
            "The hot-swap job of bench_recovery (GPT small, ZeRO-3, 3 nodes + 1 spare, node1.0 SIGKILLed mid-step) "
            "in interleaved pairs with deadpool-run --spare-slots prepare / at-restore: the spare's restore call, "
            "spare and survivors restored, SIGKILL to the next step; per-pair differences.",
            companions=("spare_slots_logs",)),
    Current("fetch_check", "fetch_check", "a fetched replica checked while it arrives vs after",
            "Two ranks, one gloo group: a snapshot blob of a rank's captured state (139 MiB: GPT small at 2 ranks; "
            "357 MiB: medium at 4) fetched and checked before use, in 16 MiB pieces hashed as they land against one "
            "message then every checksum, 30 interleaved pairs; transfer and check alone in the same run."),
    Current("persist", "persist", "tier-3 persist throughput, small",
            "Tier-3 bases persisted in the background, GPT small, 4 ranks: throughput against the disk bandwidth "
            "measured in the same run, time to a persisted base, capture time.",
            companions=("persist_small.log",)),
    Current("persist_medium", "persist", "tier-3 persist throughput, medium", "The same for GPT medium (2 pairs).",
            companions=("persist_medium.log",),
            note="Written into a scratch directory (`--out /tmp/pm`) and copied here under this name."),
    Current("differential", "differential", "differential size and fused replay",
            "TierCheck differentials, GPT small, ZeRO-3, 4 ranks, base every 10 steps: differential vs base size, "
            "fused vs stepwise replay (both Adam kernels), blocking per checkpoint."),
    Current("megatron", "megatron", "Megatron-Core: overhead and a hot-swap",
            "Megatron-Core path: snapshot overhead (PP2 x DP2) and a hot-swap recovery (TP2), GPT small.",
            companions=("megatron_logs",),
            note="A `--quick` run, the only one: bench_megatron.py has no `--out`, so run_all.py does not run it."),
    Current("megatron_nodes", "megatron_nodes", "a Megatron-Core job, every node killed: hot-swap vs relaunch + --load",
            "Issue 44, parts 3 and 4: scripts/pretrain_gpt_megatron.py (GPT tiny, TP2 x DP2: 2 nodes of 2 ranks + 1 "
            "spare node under deadpool-run, today's defaults: the in-place swap, the spare built ahead for node1); "
            "per repeat node1 killed (the spare built for it), node0 killed (the spare relabelled in place), node0 "
            "killed on the rebuild path (hot_swap.in_place: false), and torchrun with a tier-3 base every iteration "
            "relaunched with --load; kill -> restored (min, median, max), kill -> next iteration, losses against "
            "an uninterrupted run; 3 repeats, kinds rotated.",
            companions=("megatron_nodes_logs",)),
    Current("megatron_nodes_pp2", "megatron_nodes",
            "the spare's fallback: another pipeline stage, from its warm parent",
            "Issue 44, the fallback: the same Megatron-Core job with `--layout pp2` (PP2 x DP2: node0 holds stage 0, "
            "node1 stage 1). The spare built for node1 cannot take stage 0 in place, so node0's loss starts it again "
            "from its script's first line, as a fresh child of its warm parent (rebuild/warm.py); against the "
            "rebuild path (hot_swap.in_place: false) and relaunch + --load in the same run, 6 repeats, kinds "
            "rotated; the fallback judged against the rebuild path round by round, paired.",
            companions=("megatron_nodes_pp2_logs",)),
    Current("chaos", "chaos", "chaos campaign, 12 trials",
            "Chaos campaign: 12 seeded fault trials over ZeRO-1/2/3 and Megatron TP2 (kills in replication, "
            "recovery and persist windows, corrupted copies), each checked against a fault-free baseline."),
    Current("chaos_tier3_rerun", "chaos", "chaos tier-3 trials rerun after a fix",
            "The three tier-3 trials of the chaos campaign (4, 5, 6) rerun after the fix of the tier-3 hook, which "
            "made them inject nothing in chaos.md.", md_only=True,
            command="deadpool chaos --seed 2 --trial 4 --trial 5 --trial 6"),
    Current("fuzz", "fuzz", "fuzzing campaign, 30 targets x 10,000 cases",
            "Property-based fuzzing of every parser that reads untrusted bytes (snapshot blobs and headers, commit "
            "records and manifests, store frames and the live server, control messages, RNG JSON, config, "
            "launcher flags, pid files, names): cases run per target and the outcome.",
            command="python benchmarks/bench_fuzz.py --examples 10000 --seed 20261201"),
    Current("inplace_swap", "inplace_swap", "in-place communicator swap vs engine rebuild (hot-swap)",
            "GPT small, ZeRO-3, 3 ranks + spares: hot-swap phases with hot_swap.in_place false (every rank rebuilds "
            "its engine) and true (survivors keep it, communicators swapped beneath), pairs interleaved; survivor "
            "memory (RSS, anonymous, shared) over five consecutive hot-swaps, beside the same job without failures.",
            companions=("inplace_swap_logs",)),
    Current("peer_sign", "peer_sign", "cost of signing the peer channel's blobs",
            "HMAC-SHA256 tags on tier-2 snapshot blobs (a checkpoint key set), signed vs unsigned side by side: tag "
            "throughput, one 2-rank gloo round (16 and 128 MiB), and GPT-small step time with a snapshot every step "
            "replicated to the other simulated node (2 job pairs, alternating)."),
    Current("simulate", "simulate", "simulated goodput, 512-16,384 GPUs",
            "Simulated (not measured) goodput of every policy from 512 to 16,384 GPUs at Llama 3's failure rate, "
            "costs calibrated from this project's current results (each cost's source in simulate.md); "
            "Young/Daly checks.",
            companions=("simulate_goodput.png", "simulate_breakdown.png", "simulate_young_daly.png")),
    Current("simulate_shrink", "simulate_shrink", "simulated goodput without spares: fail / wait / shrink",
            "Simulated (not measured) goodput at 16,384 GPUs with 0, 4, 16 and 64 spare nodes when the pool runs "
            "dry: the job stops (fail), waits for repaired nodes (wait) or goes on with fewer data-parallel "
            "replicas and grows back (shrink); DeadPool hot-swap at fixed intervals, plus 16-node replicas and the "
            "whole-job restart policies at 4 spares; seeds 0-2 x 20 trials x 30 days."),
    Current("simulate_stragglers", "simulate_stragglers",
            "simulated goodput with stragglers (kept / evicted) and preemptions (killed / drained)",
            "Issue 46, part 5: simulated (not measured) goodput at 16,384 GPUs (deadpool_ext/sim/stragglers.py): "
            "straggler episodes (rate per node-day x slowdown, both typed-in assumptions, swept) kept vs evicted "
            "into spares one window after their onset at the calibrated hot-swap + restore cost (recovery.json), "
            "with 21 and 4 spares; preemptions per day killed (half a tier-3 interval recomputed) vs drained "
            "(preempt.json's fixed cost + the write); 20 trials x 30 days per row."),
    Current("tutorial_scripts", "tutorial_scripts",
            "DeepSpeed tutorial-style scripts, the section alone: hot-swap, restart, relaunch",
            "Issue 43: scripts/examples/ds_tutorial_mlm.py (BERT masked LM, own DataLoader, in-code config, "
            "load_checkpoint/save_checkpoint with the step in client_state) and ds_tutorial_pipe.py (a 2-stage "
            "PipelineModule, train_batch()), 2 ranks, a SIGKILL after step 9: deadpool-run hot-swap on the node the "
            "spare built for and on the other node, torchrun restart from memory, and plain torchrun relaunch + "
            "disk load (a checkpoint every step, a cut-short newest one passed over); kill -> the step after the one "
            "in flight, paired by round against the relaunch; losses against an uninterrupted run, 3 rounds.",
            companions=("tutorial_scripts_logs",)),
    Current("straggler_rule", "straggler_rule", "the straggler rule's cost per coordinator turn, 256-16,384 ranks",
            "Issue 46, part 1: one judge() turn in which the rule runs over a full window (8 ranks a node, one node "
            "three times slower), 15 turns per size, in one process; each turn checked to evict the slow node "
            "alone."),
    Current("straggler", "straggler", "a throttled node swapped for a spare vs kept",
            "Issue 46, part 1: GPT tiny, ZeRO-1, deadpool-run 2 nodes + 1 spare; after step 20 node1's worker in a "
            "cgroup of 0.1 of one core (CFS quota) until it exits or the job ends; --straggler-action swap vs "
            "report (named, kept), alternating, 4 rounds: onset -> named / swap published / training again, "
            "throughput before, during and after, onset -> last step paired per round, the losses of both "
            "compared."),
    Current("preempt", "preempt", "SIGTERM -> verified version -> bit-identical --load resume",
            "Issue 46, part 3: GPT tiny, ZeRO-3, deadpool-run 2 nodes + 1 spare, --preempt-grace-s 30; 25 trials, "
            "each a SIGTERM landed from inside the job (mid-backward, during a snapshot copy, during a throttled "
            "tier-3 write, during a hot-swap's restore, to one worker only) at a random step: SIGTERM -> verified "
            "commit record p50/p100 against the 30 s budget, exit status 75, the base verified, and a --load "
            "relaunch's losses against an uninterrupted run's, bit for bit."),
    Current("slurm", "slurm", "node down under a real Slurm: deadpool spare vs requeue + relaunch",
            "Issue 47: GPT small, ZeRO-3, 3 nodes x 1 process on the namespace Slurm bed (slurmctld, slurmd per "
            "host, munge); one node's slurmd and processes SIGKILLed after step 3: node down -> every rank "
            "restored for deadpool-run's spare (sbatch --nodes 4) against Slurm's requeue + relaunch with --load, "
            "modes alternated on fresh beds; the losses of both against an uninterrupted run.",
            note="two runs per mode, one shared the 2 cores with a test run (deadpool 15.2 vs 34.1 s): re-run for "
                 "a quiet spread"),
    Current("slurm_preempt", "slurm_preempt", "preempted under a real Slurm, then requeued: drain vs relaunch",
            "Issue 47, Measure: GPT small, ZeRO-3, 3 nodes x 1 process on the namespace Slurm bed; a job of partition "
            "urgent (PreemptMode=REQUEUE) needing every node submitted after step 3: for deadpool-run (sbatch "
            "--nodes 4, --save/--load) when the SIGTERM was heard and the newest step verified on tier 3, and for "
            "both it and the relaunch (torchrun, a checkpoint every step, --requeue) the steps trained again, when "
            "the requeued run started and logged its first step (Slurm's cred_expire, 120 s, holds it); losses of "
            "both runs together against an uninterrupted run."),
    Current("REPORT", "report", "all of the above with figures",
            "Everything above in one page with figures, rendered from the current results by "
            "`python benchmarks/run_all.py --report-only` (no benchmark run).", md_only=True,
            companions=("report_overhead_vs_interval.png", "report_blocking.png", "report_recovery.png",
                        "report_persist.png", "report_memory.png"),
            command="python benchmarks/run_all.py --report-only"),
)

# Why the archived runs were kept, for the archive table of INDEX.md (stem -> reason). Stems not named here are
# listed with the generic reason.
ARCHIVE_NOTES: dict[str, str] = {
    "slurm_preempt_first": "the first preemption run, one per mode: deadpool heard the SIGTERM at 1.37 s, step 4 "
                           "verified on tier 3 at 5.75 s, none lost, the requeued run's first step at 162.75 s; the "
                           "relaunch lost 1 step (its checkpoint of step 3 cut), first step at 140.92 s",
    "megatron_nodes_pp2_7aa236d": "the PP2 x DP2 run of the stop before, 3 rounds, judged on two medians: the warm "
                                  "fallback 3.18 s against the rebuild path's 2.99 s (3.03-3.26 s against "
                                  "2.97-3.00 s), slower in all three rounds",
    "five_swaps_any_node_7aa236d": "the five swaps of the stop before, on the same deadpool_ext code as today's: "
                                   "swaps 0.53-0.82 s, next step minus a quiet step 0.45-0.92 s, node0.0's RSS "
                                   "x1.0501 over its own before the first kill (no control run then)",
    "five_swaps_any_node_rss_control2": "the second run with the control, its allocator probe silent (its folder was "
                                        "never made): node0.0's RSS x1.030 against the run without kills (2064 MB "
                                        "against 2003 MB), x1.054 over its own before the first kill, the control's "
                                        "own x1.044; swaps 0.47-0.76 s, every next step within a step + 1.0 s",
    "five_swaps_any_node_rss_control": "the first run with the control (the job without kills, same windows), the "
                                       "memory judged on RSS against it: node0.0 x1.065 (2165 MB against 2034 MB), "
                                       "the control's own RSS x1.061 over the same steps; swap 4's next step 1.44 s "
                                       "over a normal one (2.88 s, the steps around it 3.2-3.8 s). An in-process "
                                       "probe then showed glibc holding 700-850 MB of free heap in both runs, the "
                                       "bytes in use flat across the swaps: the run after judges those",
    "five_swaps_any_node_35b1656": "the first run with every kill after a quiet step and the memory on 12-s medians, "
                                   "on the stop-55 code: swaps 0.47-0.93 s; next step minus a quiet step 0.30-1.39 s "
                                   "(3 of 5 over the 1.0 s margin, the redone step up to 0.58 s slower than a quiet "
                                   "one while the spare faulted in its replica buffers); node0.0 x1.048",
    "five_swaps_any_node_0601b76": "the first of three five-swap runs on the stop-55 code, kills at fixed steps 3, 6, "
                                   "9, 12, 15 (the normal step then the median of steps 2 and 3 alone, step 2 with the "
                                   "first replication's page faults) and the memory judged on one RSS sample each: "
                                   "swaps 0.65-0.89 s, next step over by up to 1.18 s, node0.0 x0.989",
    "five_swaps_any_node_thp_probe": "a probe, not a result on the defaults: the same five swaps with every process "
                                     "under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for glibc's "
                                     "heap; the host's THP mode is madvise): a killed worker is reaped sooner (detect "
                                     "0.06-0.17 s against 0.12-0.46 s) and a normal step is faster (2.82 s against "
                                     "3.19 s), but step 1 took 5.8 s and node0.0's RSS x1.099: not adopted",
    "five_swaps_any_node_repeat2": "the second of three five-swap runs on the stop-55 code, for the memory "
                                   "judgement: swaps 0.51-0.86 s, node0.0 x1.003",
    "five_swaps_any_node_repeat3": "the third of three five-swap runs on the stop-55 code: swap 3 took 60.4 s "
                                   "(59.8 s in the communicators phase, one collective timeout: a survivor that had "
                                   "joined as a spare did not cut its dead generation's connections), the others "
                                   "0.51-0.76 s; node0.0 x0.863",
    "recovery_nodes_medium_probe_637f8fb": "a probe of GPT medium, one run per node, before the background drop of a "
                                           "failed node's memory: worst node node0 2.08 s; superseded by "
                                           "recovery_nodes_medium",
    "recovery_nodes_07bb27c": "every node killed in turn before the warm parent and the background drop of a failed "
                              "node's memory: worst node node2 0.64 s, 17.1x",
    "recovery_nodes_medium_e9f3076": "GPT medium before the restore stopped making the replica buffers: worst node "
                                     "2.79 s",
    "five_swaps_any_node_637f8fb": "five swaps before the warm parent and the background drop: 0.51 / 0.60 / 0.73 / "
                                   "1.05 / 0.71 s",
    "megatron_nodes_2fc8dc2": "the Megatron-Core job (TP2 x DP2) before the warm parent: worst node node0 0.58 s, "
                              "26.6x",
    "recovery_trainer_2fc8dc2": "the HF Trainer job before the warm parent: worst node node0 0.17 s, 43.2x",
    "megatron_nodes_relabel_first": "the first run after the Megatron relabel; re-measured on the final code of the "
                                    "stop (node0 0.61 s, node1 0.60 s)",
    "five_swaps_any_node_f752fd2": "the run of the stop before (kill pattern 1,2,1,2,1): swaps 1-2 0.75 / 0.85 s, "
                                   "swaps 3-5 1.01-1.30 s on a slow evening host",
    "recovery_nodes_a1e1cbc": "every node killed in turn on the code of the stop before: worst node node1 0.69 s, "
                              "11.5x",
    "megatron_nodes_f752fd2": "the Megatron-Core job on the code of the stop before: worst node node0 0.66 s, 25.7x",
    "five_swaps_any_node_120": "kill pattern 1,2,0 (no worker survived all five swaps; the memory target judged on "
                               "workers that had joined for the last ones)",
    "megatron_nodes_start_again": "the Megatron-Core job before its spare could take another data-parallel replica's "
                                  "node (issue 44): node0's loss started the spare again, 4.10 s",
    **{f"{stem}_20261205": "calibrated with a node no spare built for at 4.11 s (the spare started its script "
                           "again, recovery.json's unready runs), before the relabel's 0.15 s (recovery_nodes.json)"
       for stem in ("simulate", "simulate_breakdown", "simulate_goodput", "simulate_young_daly")},
    "snapshot_overhead_recommended_20261205": "the first run of the recommended setup's overhead (issue 45), "
                                              "before the floor was measured in its jobs",
    **{f"{stem}_steponly": "timed each step without the checkpoint work still running after it (the rule before "
                           "issue 'honest numbers'); superseded by the window rule"
       for stem in ("snapshot_overhead", "snapshot_overhead_medium_ab", "snapshot_overhead_small_n2",
                    "snapshot_overhead_small_n4", "snapshot_overhead_medium_n2", "snapshot_overhead_medium_n2_dlrover",
                    "snapshot_overhead_medium_n4", "peers")},
    "recovery_small_2026-11-30": "GPT small, measured before the in-place swap became the default (every rank "
                                 "rebuilt); superseded by the current recovery, which runs both paths",
    "recovery_medium_2026-11-30": "GPT medium, the same: before the in-place default",
    "inplace_swap_single_trim": "the in-place swap before the catch-up trim and bounded heap arenas (code 85a462f): "
                                "survivor RSS x1.08-1.13 over 5 swaps (single-step peaks); rebuild 1.49 -> 0.016 s",
    "recovery_nodes_agent_on_path": "the first per-node run (issue 44, code 509c3c2): the spare started its node "
                                    "agent after its assignment (0.10-0.17 s on the critical path); worst node 1.17 s, "
                                    "6.0x; superseded by recovery_nodes",
    "recovery_nodes_0c7f157": "every node killed in turn, code 0c7f157 (load 1.5-1.7): worst node node0 0.74 s "
                              "(9.4x relaunch + load's 6.91 s), expected 0.68 s (10.1x), best 0.65 s (10.6x)",
    "tutorial_scripts_6d59463": "the tutorial-style scripts before a plain loop's end and the loop counters before "
                                "the first save were built (issue 43, code 6d59463)",
    "recovery_nodes_2aed3ce": "every node killed in turn, before the relaunch's floor was measured (issue 44, code "
                              "2aed3ce): worst node node2 0.69 s, 10.3x relaunch + load",
    "recovery_trainer_start_again": "the HF Trainer job before its spare could relabel (issue 44, 2026-12-04): the "
                                    "other node 4.52 s to restored, the spare starting its script again",
    "recovery_nodes_loaded_host": "every node killed in turn on a host at load 3.8-4.6 (issue 44, code e242131): "
                                  "worst node node2 1.25 s (7.7x relaunch + load's 9.62 s), expected 0.90 s, best "
                                  "0.69 s",
    "five_swaps_any_node_abandon_2s": "five swaps killing a different node each time with a stuck snapshot worker "
                                      "abandoned after 2 s (issue 44, code 9d9d73a): restored 0.68 / 0.68 / 0.89 / "
                                      "2.71 / 0.84 s, swap 4 waiting the 2 s",
    "five_swaps_any_node_agent_on_path": "the first five swaps killing a different node each time (issue 44, code "
                                         "5056da3), the spare's node agent started after its assignment; restored "
                                         "0.74-1.14 s",
    "recovery": "first full run (small x2 + medium baseline), code 24a8763c",
    "recovery_code80fb1043": "run of deadpool_ext 80fb1043",
    "recovery_small_rerun": "rerun of 80fb1043 (small)",
    "recovery_hang_tiny_hotswap": "a tiny hot-swap recovery that hung (stacks in the .log); evidence for the hang "
                                  "described in benchmarks/README.md",
    "recovery_medium_trial": "medium trial that showed hot-swap did not fit 24 GiB without the malloc settings",
    "recovery_small_fence": "after the fence and spare pre-warm",
    "recovery_small_warm": "warm spares, init-free rebuild",
    "recovery_medium": "GPT medium after the malloc setting (code 3fc63fb7); superseded by the current recovery_medium",
    "recovery_small_derive": "derived parameter buffers",
    "recovery_small_watch": "0.1 s assignment watch (no effect)",
    "recovery_small_unsynced": "rebuild without DeepSpeed's weight broadcast",
    "recovery_small_notice": "survivors stop their step on the launcher's notice",
    "recovery_medium_notice": "GPT medium, same code as recovery_small_notice",
    "recovery_quick": "--quick smoke run",
    "persist_quick": "--quick smoke run",
    "snapshot_overhead_quick": "--quick smoke run",
    "snapshot_overhead_diag": "tier-1 vs tier-2 cost (deadpool_t1), older code 29a3d5d8",
    "snapshot_overhead_small_n4_idle_noboost": "the 4-rank run before the boost (code 57e034d): `deadpool` at normal "
                                               "priority then, `deadpool_idle` = SCHED_IDLE without a boost "
                                               "(paired 1.012 vs 0.995): run-to-run spread beside the current run",
    "snapshot_overhead_small_n2_diff": "2 ranks with TierCheck differentials (base every 10 steps), 10 rounds x 10 "
                                       "steps: paired 1.025 (its memory line is against the full-snapshot bound; "
                                       "the differential ring holds more)",
    "inplace_swap_auto_priority_release_true": "memory part with snapshot.worker_priority auto (then the default) on "
                                               "3 ranks / 2 cores: the first recovery failed (a survivor's worker "
                                               "still blocked in the replication of the step before the kill 30 s "
                                               "later); why the default went back to normal (written as "
                                               "inplace_swap_release_memory_true)",
    "inplace_swap_auto_priority_release_false": "the same with hot_swap.release_memory false: the snapshot of the step "
                                                "before the kill was still replicating 1.7 s into the next step, so "
                                                "the recovery fell back to the step before (two steps redone); the "
                                                "benchmark's kill schedule stopped there (written as "
                                                "inplace_swap_release_memory_false)",
    "inplace_swap_release_memory_true": "5 in-place swaps at normal worker priority, hot_swap.release_memory true: "
                                        "survivor RSS x1.075 / x1.074; first step after each swap 2.35 s against "
                                        "2.00 s for the step after it (medians)",
    "inplace_swap_release_memory_false": "the same with release_memory false: 2 of 5 kills happened (the kill schedule "
                                         "stopped, the job was fine); first steps after the 2 swaps 2.14 / 2.17 s "
                                         "against 1.84 / 1.93 s",
    **{f"inplace_swap_abandon_auto_{i}": (f"five in-place swaps at worker_priority auto after the fix (code 9415a28, "
                                          f"written as abandon_auto_{i}): every run trains to step 14, final loss "
                                          "bit-identical to the no-failure job, stuck replication workers abandoned "
                                          "(run 1: 2, run 2: 1, run 3: 2) where 2 of 3 runs were lost before")
       for i in (1, 2, 3)},
    "snapshot_overhead_small_n2_first": "the first 2-rank run (code 17a346f, worker at normal priority), same "
                                        "settings: paired 1.044 as in the current run",
}
QUICK_DIR_NOTE = ("`archive/quick/`: the `run_all.py --quick` smoke run of 2026-11-29 16:13 (every benchmark's "
                  "--quick mode, tiny models) that the previous REPORT.md was rendered from")


# -- reading the results ------------------------------------------------------------------------------
def files_of(entry: Current) -> list[str]:
    """Every file or folder (relative to results/) that belongs to an entry."""
    own = [f"{entry.stem}.md"] if entry.md_only else [f"{entry.stem}.json", f"{entry.stem}.md"]
    return own + list(entry.companions)


def current_stems(benchmark: str) -> list[str]:
    """Stems of the current results of one benchmark, in CURRENT's order (the report's inputs)."""
    return [e.stem for e in CURRENT if e.benchmark == benchmark and not e.md_only]


def unaccounted(results_dir: str = RESULTS_DIR) -> list[str]:
    """Top-level entries of results/ that no CURRENT entry claims (INDEX.md and archive/ aside)."""
    claimed = {f for e in CURRENT for f in files_of(e)} | {"INDEX.md", "archive"}
    return sorted(n for n in os.listdir(results_dir) if n not in claimed)


def missing(results_dir: str = RESULTS_DIR) -> list[str]:
    """Files CURRENT names that are not there."""
    return [f for e in CURRENT for f in files_of(e) if not os.path.exists(os.path.join(results_dir, f))]


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _git_last(path: str) -> str | None:
    """Short hash and date of the last commit that touched ``path``, or None (no git, not committed). Used only for
    results whose file records no time of its own (the chaos markdown): such files are written once, when run."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %ad", "--date=format:%Y-%m-%d %H:%M", "--",
                              os.path.relpath(path, REPO)], cwd=REPO, capture_output=True, text=True, timeout=20,
                             check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def _written_on(path: str) -> str | None:
    """The date a report states it was written ("Written by `...` on 2026-11-30 10:00 UTC")."""
    import re

    try:
        with open(path) as fh:
            m = re.search(r"^Written by .*? on (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", fh.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def when_text(entry: Current, doc: dict[str, Any] | None, results_dir: str) -> str:
    """When a result was produced: the JSON's own clock first, then what the file says, then git."""
    t = run_time(doc)
    if t:
        return f"{t} (machine.time_utc in the JSON)"
    path = os.path.join(results_dir, files_of(entry)[0])
    w = _written_on(path)
    if w:
        return f"{w} (stated in the file)"
    g = _git_last(path)
    return f"not in the file; committed {g}" if g else "not recorded"


def machine_text(m: Any) -> str:
    """One line about the machine a result was measured on, from the ``machine`` field of its JSON."""
    if isinstance(m, str):  # hand-written description (chaos.json)
        return m
    if not isinstance(m, dict):
        return "not recorded"
    v = m.get("versions") or {}
    mem = m.get("mem_total_bytes")
    load = m.get("loadavg") or []
    parts = [f"{m.get('cpu_count', '?')} CPUs ({m.get('cpu_model', '?')})",
             f"{mem / 2**30:.1f} GiB RAM" if mem else None,
             f"load {load[0]:.1f} at start" if load else None,
             ", ".join(f"{k} {x}" for k, x in v.items() if x) or None]
    return "; ".join(p for p in parts if p)


def run_time(doc: dict[str, Any] | None) -> str | None:
    m = (doc or {}).get("machine")
    return m.get("time_utc") if isinstance(m, dict) else None


def code_text(doc: dict[str, Any] | None) -> str | None:
    m = (doc or {}).get("machine")
    if not isinstance(m, dict):
        return (doc or {}).get("code")
    commit = ((m.get("git") or {}).get("commit") or "")[:8]
    digest = (m.get("source_digest") or {}).get("deadpool_ext")
    dirty = " (dirty)" if (m.get("git") or {}).get("dirty") else ""
    return f"git {commit}{dirty}, deadpool_ext digest {digest}" if commit or digest else None


# -- INDEX.md -----------------------------------------------------------------------------------------
def render_index(results_dir: str = RESULTS_DIR) -> str:
    L = ["# Current benchmark results", "",
         "One current result per measurement; older and intermediate runs are in [`archive/`](archive/) under "
         "their original names (table at the end). Generated by `python benchmarks/results_index.py` from each "
         "result's own JSON (command, machine, time) and `git log`; the list of what is current is `CURRENT` in "
         "`benchmarks/results_index.py`. How each benchmark works: `benchmarks/README.md`. All machines: the "
         "shared 2-core CPU host this project is developed on (other engineers' tests ran at the same time, so "
         "absolute times are noisy; ratios come from A/B-interleaved runs within one job).", "",
         "| result | benchmark | when (UTC) | what |", "|---|---|---|---|"]
    docs = {e.stem: (None if e.md_only else _load(os.path.join(results_dir, f"{e.stem}.json"))) for e in CURRENT}
    when = {e.stem: when_text(e, docs[e.stem], results_dir) for e in CURRENT}
    for e in CURRENT:
        L.append(f"| [`{e.stem}`](#{e.stem.lower()}) | {e.benchmark} | {when[e.stem].split(' (')[0]} | {e.title} |")
    L.append("")
    for e in CURRENT:
        doc = docs[e.stem]
        L += [f"## {e.stem}", ""]
        L.append("Files: " + ", ".join(f"[`{f}`]({f})" for f in files_of(e)))
        L.append("")
        L.append(f"- **Measures:** {e.measures}")
        L.append(f"- **When:** {when[e.stem]}")
        cmd = e.command or (doc or {}).get("command")
        L.append(f"- **Command:** `{cmd}`" if cmd else "- **Command:** not recorded")
        if doc is not None:
            L.append(f"- **Machine:** {machine_text(doc.get('machine'))}")
            code = code_text(doc)
            if code:
                L.append(f"- **Code:** {code}")
        elif e.stem == "REPORT":
            L.append("- **Machine:** each figure's footer names the machine of its data (the results above)")
        else:
            L.append("- **Machine:** the same shared 2-core CPU host (see the file)")
        if e.note:
            L.append(f"- **Note:** {e.note}")
        L.append("")
    L += archive_section(results_dir)
    return "\n".join(L)


def archive_section(results_dir: str) -> list[str]:
    arch = os.path.join(results_dir, "archive")
    if not os.path.isdir(arch):
        return []
    stems = sorted({os.path.splitext(n)[0] for n in os.listdir(arch)
                    if n.endswith((".json", ".md")) and os.path.isfile(os.path.join(arch, n))})
    n_files = sum(len(fs) for _, _, fs in os.walk(arch))
    L = ["## Archive", "",
         f"`archive/` holds {n_files} files: superseded runs, kept as written (paths inside them name their "
         "location at the time, `benchmarks/results/...`). Each stem has a `.json` and/or `.md`, most recovery "
         "runs a `<stem>_logs/` folder; `bench_recovery.py --render-only archive/<stem>.json` re-renders one. "
         + QUICK_DIR_NOTE + ".", "",
         "| stem | measured (UTC) | code | why kept |", "|---|---|---|---|"]
    for s in stems:
        doc = _load(os.path.join(arch, f"{s}.json"))
        L.append(f"| `{s}` | {run_time(doc) or '?'} | {code_text(doc) or '?'} | "
                 f"{ARCHIVE_NOTES.get(s, 'superseded by the current result of its benchmark')} |")
    L.append("")
    return L


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=RESULTS_DIR, help="results directory (default benchmarks/results)")
    p.add_argument("--check", action="store_true", help="exit 1 if a file is unaccounted for or INDEX.md is stale")
    args = p.parse_args(argv)
    bad = [f"not in CURRENT (archive it or add an entry): {n}" for n in unaccounted(args.results)]
    bad += [f"named in CURRENT but missing: {n}" for n in missing(args.results)]
    text = render_index(args.results)
    path = os.path.join(args.results, "INDEX.md")
    if args.check:
        try:
            with open(path) as fh:
                if fh.read() != text:
                    bad.append("INDEX.md is out of date: run python benchmarks/results_index.py")
        except OSError:
            bad.append("INDEX.md is missing")
        for line in bad:
            print(line, file=sys.stderr)
        return 1 if bad else 0
    with open(path, "w") as fh:
        fh.write(text)
    print(f"wrote {os.path.relpath(path, REPO)}" + "".join(f"\nwarning: {b}" for b in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
