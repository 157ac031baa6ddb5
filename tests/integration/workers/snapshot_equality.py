"""Worker: train a few steps with snapshots on, then check the newest tier-1 snapshot equals the live state
bit for bit (tensors after unflattening, counters, scheduler, RNG; derived parameter buffers by their
recorded checksums). Exits non-zero on any difference.

    torchrun --nproc-per-node 2 tests/integration/workers/snapshot_equality.py CONFIG STEPS [RESULTS_DIR]

Each rank prints its result (``RESULT {...}``) and, with RESULTS_DIR, also writes it to ``RESULTS_DIR/rank<R>.json``
(what the test reads: a line of two processes on one pipe can be lost to the other's output).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import deadpool_ext.deepspeed as dpx
from deadpool_ext.distributed import init_distributed
from deadpool_ext.snapshot.format import tensor_checksum
from deadpool_ext.snapshot.plan import RecoveryError
from deadpool_ext.snapshot.restore import verify_derived
from deadpool_ext.snapshot.slots import restore_from
from deadpool_ext.training.data import ByteLMData
from deadpool_ext.training.models import build_gpt


def main(argv: list[str]) -> int:
    config, steps = argv[0], int(argv[1])
    results_dir = argv[2] if len(argv) > 2 else None
    init_distributed()
    torch.manual_seed(0)
    model = build_gpt("tiny")
    engine, *_ = dpx.initialize(model=model, config=config, model_parameters=model.parameters())
    data = ByteLMData(seq_len=64, seed=0)
    micro = 0
    while engine.global_steps < steps:  # optimizer steps; gradient accumulation may take several micro-steps
        ids, labels = data.gpt_batch(micro * 8 + engine.global_rank * 4, 4)
        micro += 1
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
    mgr = engine.deadpool.snapshots
    mgr.wait_idle()
    version, slot = mgr.store.latest
    assert version == steps, (version, steps)
    tensors, state, header = restore_from(mgr.store.slot(slot).buf, verify=True)
    adapter = engine.deadpool.adapter
    live = dict(adapter.captured())
    derived = dict(adapter.derived())
    assert set(live) == set(tensors), (sorted(live), sorted(tensors))
    assert set(live) | set(derived) == {name for name, _ in adapter.tensors()}
    assert any(k.startswith("optim.") for k in live) and any(k.startswith("master.") for k in live)
    if not engine.deadpool.config.snapshot.derive_params:  # everything captured, nothing to re-derive
        assert not derived and "derived" not in header and any(k.startswith("params.") for k in tensors)
    # The parameter buffers are not copied (derive_params, the default): the snapshot holds their checksums,
    # and they are the masters cast to their dtype, which is what restore rebuilds.
    elif not derived or set(header["derived"]) != set(derived):
        raise AssertionError(f"derived {sorted(derived)}, recorded {header.get('derived')}")
    for name, t in derived.items():
        assert header["derived"][name] == tensor_checksum(t), name
        if adapter.zero_stage == 3:
            master = tensors["master." + name.split(".")[1]]
            assert torch.equal(master.to(t.dtype).view(torch.uint8), t.detach().view(torch.uint8)), name
    if derived:  # a re-derived buffer that differs from its capture is refused by name
        name, t = next(iter(derived.items()))
        keep = t.detach().clone()
        with torch.no_grad():
            t.view(-1)[0] += 1
        try:
            verify_derived(adapter, mgr.rank, header, version)
            raise AssertionError("a wrong re-derived buffer was accepted")
        except RecoveryError as exc:
            assert name in str(exc), exc
        with torch.no_grad():
            t.copy_(keep)
        verify_derived(adapter, mgr.rank, header, version)
    for name, t in live.items():
        snap = tensors[name]
        assert snap.dtype == t.dtype and snap.shape == t.shape, name
        assert torch.equal(snap.view(torch.uint8) if t.dtype == torch.bfloat16 else snap,
                           t.detach().view(torch.uint8) if t.dtype == torch.bfloat16 else t.detach()), name
    meta = engine.deadpool.adapter.meta()
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "param_groups", "zero_stage"):
        assert state[key] == meta[key], (key, state[key], meta[key])
    assert header["version"] == steps and header["rank"] == engine.global_rank
    assert mgr.committed_version == steps
    dtypes = sorted({str(t.dtype) for t in [*live.values(), *derived.values()]})
    # what the test reads: one JSON record per rank, after every check above passed
    result = {"rank": engine.global_rank, "tensors_equal": len(live), "derived_verified": len(derived),
              "dtypes": dtypes}
    print("RESULT " + json.dumps(result), flush=True)
    if results_dir is not None:
        import os

        with open(os.path.join(results_dir, f"rank{engine.global_rank}.json"), "w") as fh:
            json.dump(result, fh)
    engine.deadpool.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
