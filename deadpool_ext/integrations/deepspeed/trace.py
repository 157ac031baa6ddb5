"""ZeRO-3's recorded trace, kept across an in-place hot-swap.

ZeRO-3 records, over its first two steps, the order in which the model's submodules run and when each parameter
is last used (the *trace*); after that it prefetches along it, with no collective at a step's start. A fresh engine
(a spare's) has no trace. Before this module the swap also dropped the survivors', so every rank recorded again:
the first steps after a swap ran without prefetch and with DeepSpeed's trace checks (collectives), measured at
0.25-0.3 s of the redone step on GPT small, 3 ranks, on the 2-core host.

Now the survivors keep theirs (:func:`~.runtime.abandon_step` drops only the step's own state), and after the
restore every rank runs :func:`agree` (collective, on the snapshot side group):

1. every rank states its model's structure (:func:`fingerprint`) and the digest of the trace it holds, if complete;
2. :func:`decide` (pure): the trace is kept when every rank's model has the same structure and every rank holding a
   trace holds the same one; else every rank drops its own and all record again, as before;
3. if kept, the ranks without it (the spare) receive it from the lowest rank holding it, check its digest, and
   install it, mapped onto their own modules and parameters by position.

One log line says what was decided and why. A trace is a structure of positions, never code: it travels as JSON.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("deadpool_ext")

_COORD = "_PartitionedParameterCoordinator__"  # name-mangled attributes of DeepSpeed's ZeRO-3 coordinator

Trace = dict[str, list[Any]]
"""``{"modules": [position in module.modules(), ...], "params": [[parameter position, step last used at], ...]}``"""


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded from every rank's entry."""
    keep: bool
    """Every rank ends with the trace of digest :attr:`digest` (else every rank drops its own)."""
    source: int | None
    """The group rank the others receive it from (None: nobody needs it, or it is dropped)."""
    digest: str | None
    why: str


def decide(entries: list[dict[str, Any]]) -> Decision:
    """Pure: keep the trace only if every rank's model has the same structure (``fp``) and every rank holding a
    complete trace holds the same one (``digest``, None where a rank holds none)."""
    if not entries:
        return Decision(False, None, None, "no rank took part")
    if len({e["fp"] for e in entries}) > 1:
        return Decision(False, None, None, "the ranks' models differ in structure")
    holders = [i for i, e in enumerate(entries) if e["digest"] is not None]
    if not holders:
        return Decision(False, None, None, "no rank holds a complete trace (ZeRO-3 had not finished recording it)")
    digests = {entries[i]["digest"] for i in holders}
    if len(digests) > 1:
        return Decision(False, None, None,
                        f"the {len(holders)} ranks holding a trace hold {len(digests)} different ones")
    digest = entries[holders[0]]["digest"]
    if len(holders) == len(entries):
        return Decision(True, None, digest, "every rank holds it")
    return Decision(True, holders[0], digest, f"{len(holders)} of {len(entries)} ranks hold it; the others receive it "
                                              f"from rank {holders[0]}")


