"""Launch the pretraining scripts as real multi-process jobs for tests."""
from __future__ import annotations

import os
import signal
from typing import Callable

from deadpool_ext.testing.faults import corrupt_file, drop_node_memory, kill_rank
from deadpool_ext.testing.launch import free_port, read_metrics, run_job, torchrun_cmd, wait_for_step

JOB_TIMEOUT_S = 300


def pretrain(tmp_path, config: str, *, nproc: int = 2, iters: int = 8, script: str = "scripts/pretrain_gpt.py",
             extra: list[str] | None = None, max_restarts: int = 0, inject: Callable | None = None,
             name: str = "run") -> tuple[object, dict[int, float], str]:
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    cmd = torchrun_cmd(nproc, script, ["--deepspeed_config", config, "--train-iters", str(iters),
                                       "--metrics-out", metrics, *(extra or [])],
                       port=free_port(), max_restarts=max_restarts)
    res = run_job(cmd, timeout_s=JOB_TIMEOUT_S, while_running=(lambda p: inject(p, metrics)) if inject else None)
    with open(os.path.join(str(tmp_path), f"{name}.log"), "w") as fh:
        fh.write(res.output)
    assert not res.timed_out, f"job timed out after {JOB_TIMEOUT_S}s:\n{res.output[-4000:]}"
    return res, read_metrics(metrics), metrics


def kill_at(step: int, rank: int = 1, *, then: Callable[[], None] | None = None, sig: int = signal.SIGKILL):
    def inject(proc, metrics):
        wait_for_step(metrics, step, timeout_s=JOB_TIMEOUT_S, proc=proc)
        kill_rank(proc.pid, rank, sig)
        if then is not None:
            then()
    return inject


__all__ = ["pretrain", "kill_at", "drop_node_memory", "corrupt_file"]
