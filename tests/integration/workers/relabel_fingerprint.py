"""A DeepSpeed engine built *solo* (a spare's local build) for one rank of a 3-rank world, and what of it depends on
the rank: every attribute of the engine, its optimizer and its parameters' ``ds_*`` / ``_hp_mapping`` fields that is
a number, a string or a tensor's shape and place in its storage (values are left out: the restore from memory
overwrites them), and the rank of the DistributedSampler of DeepSpeed's own loader (``training_data=``).

argv: ZeRO stage, the rank to build for, output JSON, then the ranks to relabel to in turn (none: the engine as
built). Writes {"built": fingerprint} or {"<rank>": fingerprint of the engine relabelled to it, ...} and "refusal":
what ``takeover.refusal`` says of the engine. Used by tests/integration/test_takeover.py."""
import json
import os
import sys

import torch


def fingerprint(engine) -> dict:
    seen: dict[str, str] = {}

    def walk(obj, path: str, depth: int = 0) -> None:
        if depth > 6:
            return
        if isinstance(obj, (bool, int, float, str)) or obj is None:
            seen[path] = repr(obj)
        elif torch.is_tensor(obj) and not isinstance(obj, torch.nn.Parameter):
            seen[path] = f"{tuple(obj.shape)} at {obj.storage_offset()} of {obj.untyped_storage().nbytes()}"
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj[:400]):
                walk(x, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for k, v in list(obj.items())[:400]:
                if isinstance(k, (str, int)):
                    walk(v, f"{path}{{{k}}}", depth + 1)

    for name, owner in (("engine", engine), ("opt", engine.optimizer)):
        for k, v in vars(owner).items():
            if k == "param_id":  # keyed by id(param): differs between any two processes
                continue
            if not isinstance(v, torch.nn.Module):
                walk(v, f"{name}.{k}")
    loader = getattr(engine, "training_dataloader", None)
    if loader is not None:  # DeepSpeed's own loader (training_data=): its DistributedSampler's rank
        seen["loader.sampler"] = f"{loader.data_sampler.rank} of {loader.data_sampler.num_replicas}"
    for n, p in engine.module.named_parameters():
        for k, v in vars(p).items():
            if k == "_hp_mapping" and v is not None:
                seen[f"p.{n}.{k}"] = f"{v.lp_fragment_address!r} {v.hp_fragment_address!r}"
            elif k.startswith("ds_"):
                walk(v, f"p.{n}.{k}")
    return seen


def main() -> None:
    stage, rank, out, targets = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], [int(t) for t in sys.argv[4:]]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import deepspeed

    from deadpool_ext.integrations.deepspeed import takeover
    from deadpool_ext.rebuild import swap
    from deadpool_ext.rebuild.worker import init_solo
    from deadpool_ext.training.data import seed_everything
    from deadpool_ext.training.models import build_gpt

    seed_everything(1234)
    model = build_gpt("tiny")
    init_solo(rank, 3, 60.0)
    with open("configs/gpt_tiny_zero3_cpu.json") as fh:
        cfg = json.load(fh)
    cfg["zero_optimization"] = {"stage": stage}
    cfg.pop("deadpool", None)
    data = torch.utils.data.TensorDataset(torch.arange(48))  # DeepSpeed's own loader over it (training_data=)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(), training_data=data)
    result = {"refusal": takeover.refusal(engine), "groups": swap.relabel_refusal(3)}
    if not targets:
        result["built"] = fingerprint(engine)
    for t in targets:
        swap.relabel(t)
        takeover.relabel(engine, t)
        result[str(t)] = fingerprint(engine)
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
