"""The rank state of a DeepSpeed engine (ZeRO 0-3, fp32/bf16/fp16): the ``RankStateAdapter`` the snapshot
manager copies and restores. The only place that knows where DeepSpeed keeps a rank's tensors."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...snapshot.state import (
    RankStateAdapter,
    capture_rng,
    copy_into,
    plain_value,
    restore_optimizer_state,
    restore_rng,
)


class DeepSpeedStateAdapter(RankStateAdapter):
    """Rank state of a DeepSpeed engine: ZeRO stage 0, 1, 2 and 3; fp32, bf16 and fp16; every optimizer wrapper
    DeepSpeed builds for those (:mod:`.wrappers` says which, and where each keeps the tensors).

    Tensors, for ZeRO-1/2 and ``BF16_Optimizer``: the flat low-precision parameter buffer (module parameters are
    views into it), the rank's fp32 master partition and the inner optimizer's state of that partition. ZeRO-3:
    the rank's parameter partitions (flat), fp32 master partitions and their optimizer state. Stage 0 with bf16 or
    fp16 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``): the low-precision parameters, their fp32 masters and the
    optimizer state; fp32 stage 0: module parameters and optimizer state.

    With ``derive_params`` (ZeRO 1-3, parameters in host memory) the parameter buffers (``params.<i>``) are
    not captured: DeepSpeed sets them to the masters cast to their dtype at the end of every step, so restore
    does the same (ZeRO-3: per partition; ZeRO-1/2: each rank casts its partition, then the data-parallel
    all-gather DeepSpeed itself uses). For fp32 ZeRO that removes a quarter of the captured bytes.
    """

    def __init__(self, engine: Any, client_state: Callable[[], dict[str, Any]] | None = None,
                 restore_client_state: Callable[[dict[str, Any]], None] | None = None, *,
                 derive_params: bool = False) -> None:
        self.engine = engine
        self._client_state = client_state
        self._restore_client_state = restore_client_state
        self._rng_hook: Any = None  # a one-shot forward pre-hook that sets the restored RNG again
        self._rng_pending: dict[str, Any] = {}
        self.zero_stage = int(engine.zero_optimization_stage())
        from .wrappers import wrapper_access

        # By the wrapper's class first: one ZeRO stage can hold different wrappers (ZeRO-1: BF16_Optimizer with
        # bf16 and fp32 gradient accumulation, DeepSpeedZeroOptimizer otherwise). Refused here, at attach, in
        # one line (UnsupportedWrapperError), never at the first snapshot.
        self._access = wrapper_access(engine, self.zero_stage)
        self.wrapper = self._access.kind
        self._bit16 = self._access.bit16
        self._master = self._access.master
        self._inner = self._access.inner
        # Host memory only: the capture-time checksum of a derived tensor is taken in place, and hashing a
        # device tensor would need the very device-to-host copy that deriving saves.
        self.derive_params = bool(derive_params and self._access.partitioned
                                  and all(t.device.type == "cpu" for t in self._bit16()))
        self.allow_batch_change = False  # deadpool.elastic.allow_batch_change (set by the runtime)
        self._layout: dict[str, Any] | None = None
        self._layout_why = ""  # why there is no layout (what a refused reshard says)
        try:
            from .layout import partition_layout

            self._layout = partition_layout(engine, self.zero_stage)
        except ValueError as exc:
            self._layout_why = str(exc)

    # -- capture ---------------------------------------------------------------------------------
    def step(self) -> int:
        return int(self.engine.global_steps)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for i, t in enumerate(self._bit16()):
            out.append((f"params.{i}", t))
        for i, t in enumerate(self._master()):
            out.append((f"master.{i}", t))
            for key, value in sorted(self._inner.state.get(t, {}).items()):
                if torch.is_tensor(value):
                    out.append((f"optim.{i}.{key}", value))
        return out

    def derived(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"params.{i}", t) for i, t in enumerate(self._bit16())] if self.derive_params else []

    def meta(self) -> dict[str, Any]:
        e = self.engine
        opt = e.optimizer
        scaler = self._access.scaler()
        meta: dict[str, Any] = {
            "global_steps": int(e.global_steps),
            "global_samples": int(e.global_samples),
            "skipped_steps": int(e.skipped_steps),
            "micro_steps": int(e.micro_steps),
            "zero_stage": self.zero_stage,
            "optimizer_wrapper": self.wrapper,
            "dp_world_size": int(e.dp_world_size),
            "train_batch_size": int(e.train_batch_size()),
            "param_groups": [{k: v for k, v in g.items() if k != "params" and plain_value(v)}
                             for g in opt.param_groups],
            "optim_scalars": {str(i): {k: v for k, v in self._inner.state.get(t, {}).items() if not torch.is_tensor(v)}
                              for i, t in enumerate(self._master())},
            "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
            "loss_scaler": {k: v for k, v in vars(scaler).items() if plain_value(v)} if scaler is not None else None,
            "rng": capture_rng(),
            "client": self._client_state() if self._client_state else {},
            "wrapper": {k: getattr(opt, k) for k in self._access.flags},
        }
        if self._layout is not None:
            meta["layout"] = self._layout
        return meta

    # -- elastic ------------------------------------------------------------------------------------------
    def partition_layout(self) -> dict[str, Any] | None:
        return self._layout

    def why_no_layout(self) -> str:
        return self._layout_why

    def restore_resharded(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """New partitions of masters and moments copied in, parameters derived from the masters (what
        DeepSpeed's step does at its end), then the small state of ``meta``."""
        from ...snapshot.plan import RecoveryError

        opt = self.engine.optimizer
        was, now = meta.get("train_batch_size"), int(self.engine.train_batch_size())
        if was is not None and was != now and not self.allow_batch_change:
            raise RecoveryError(f"elastic: the snapshots were taken at global batch {was}, this engine's is {now}; "
                                "set train_batch_size in the DeepSpeed config (kept across data-parallel sizes), or "
                                "deadpool.elastic.allow_batch_change to true")
        # DeepSpeed finds the accumulation boundary by micro_steps mod accumulation steps, and accumulation changed
        # with the data-parallel size: count the restored steps in this engine's micro steps.
        meta = {**meta, "micro_steps": int(meta["global_steps"]) * int(self.engine.gradient_accumulation_steps())}
        if self.zero_stage == 3:
            opt.checkpoint_event_prologue()
        scalars = (meta.get("optim_scalars") or {}).get("0", {})
        with torch.no_grad():
            for i, t in enumerate(self._master()):
                copy_into(t, tensors[f"master.{i}"], f"master.{i}")
                state = self._inner.state.setdefault(t, {})
                restore_optimizer_state(state, tensors, f"optim.{i}.", scalars)
            if self.zero_stage == 3:
                for bit16, master in zip(self._bit16(), self._master()):
                    bit16.copy_(master)
        if self.zero_stage == 3:
            opt.checkpoint_event_epilogue()
        else:
            with torch.no_grad():
                self._access.sync()  # update_lp_params: collective over data parallel
        self.restore_meta(meta)

    # -- differential checkpoints ------------------------------------------------------------------
    def inner_optimizer(self) -> Any:
        """The torch optimizer that updates the master tensors (what a differential replays)."""
        return self._inner

    def masters(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates, in snapshot order (``master.<i>``)."""
        return self._master()

    def sync_params_from_masters(self) -> None:
        """After masters were changed outside a step (a replay): do what DeepSpeed does at the end of a step,
        copying masters into the training parameters (collective for ZeRO-1/2 and bf16: an all-gather)."""
        if self._bit16():
            with torch.no_grad():
                self._access.sync()

    def restore_meta(self, meta: dict[str, Any]) -> None:
        """Counters, scheduler, loss scaler, param-group scalars, RNG and client state of ``meta``."""
        e = self.engine
        opt = e.optimizer
        for group, saved in zip(opt.param_groups, meta["param_groups"]):
            group.update(saved)
        if meta["lr_scheduler"] is not None and e.lr_scheduler is not None:
            e.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        scaler = self._access.scaler()
        if scaler is not None and meta["loss_scaler"]:
            for k, v in meta["loss_scaler"].items():
                setattr(scaler, k, v)
        for k, v in (meta.get("wrapper") or {}).items():
            if k in self._access.flags:
                setattr(opt, k, v)
        e.global_steps = meta["global_steps"]
        e.global_samples = meta["global_samples"]
        e.skipped_steps = meta["skipped_steps"]
        e.micro_steps = meta["micro_steps"]
        restore_rng(meta["rng"])
        self._rng_again_at_next_forward(meta["rng"])
        if self._restore_client_state is not None:
            self._restore_client_state(meta.get("client", {}))

    def _rng_again_at_next_forward(self, rng: dict[str, Any]) -> None:
        """Set the RNG to the restored state once more right before the engine's next forward: whatever draws
        from the global RNG between the restore and the redone step (a ``DataLoader`` iterator created after
        ``resume()`` draws its base seed from it; the uninterrupted run drew it before the snapshot) would
        otherwise shift dropout and every later random number."""
        if self._rng_hook is not None:
            self._rng_hook.remove()
        self._rng_pending = rng

        def again(_module: Any, _inputs: Any) -> None:
            restore_rng(rng)
            hook = self._rng_hook
            self._rng_hook = None
            if hook is not None:
                hook.remove()

        self._rng_hook = self.engine.register_forward_pre_hook(again)

    def settle_rng(self) -> None:
        """Set the restored RNG now instead of at the next forward, for a caller whose next draws from the global
        RNG before the redone step are ones the uninterrupted run also made after the snapshot (Lightning creating
        the next epoch's iterator after a restored step that ended an epoch)."""
        hook, self._rng_hook = self._rng_hook, None
        if hook is not None:
            hook.remove()
            restore_rng(self._rng_pending)

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        e = self.engine
        opt = e.optimizer
        if meta["zero_stage"] != self.zero_stage or meta["dp_world_size"] != e.dp_world_size:
            raise ValueError(
                f"snapshot layout (ZeRO {meta['zero_stage']}, dp {meta['dp_world_size']}) differs from the engine's "
                f"(ZeRO {self.zero_stage}, dp {e.dp_world_size}); in-memory restore needs the same layout")
        was = meta.get("optimizer_wrapper", self.wrapper)
        if was != self.wrapper:
            raise ValueError(f"snapshot taken with DeepSpeed's {was}, this engine has {self.wrapper} (bf16, fp16, "
                             "data_types.grad_accum_dtype or the ZeRO stage changed); in-memory restore needs the same")
        derive = "params.0" not in tensors and bool(self._bit16())
        if derive and not self.derive_params:
            raise ValueError("snapshot has no parameter buffers (they were derived from the masters) but this engine "
                             "cannot derive them (ZeRO 1-3 with parameters in host memory can)")
        if self.zero_stage == 3:
            opt.checkpoint_event_prologue()
        masters = self._master()
        with torch.no_grad():
            if not derive:
                for i, t in enumerate(self._bit16()):
                    copy_into(t, tensors[f"params.{i}"], f"params.{i}")
            for i, t in enumerate(masters):
                copy_into(t, tensors[f"master.{i}"], f"master.{i}")
                state = self._inner.state.setdefault(t, {})
                restore_optimizer_state(state, tensors, f"optim.{i}.", meta["optim_scalars"].get(str(i), {}))
            if derive and self.zero_stage == 3:
                for t, master in zip(self._bit16(), masters):
                    t.copy_(master)  # what DeepSpeed's step does (stage3._post_step)
        if self.zero_stage == 3:
            # Re-gathers the persistent (small, unpartitioned) parameters from the restored partitions.
            opt.checkpoint_event_epilogue()
        elif derive:
            with torch.no_grad():
                self._access.sync()  # cast own partition, all-gather the rest (collective over data parallel)
        self.restore_meta(meta)
