"""The stand-ins of tests/unit/test_cuda_paths*.py checked against torch's real CUDA and process-group API, so they
cannot drift from what the code calls on a GPU: torch.cuda.Event / Stream / stream (their Python signatures exist in
CPU builds too), the CUDA runtime's cudaHostRegister / cudaHostUnregister (on CUDA builds the functions themselves;
everywhere the call shapes torch's own pinning code uses), and ProcessGroup's collectives."""
from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.memory import pinned
from deadpool_ext.rebuild import swap
from tests.unit.test_cuda_paths import FakeCuda, FakeCudart, FakeEvent, FakeStream
from tests.unit.test_cuda_paths_swap import FakeNccl


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


@pytest.mark.parametrize(("fake", "real", "names"), [
    (FakeEvent, torch.cuda.Event, ("record", "query", "synchronize", "elapsed_time")),
    (FakeStream, torch.cuda.Stream, ("wait_event", "synchronize")),
])
def test_event_and_stream_stand_ins_have_torchs_signatures(fake, real, names):
    for name in names:
        assert [n for n, _ in _params(getattr(fake, name))] == [n for n, _ in _params(getattr(real, name))], name
    # the constructor: the keywords the code passes (Event(blocking=True)) exist with the same defaults
    real_new = dict(_params(real.__new__)[1:])
    fake_init = dict(_params(fake.__init__)[1:])
    assert {k: v for k, v in fake_init.items() if k in real_new} == {k: real_new[k] for k in fake_init}, fake_init


def test_the_keywords_the_side_stream_passes_exist_in_torch():
    src = inspect.getsource(pinned.SideStream)
    real_new = dict(_params(torch.cuda.Event.__new__)[1:])
    for kw in re.findall(r"Event\((\w+)=", src):
        assert kw in real_new, kw
    assert [n for n, _ in _params(torch.cuda.stream)] == ["stream"]
    assert [n for n, _ in _params(FakeCuda.stream)][1:] == ["stream"]


def _torch_cudart_calls() -> dict[str, int]:
    """Positional argument counts of torch's own calls to the CUDA runtime's pinning functions."""
    path = os.path.join(os.path.dirname(torch.__file__), "cuda", "_pin_memory_utils.py")
    tree = ast.parse(open(path).read())
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith(
                "cudaHost"):
            out[node.func.attr] = len(node.args)
    return out


def test_runtime_stand_in_matches_the_runtime_torch_calls():
    calls = _torch_cudart_calls()
    assert calls == {"cudaHostRegister": 3, "cudaHostUnregister": 1}  # (ptr, size, flags) and (ptr)
    for name, n in calls.items():
        assert len(_params(getattr(FakeCudart, name))) - 1 == n, name
    # the code's calls have the same shapes
    src = inspect.getsource(pinned.HostPinner)
    assert re.search(r"cudaHostRegister\(\w+, \w+, \w+\)", src) and re.search(r"cudaHostUnregister\(\w+\)", src)
    if torch.cuda.is_available():  # on a CUDA build with a device: the real module has them
        rt = torch.cuda.cudart()
        assert hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister")
    else:
        assert pinned.cuda_runtime() is None


def _first_overload(name: str) -> list[str]:
    """Parameter names (without self) of the first overload of ``ProcessGroup.<name>``, from its pybind doc."""
    doc = getattr(dist.ProcessGroup, name).__doc__ or ""
    m = re.search(rf"(?:1\. )?{name}\(self: [^,)]+(?:, )?(.*?)\) ->", doc)
    assert m, doc[:300]
    return [p.split(":")[0].strip() for p in re.split(r", (?=\w+:)", m.group(1)) if p]


def test_nccl_stand_in_has_process_group_signatures():
    for name in ("allreduce", "broadcast", "allgather", "barrier"):
        assert name in swap.COLLECTIVES
        assert [n for n, _ in _params(getattr(FakeNccl, name))][1:] == _first_overload(name), name
    assert _first_overload("abort") == [] and [n for n, _ in _params(FakeNccl.abort)] == ["self"]


def test_every_forwarded_collective_is_one_of_torchs():
    missing = [n for n in swap.COLLECTIVES if not hasattr(dist.ProcessGroup, n)]
    assert not missing, f"swap.COLLECTIVES names collectives torch's ProcessGroup does not have: {missing}"
    # the device-less collectives DeviceSplit routes by argument exist with the argument it reads
    assert _first_overload("_start_coalescing") == ["device_type"]
    assert "device" in dir(dist.BarrierOptions())
