"""What a survivor's memory holds, for the debug log after an in-place recovery (a diagnosis, never a decision)."""
from __future__ import annotations

import gc


def memory_census() -> str:
    """Threads, live tensors (count, bytes of their storages, the largest groups by kind and shape) and anonymous RSS:
    what to compare across hot-swaps when a survivor's memory grows (debug level only: it walks every object the
    collector tracks). Activation-shaped tensors right after a recovery are the interrupted step's autograd graph,
    held from C++ until the redone step runs (freed by the catch-up collection)."""
    import threading

    import torch

    seen: set[int] = set()
    n = nbytes = 0
    largest: list[tuple[int, str]] = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            n += 1
            try:
                st = obj.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    nbytes += st.nbytes()
                    kind = "param" if isinstance(obj, torch.nn.Parameter) else "tensor"
                    largest.append((st.nbytes(), f"{kind}{tuple(obj.shape)}"))
            except Exception:
                continue
    by_shape: dict[str, list[int]] = {}
    for b, what in largest:
        agg = by_shape.setdefault(what, [0, 0])
        agg[0] += 1
        agg[1] += b
    ranked = sorted(by_shape.items(), key=lambda kv: -kv[1][1])
    top = ", ".join(f"{what} x{c} {b / 2**20:.1f} MiB" for what, (c, b) in ranked[:12])
    anon = "?"
    try:
        with open("/proc/self/status") as fh:
            anon = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("RssAnon")), "?")
    except OSError:
        pass
    return (f"{threading.active_count()} threads, {n} tensors ({nbytes / 2**20:.1f} MiB of storage), RssAnon {anon}; "
            f"storage by shape: {top}")
