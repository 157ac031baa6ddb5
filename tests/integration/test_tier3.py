"""Tier 3 (TierCheck base checkpoints) end to end: real torchrun jobs on gloo, tiny GPT-2, 2-4 CPU ranks.

- open format: a base written in the background is a plain DeepSpeed checkpoint (DeepSpeed without the
  extension loads it; zero_to_fp32 converts it) and `deadpool export` gives Hugging Face-loadable weights
  with the trained engine's logits;
- remote anchor: every process killed, the job relaunched with --load, losses identical bit for bit;
- a corrupt newest base is refused and the previous one used;
- resharding: a base saved at dp 4 loads at dp 2 with the same consolidated fp32 weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deadpool_ext.testing.jobs import Job
from deadpool_ext.testing.launch import REPO, base_env, free_port, kill_tree, read_metrics, run_job
from tests.conftest import make_config, matrix
from tests.integration.helpers import JOB_TIMEOUT_S, pretrain, summary
from tests.log_interface import assert_refusal

pytestmark = pytest.mark.slow

# Worker run under torchrun WITHOUT deadpool_ext: plain DeepSpeed loads the base, then rank 0 compares the
# engine's gathered weights with zero_to_fp32's consolidation and stores the logits on a fixed input.
PLAIN_LOAD = textwrap.dedent('''
    import json, os, sys
    import torch, deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sys.path.insert(0, os.environ["REPO"])
    from deadpool_ext.training.models import build_gpt
    ckpt, cfg_path, out = sys.argv[1:4]
    assert "deadpool_ext.persist" not in sys.modules
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = build_gpt("tiny")
    cfg = json.load(open(cfg_path)); cfg.pop("deadpool", None)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None, "plain DeepSpeed found no checkpoint"
    ids = torch.arange(32).reshape(2, 16) % 200
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if engine.global_rank == 0:
        ref = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for n, t in full.items():
            assert torch.equal(ref[n], t), n
        torch.save({"logits": logits, "step": int(engine.global_steps), "ids": ids}, out)
        print("PLAIN_LOAD_OK", int(engine.global_steps), flush=True)
    # plain DeepSpeed, no extension: end the group while the interpreter is whole and let gloo's worker threads
    # release the last collective's tensors (they take the GIL to); otherwise the exit may abort, "terminate called
    # without an active exception" (pytorch/pytorch#179291; DeepSpeed holds the groups, so destroying them does
    # not stop those threads).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    import time
    time.sleep(0.05)
''')


def _torchrun(tmp_path, nproc: int, script: str, args: list[str]):
    job = Job(launcher="torchrun", script=script, nproc_per_node=nproc, port=free_port(), args=tuple(args),
              env_vars={"REPO": REPO})
    res = run_job(job.argv(), timeout_s=JOB_TIMEOUT_S, env=job.env())
    assert not res.timed_out, res.output[-3000:]
    return res


def test_open_format_plain_deepspeed_zero_to_fp32_and_export(tmp_path):
    cfg = make_config(tmp_path, stage=3, deadpool=None)  # standalone tier 3 (no deadpool section)
    url = os.path.join(str(tmp_path), "tier3")
    # Three runs, a base at the end of each (close() drains it): within one run a base due while the previous
    # is still being written is skipped by design (persist.when_busy=skip), which a loaded machine makes happen.
    losses: dict = {}
    for iters in (2, 4, 6):
        load = ["--load", url] if iters > 2 else []
        res, part, _ = pretrain(tmp_path, cfg, iters=iters, name=f"to{iters}",  # HF's GPT-2: export's format
                                extra=load + ["--save", url, "--save-interval", "2", "--gpt-impl", "hf"])
        assert res.returncode == 0, res.output[-3000:]
        assert not summary(res)["tier3"]["skipped"]
        losses.update(part)
    assert sorted(losses) == list(range(1, 7))
    # keep_last=2: base 2 was deleted once 6 was complete and verified; `latest` written at publish only.
    assert sorted(d for d in os.listdir(url) if d.startswith("global_step")) == ["global_step4", "global_step6"]
    assert open(os.path.join(url, "latest")).read() == "global_step6"
    assert os.path.exists(os.path.join(url, "global_step6", "deadpool_commit.json"))
    assert not [f for f in os.listdir(os.path.join(url, "global_step6")) if f.startswith(".tmp")]
    worker = os.path.join(str(tmp_path), "plain_load.py")
    with open(worker, "w") as fh:
        fh.write(PLAIN_LOAD)
    out = os.path.join(str(tmp_path), "logits.pt")
    res2 = _torchrun(tmp_path, 2, worker, [url, cfg, out])
    assert res2.returncode == 0, res2.output[-3000:]
    ref = torch.load(out)
    assert ref["step"] == 6  # plain DeepSpeed loaded the newest base
    # deadpool verify / inspect / export
    cli = [sys.executable, "-m", "deadpool_ext.cli"]
    v = subprocess.run(cli + ["verify", url], capture_output=True, text=True, timeout=120, env=base_env())
    assert v.returncode == 0, v.stdout + v.stderr
    i = subprocess.run(cli + ["inspect", url, "--json"], capture_output=True, text=True, timeout=120, env=base_env())
    rep = json.loads(i.stdout)
    assert [r["version"] for r in rep["tier3"]["versions"]] == [4, 6] and rep["tier3"]["latest"] == "global_step6"
    st = os.path.join(str(tmp_path), "model.safetensors")
    e = subprocess.run(cli + ["export", url, "--out", st], capture_output=True, text=True, timeout=300, env=base_env())
    assert e.returncode == 0, e.stdout + e.stderr
    from safetensors.torch import load_file

    from deadpool_ext.training.models import build_gpt

    model = build_gpt("tiny")
    model.load_state_dict(load_file(st), strict=True)  # strict: a missing or unexpected key raises
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    assert torch.allclose(logits, ref["logits"], rtol=0, atol=1e-5), (logits - ref["logits"]).abs().max()
    # A corrupt file makes verify fail naming it.
    target = os.path.join(url, "global_step4", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(target, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))
    v2 = subprocess.run(cli + ["verify", url], capture_output=True, text=True, timeout=120, env=base_env())
    assert_refusal(v2, rc=1, names="zero_pp_rank_1_mp_rank_00_optim_states.pt")


@pytest.mark.full_matrix(covered_by="tests/integration/test_cross_tier.py (tier 3 restored with a deadpool section "
                                    "when memory holds no common version) and tests/integration/test_tier3_s3.py::"
                                    "test_save_to_s3_relaunch_with_load_identical_losses_inspect_verify (a relaunch "
                                    "loads the base, losses bit for bit)")
def test_remote_anchor_kill_every_process_and_relaunch(tmp_path, shm_root):
    # With a deadpool section: tier 3 runs from the runtime's step hook, --save overrides deadpool.persist.
    cfg = make_config(tmp_path, stage=3, deadpool={"local": {"shm_root": shm_root}, "replication": {"factor": 0}})
    iters = 30  # long enough that the kill lands mid-run (tiny steps take ~60 ms)
    _, ref, _ = pretrain(tmp_path, cfg, iters=iters, name="ref")
    assert sorted(ref) == list(range(1, iters + 1))
    url = os.path.join(str(tmp_path), "tier3")

    def kill_all_after_a_base(proc, metrics):
        deadline = time.time() + JOB_TIMEOUT_S
        latest = os.path.join(url, "latest")
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(latest) and max(read_metrics(metrics), default=0) >= 7:
                break
            time.sleep(0.02)
        kill_tree(proc.pid)  # every process of the job: the memory tiers die with it (new job id on relaunch)

    res, first, _ = pretrain(tmp_path, cfg, iters=iters, extra=["--save", url, "--save-interval", "3"],
                             inject=kill_all_after_a_base, name="killed")
    # (psutil reaps the killed torchrun, so Popen's return code is not meaningful here; the steps are.)
    assert max(first) < iters, (sorted(first), res.output[-2000:])
    res2, resumed, _ = pretrain(tmp_path, cfg, iters=iters,
                                extra=["--load", url, "--save", url, "--save-interval", "3"], name="relaunched")
    assert res2.returncode == 0, res2.output[-3000:]
    base = min(resumed) - 1
    assert base % 3 == 0 and 3 <= base <= max(first), (base, max(first))
    assert sorted(resumed) == list(range(base + 1, iters + 1))
    assert {s: ref[s] for s in resumed} == resumed  # bit for bit


def test_corrupt_newest_base_is_refused_and_previous_used(tmp_path):
    cfg = make_config(tmp_path, stage=2, deadpool=None)
    url = os.path.join(str(tmp_path), "tier3")
    # Two runs, so that both bases are surely written: within one run, base 4 is skipped (by design) when base 2
    # is still being written at step 4, which a loaded machine makes happen. close() drains the base in flight.
    res, first, _ = pretrain(tmp_path, cfg, iters=2, extra=["--save", url, "--save-interval", "2"], name="first")
    assert res.returncode == 0, res.output[-3000:]
    res, full, _ = pretrain(tmp_path, cfg, iters=4, extra=["--load", url, "--save", url, "--save-interval", "2"],
                            name="full")
    assert res.returncode == 0, res.output[-3000:]
    assert summary(res)["loaded_step"] == 2 and sorted(full) == [3, 4]
    bad = os.path.join(url, "global_step4", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(bad, "r+b") as fh:
        fh.seek(64)
        fh.write(b"\x00garbage\x00")
    res2, resumed, _ = pretrain(tmp_path, cfg, iters=4, extra=["--load", url], name="resumed")
    assert res2.returncode == 0, res2.output[-3000:]
    assert summary(res2)["loaded_step"] == 2  # the newest base, 4, complete on disk, was refused
    assert ("refusing base global_step4" in res2.output  # log-interface: the warning a user must see, naming
            and "checksum does not match" in res2.output)  # which base was refused and why
    assert sorted(resumed) == [3, 4] and {s: full[s] for s in (3, 4)} == resumed


RESHARD_CHECK = textwrap.dedent('''
    import os, sys
    import torch, deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sys.path.insert(0, os.environ["REPO"])
    import deadpool_ext.deepspeed as dpx
    from deadpool_ext.distributed import init_distributed
    from deadpool_ext.integrations.deepspeed.resume import resume_from_tier3
    from deadpool_ext.training.models import build_gpt, default_gpt_impl
    url, cfg_path = sys.argv[1:3]
    init_distributed()
    model = build_gpt("tiny", impl=default_gpt_impl())  # the implementation pretrain.py saved (its names)
    engine, *_ = dpx.initialize(model=model, config=cfg_path, model_parameters=model.parameters())
    version, client = resume_from_tier3(engine, url)
    assert engine.dp_world_size == 2 and version == 2, (engine.dp_world_size, version)
    with (deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
          if engine.zero_optimization_stage() == 3 else torch.no_grad()):
        full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    # fp32 master partitions as the optimizer holds them after the load, consolidated by DeepSpeed itself
    tag = "global_step2"
    if engine.global_rank == 0:
        ref = get_fp32_state_dict_from_zero_checkpoint(url, tag=tag)
        for n, t in full.items():
            assert torch.equal(ref[n], t), n
    engine.save_checkpoint(os.path.join(os.path.dirname(url), "dp2"), tag=tag)
    if engine.global_rank == 0:
        again = get_fp32_state_dict_from_zero_checkpoint(os.path.join(os.path.dirname(url), "dp2"), tag=tag)
        for n in ref:
            assert torch.equal(ref[n], again[n]), n
        print("RESHARD_OK", flush=True)
''')


@pytest.mark.parametrize("stage", matrix([3, 2], ci=[3]))
def test_reshard_dp4_to_dp2_same_consolidated_weights(tmp_path, stage):
    cfg = make_config(tmp_path, stage=stage, deadpool=None)
    url = os.path.join(str(tmp_path), "tier3")
    res, _, _ = pretrain(tmp_path, cfg, nproc=4, iters=2, extra=["--save", url, "--save-interval", "2"], name="dp4")
    assert res.returncode == 0, res.output[-3000:]
    assert json.load(open(os.path.join(url, "global_step2", "deadpool_commit.json")))["dp_world_size"] == 4
    worker = os.path.join(str(tmp_path), "reshard.py")
    with open(worker, "w") as fh:
        fh.write(RESHARD_CHECK)
    res2 = _torchrun(tmp_path, 2, worker, [url, cfg])
    assert res2.returncode == 0, res2.output[-4000:]  # its checks passed on every rank (an assert fails the run)
    assert os.path.exists(os.path.join(str(tmp_path), "dp2", "global_step2"))  # ...up to its last step, the save


@pytest.mark.parametrize("when_busy", matrix(["skip", "wait"], ci=["wait"]))
def test_base_due_while_previous_is_written(tmp_path, shm_root, when_busy):
    # 0.2 MiB/s: a base of the tiny model takes seconds to write, so base 2 is still in flight at step 3.
    cfg = make_config(tmp_path, stage=2, deadpool={"local": {"shm_root": shm_root},
                                                   "persist": {"max_mb_s": 0.2, "adaptive": False,
                                                               "when_busy": when_busy}})
    url = os.path.join(str(tmp_path), "tier3")
    res, losses, _ = pretrain(tmp_path, cfg, iters=3, extra=["--save", url, "--save-interval", "1"])
    assert res.returncode == 0, res.output[-3000:]
    assert sorted(losses) == [1, 2, 3]
    t3 = summary(res)["tier3"]
    if when_busy == "skip":  # training went on; the skip is counted
        assert t3["skipped"] and t3["waited"] == []
    else:  # every step's base was captured, some after waiting for the previous one
        assert t3["skipped"] == [] and [c["version"] for c in t3["captures"]] == [1, 2, 3] and t3["waited"]