def digest_of(trace: Trace) -> str:
    return hashlib.sha256(json.dumps(trace, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def well_formed(trace: Any, n_modules: int, n_params: int) -> bool:
    """Pure: ``trace`` is a :data:`Trace` whose positions lie within a model of that many modules and parameters."""
    if not isinstance(trace, dict) or set(trace) != {"modules", "params"}:
        return False
    mods, params = trace["modules"], trace["params"]
    if not isinstance(mods, list) or not isinstance(params, list):
        return False
    if not all(type(i) is int and 0 <= i < n_modules for i in mods):
        return False
    return all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int and 0 <= e[0] < n_params
               and type(e[1]) is int and e[1] >= 0 for e in params)


def coordinator(engine: Any) -> Any:
    """The engine's ZeRO-3 parameter coordinator (None below stage 3)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return offload.get_param_coordinator() if offload is not None else None


def _params(module: Any) -> list[Any]:
    """Every parameter ZeRO-3 may fetch for the module, in a fixed order: the module's own, then the external
    parameters its submodules registered (``register_external_parameter``) that are not among them."""
    out = list(module.parameters())
    seen = {id(p) for p in out}
    for m in module.modules():
        external = getattr(m, "ds_external_parameters", None)
        for _, p in (external() if external is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def fingerprint(module: Any) -> str:
    """The model's structure as ZeRO-3 traces it: every submodule's type and every parameter's full shape."""
    h = hashlib.sha256()
    for m in module.modules():
        h.update(f"{type(m).__module__}.{type(m).__qualname__};".encode())
    for p in _params(module):
        h.update(f"{tuple(getattr(p, 'ds_shape', p.shape))};".encode())
    return h.hexdigest()


def held(coord: Any, module: Any) -> Trace | None:
    """The coordinator's trace as positions in ``module``, if complete (else None)."""
    if not coord.is_complete_trace():
        return None
    mods = {id(m): i for i, m in enumerate(module.modules())}
    params = {id(p): i for i, p in enumerate(_params(module))}
    order = getattr(coord, _COORD + "submodule_order")
    used = getattr(coord, _COORD + "param_order")
    if any(id(m) not in mods for m in order) or any(id(t.param) not in params for t in used):
        return None  # a module or parameter outside the model: not expressible by position
    return {"modules": [mods[id(m)] for m in order],
            "params": [[params[id(t.param)], int(t.step_id_last_used_at)] for t in used]}


def install(coord: Any, module: Any, trace: Trace) -> None:
    """Make ``trace`` the coordinator's complete trace, mapped onto ``module``'s own objects by position. The next
    forward's ``reset_step`` then starts along it, as on a rank that recorded it."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    mods = list(module.modules())
    params = _params(module)
    in_trace = getattr(type(coord), _COORD + "ParamInTrace")
    coord._clear_trace_structures()
    setattr(coord, _COORD + "submodule_order", tuple(mods[i] for i in trace["modules"]))
    setattr(coord, _COORD + "param_order", tuple(in_trace(param=params[i], step_id_last_used_at=s)
                                                  for i, s in trace["params"]))
    setattr(coord, _COORD + "trace_mode", ZeRoTraceMode.COMPLETE)


def drop(coord: Any) -> None:
    """No trace: the next forwards record one again (every rank together)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    coord._clear_trace_structures()
    setattr(coord, _COORD + "trace_mode", ZeRoTraceMode.INVALID)


def agree(engine: Any, group: Any, rank: int) -> Decision | None:
    """Collective over ``group`` after an in-place hot-swap's restore (ZeRO-3 only; None below): keep the trace
    on every rank, or drop it on every rank (see the module's docstring)."""
    import torch.distributed as dist

    from ...cluster.comm import allgather_json, broadcast_json

    coord = coordinator(engine)
    if coord is None:
        return None
    module = engine.module
    own = held(coord, module)
    own_digest = digest_of(own) if own is not None else None
    entries = allgather_json({"fp": fingerprint(module), "digest": own_digest}, group=group)
    decision = decide(entries)
    if decision.keep and decision.source is not None:
        src = dist.get_global_rank(group, decision.source) if group is not None else decision.source
        got = broadcast_json(own if own_digest == decision.digest else None, src=src, group=group)
        # every rank checks the same message against the same structure: a bad one is refused everywhere alike
        if not well_formed(got, len(list(module.modules())), len(_params(module))) or digest_of(got) != decision.digest:
            decision = Decision(False, None, None, "the trace received did not match its digest or the model")
        elif own_digest != decision.digest:
            install(coord, module, got)
    if not decision.keep:
        drop(coord)
    if rank == 0 or own_digest != decision.digest:
        log.info("ZeRO-3 trace after the swap: %s (%s)", "kept" if decision.keep else "recorded again", decision.why)
    return decision
