"""No process state in module globals but what is listed here, each with why it is process-wide (issue 31, part 2).

A worker's fault-tolerance state, and every piece of generation state in it (which generation, the generation a
notice requested, armed or stopped, the dead generations' groups), lives in one object per process:
``rebuild/context.py``'s ``WorkerContext``. This test keeps that true. It parses the product's modules (not the
tools beside it: ``chaos``, ``sim``, ``testing``, ``training``) with ``ast`` and fails on

- a ``global`` statement,
- a module-level name bound to ``None``, to a mutable container (a list, dict or set display or comprehension, or
  ``list()``, ``dict()``, ``defaultdict()``, ...), or to an instance made by any call but the stateless factories
  in ``STATELESS_CALLS`` (a logger, a compiled pattern, a lock, ...),

unless ``(module, name)`` is in ``ALLOWED`` with its reason. Exempt without a listing: ``__all__``, and constant
tables, i.e. a container whose name is in capitals (``DTYPES``, ``_GROUP_DEFAULTS``) and that no product module
ever mutates (no ``X[k] = v``, ``del X[k]``, ``X += ...``, ``X.append(...)`` and the like). An entry of ``ALLOWED``
that matches nothing any more fails too, so the list stays the truth.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deadpool_ext"
TOOLS = {"chaos", "sim", "testing", "training"}

MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "OrderedDict", "deque", "Counter",
                 "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"}
STATELESS_CALLS = {"getLogger", "compile", "TypeVar", "NewType", "namedtuple", "Struct", "slice", "frozenset",
                   "tuple", "cast", "object", "Lock", "RLock", "MappingProxyType"}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "discard", "sort", "reverse"}

ALLOWED: dict[tuple[str, str], str] = {
    ("rebuild/context.py", "_CONTEXT"): "the one per-process WorkerContext: all of a worker's state hangs off it",
    ("rebuild/notice.py", "_installed"): "signal.signal installs a handler per process, not per generation",
    ("rebuild/notice.py", "_previous"): "the process's handler before ours, that a real SIGUSR2 is passed to",
    ("rebuild/swap.py", "_registered"): "torch's backend registry (dist.Backend.register_backend) is per process",
    ("hooks.py", "_registry"): "a harness registers its callbacks once per process, for every generation",
    ("persist/sign.py", "_key_env"): "which environment variable holds the key: per process, like os.environ",
    ("cluster/netif.py", "_pinned"): "what this module wrote to os.environ (per process), to tell it from the user's",
    ("snapshot/spare_slots.py", "_prepared"): "a spare makes its two slots once, before its first generation",
    ("snapshot/spare_slots.py", "_state"): "a spare makes its two slots once, before its first generation",
    ("rebuild/warm.py", "_state"): "whether this process is a warm parent's child, and its pipe: once, at its fork",
    ("snapshot/priority.py", "_can_boost"): "a capability probe of this process's thread priorities, cached",
    ("launcher/contract.py", "_CURRENT"): "the environment the process started with, parsed once",
    ("store/rendezvous.py", "_KEEP_ALIVE"): "pybind11 needs the Python store objects for as long as torch's C++ "
                                            "holds them, which is the process's life",
    ("persist/layout.py", "_names"): "the file-name rule a framework integration sets at its import",
    ("persist/layout.py", "FALLBACK_NAMES"): "a frozen dataclass: a constant",
    ("memory/heap.py", "_libc"): "the C library, loaded once",
    ("logs.py", "_last_rank"): "for log lines only: the last rank known (a rank, not a generation)",
    ("integrations/deepspeed_hook.py", "_state"): "deepspeed.initialize is patched once per process",
    ("config.py", "_REPR"): "a reprlib.Repr configured at import, read only after",
    ("replicate/auth.py", "UNSIGNED"): "a BlobSigner without a key: no state",
}


def _product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in TOOLS)


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _kind(value: ast.expr) -> str | None:
    """What makes a module-level value state: 'None', 'container', 'instance' (None: a constant or stateless)."""
    if isinstance(value, ast.Constant):
        return "None" if value.value is None else None
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return "container"
    if isinstance(value, ast.Call):
        name = _call_name(value)
        if name in MUTABLE_CALLS:
            return "container"
        return None if name in STATELESS_CALLS else "instance"
    return None


def _module_bindings(tree: ast.Module) -> list[tuple[str, ast.expr, int]]:
    """(name, value, line) of every module-level assignment to a plain name, including under if/try blocks."""
    out: list[tuple[str, ast.expr, int]] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for h in getattr(node, "handlers", []):
                stack.extend(h.body)
        elif isinstance(node, ast.Assign):
            out += [(t.id, node.value, node.lineno) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            out.append((node.target.id, node.value, node.lineno))
    return out


def _named(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _mutated(trees: list[ast.Module]) -> set[str]:
    """Names some product module mutates in place (as ``X`` or ``mod.X``)."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS):
                name = _named(node.func.value)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                name = _named(node.value)
            elif isinstance(node, ast.AugAssign):
                name = _named(node.target)
            else:
                continue
            if name is not None:
                out.add(name)
    return out


def _is_constant_name(name: str) -> bool:
    bare = name.lstrip("_")
    return bool(bare) and bare.upper() == bare and any(c.isalpha() for c in bare)


def _module_state() -> dict[tuple[str, str], str]:
    """(module, name) -> where and what, for every global statement and module-level state in the product."""
    parsed = {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text(), str(p)) for p in _product_modules()}
    mutated = _mutated(list(parsed.values()))
    found: dict[tuple[str, str], str] = {}
    for rel, tree in parsed.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found.setdefault((rel, name), f"deadpool_ext/{rel}:{node.lineno}: global {name}")
        for name, value, line in _module_bindings(tree):
            kind = _kind(value)
            if kind is None or name == "__all__":
                continue
            if kind == "container" and _is_constant_name(name) and name not in mutated:
                continue  # a constant table
            found.setdefault((rel, name), f"deadpool_ext/{rel}:{line}: {name} is module-level {kind}")
    return found


def test_no_module_state_but_the_listed_process_wide_names():
    found = _module_state()
    unlisted = sorted(where for key, where in found.items() if key not in ALLOWED)
    assert not unlisted, ("module-level state outside the worker's context (rebuild/context.py): move it into an "
                          "object, or, if it is process-wide by nature and no generation's, list it in ALLOWED "
                          "with why:\n" + "\n".join(unlisted))


def test_every_listed_name_is_still_there_and_says_why():
    found = _module_state()
    stale = sorted(f"{mod}: {name}" for (mod, name) in ALLOWED if (mod, name) not in found)
    assert not stale, "ALLOWED lists names that are no longer module state; remove them:\n" + "\n".join(stale)
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_scan_sees_what_it_must():
    tree = ast.parse("import threading\nX = []\n_y = None\n_z = {}\nLOG = threading.Lock()\nS = Thing()\n"
                     "def f():\n    global _y\n    X.append(1)\n")
    bindings = {name: _kind(value) for name, value, _ in _module_bindings(tree)}
    assert bindings == {"X": "container", "_y": "None", "_z": "container", "LOG": None, "S": "instance"}
    assert _mutated([tree]) == {"X"}
    assert _is_constant_name("_GROUP_DEFAULTS") and _is_constant_name("DTYPES") and not _is_constant_name("_names")
