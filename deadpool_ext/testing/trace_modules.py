"""Which deadpool_ext modules run code during one in-place hot-swap, per role (survivor, spare, launcher).

**A tool, not part of the product** (issue 31, part 8: "the map"). It measures what ``docs/architecture.md``
states: how many modules a reader must open to follow one in-place recovery.

How it measures. ``run`` launches the tiny-model hot-swap of ``tests/integration/test_hot_swap.py`` (deadpool-run,
3 nodes of 1 rank, 1 spare, ZeRO-3 on CPU) with ``trace_boot/`` on the job's ``PYTHONPATH``: its
``sitecustomize`` calls ``trace_hook.install`` in every Python process of the job (launcher, workers, spare), which
sets a ``sys.settrace`` / ``threading.settrace`` call hook. The hook returns None (no line tracing) and, for a
function of the package, records (module, function, thread) with the first and last call time in each 50 ms of wall
time, plus the nearest calling module of the package (the module-level call graph); an ``after_step`` hook point
callback (``hooks.py``) records when each step completed. Each process writes ``<pid>.json`` into the folder
``DEADPOOL_TRACE_MODULES`` names, once a second and at exit (``trace_hook.py``). The product holds no hook for
this: without that folder on ``PYTHONPATH`` nothing is installed.

Once the job reaches step ``--fault-step``, node1's worker is SIGKILLed (the time is written to the timeline as
the test's injector does). The window of a process is [the fault, the first step it completed after its own
``recover`` timeline event]; the launcher's ends with the last worker's. A module counts for a role when a
function of it (not only its import) ran inside the window in any process of that role.

The reader's count. Of the modules that ran, those a reader must open to follow the recovery are the ones that
carry its control flow: the driver, the decisions, the protocol between processes, the restore. The rest are
**leaves** (:data:`LEAVES`, each with its reason): they answer a question, record, or move bytes, and hand control
back, deciding nothing of the recovery, so a reader takes each call at its name: names, schemas and parsing (logs,
config, the launcher's contract, store keys and values); records (timeline events, typed stats); the storage side
of the memory tiers (how bytes are laid out, moved and checked, never which bytes: DCP's split, the planner and the
executor are read); the store's clients and server (get / set / wait, as ``store/base.py`` states them); plumbing
that decides nothing (JSON collectives, ranks -> nodes, the state's holder, what a heartbeat reports). A leaf that
calls a non-leaf module inside the window is flagged by the report (it would not be a leaf). Tools beside the product
(``chaos``, ``sim``, ``testing``, ``training``: here the demo's loop) and the user's script are listed, not counted.

Launch (about a minute on 2 CPU cores; an end-to-end job, so one at a time)::

    flock /tmp/e2e.lock nice -n 19 env TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions DS_ACCELERATOR=cpu \\
        .venv/bin/python -m deadpool_ext.testing.trace_modules run --out /tmp/trace_recovery
    .venv/bin/python -m deadpool_ext.testing.trace_modules report /tmp/trace_recovery [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rebuild import warm
from .trace_hook import BOOT_DIR, BUCKET_S, ENV, REPO

TOOLS = ("deadpool_ext.chaos", "deadpool_ext.sim", "deadpool_ext.testing", "deadpool_ext.training")
"""Packages beside the product (their docstrings say so): listed by the report, never counted."""

# -- the leaf rule ---------------------------------------------------------------------------------------------

LEAVES: dict[str, str] = {
    # names, schemas and parsing
    "deadpool_ext.logs": "the log handler's prefix",
    "deadpool_ext.config": "typed config parsing",
    "deadpool_ext.hooks": "the hook-point registry",
    "deadpool_ext.launcher.contract": "the launcher -> worker variables, parsed once",
    "deadpool_ext.launcher.keys": "store key names and value builders",
    "deadpool_ext.launcher.values": "store value schemas and the bounded decoder",
    "deadpool_ext.launcher.actions": "the coordinator's action records (decide.py decides them)",
    "deadpool_ext.launcher.hostlist": "which host am I",
    "deadpool_ext.cluster.assignment": "the assignment record (the store's `assignment` value) and its accessors",
    "deadpool_ext.snapshot.state": "the state adapter's ABC and its tensor-copy and RNG helpers (the framework's "
                                   "adapter, which says which tensors, is read)",
    "deadpool_ext.launcher.args": "the command line",
    "deadpool_ext": "the public API's imports on first use",
    "deadpool_ext.integrations.deepspeed.wrappers": "where a DeepSpeed optimizer wrapper keeps its tensors",
    # records
    "deadpool_ext.recovery.timeline": "timeline events written as JSON lines",
    "deadpool_ext.snapshot.stats": "typed counters",
    # bytes and their storage (DCP's storage side: how bytes are laid out, moved and checked, never which)
    "deadpool_ext.snapshot.format": "the blob's byte framing and checksums",
    "deadpool_ext.snapshot.skeleton": "the state skeleton codec",
    "deadpool_ext.snapshot.rng_json": "RNG state as JSON",
    "deadpool_ext.snapshot.slots": "a slot's write protocol and its read into the state",
    "deadpool_ext.snapshot.tier1": "the tier-1 segments: open, scan",
    "deadpool_ext.replicate.transport": "the byte mover's ABC",
    "deadpool_ext.replicate.gloo": "the byte mover over gloo",
    "deadpool_ext.replicate.auth": "HMAC tags",
    "deadpool_ext.memory.shm": "named shared-memory files",
    "deadpool_ext.memory.trust": "owner / mode checks",
    "deadpool_ext.memory.heap": "malloc_trim",
    "deadpool_ext.memory.pinned": "pinned host memory (a no-op on CPU)",
    "deadpool_ext.memory.agent": "the node agent's directory claim",
    "deadpool_ext.persist.regular": "safe file opens",
    "deadpool_ext.persist.sign": "the checkpoint key",
    "deadpool_ext.snapshot.spare_slots": "a spare's pre-made segments renamed to its rank's",
    "deadpool_ext.replicate.peer": "tier 2's replica mover: writes, lists and serves the copies the planner names",
    "deadpool_ext.cluster.placement": "how replicas are laid out over nodes: a pure function of the world, the same "
                                      "at start and after a swap",
    # the store and its clients (get / set / wait as store/base.py's ABC states them)
    "deadpool_ext.store": "the store package",
    "deadpool_ext.store.base": "the store ABC and its errors",
    "deadpool_ext.store.connect": "the client for a URL",
    "deadpool_ext.store.embedded": "the launcher's key-value server",
    "deadpool_ext.store.table": "the key-value server's table",
    "deadpool_ext.store.auth": "HMAC challenge-response",
    "deadpool_ext.store.admission": "connection slots",
    "deadpool_ext.store.rendezvous": "torch's Store interface over the job's store",
    "deadpool_ext.store.c10d": "a c10d store bound to one host",
    # process plumbing that decides nothing
    "deadpool_ext.cluster.comm": "JSON all-gather / broadcast of control messages",
    "deadpool_ext.cluster.topology": "ranks -> nodes",
    "deadpool_ext.cluster.netif": "gloo's listening interface",
    "deadpool_ext.rebuild.context": "the process's state: fields, no control flow",
    "deadpool_ext.rebuild.progress": "what a heartbeat reports",
    "deadpool_ext.rebuild.timed_work": "an asynchronous collective's wait, timed for the pace",
    "deadpool_ext.snapshot.priority": "the snapshot thread's CPU priority",
    "deadpool_ext.integrations.importhook": "after-import callbacks",
}
"""Modules a reader takes at their name, each with why (see the module docstring for the rule)."""


# -- the job ---------------------------------------------------------------------------------------------------


def run(out: str, *, stage: int, iters: int, fault_step: int, victim: str, timeout_s: float) -> int:
    """The hot-swap of ``test_sigkill_hot_swap_identical_losses``, traced; returns the job's exit status."""
    import shutil
    import signal
    import uuid

    import psutil

    from ..launcher.contract import WORKER_ID
    from ..recovery.timeline import read_events
    from .jobs import Job
    from .launch import run_job, wait_for_step
    from .wait import wait_until

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.endswith((".json", ".jsonl", ".tmp", ".log")):
            os.unlink(os.path.join(out, name))
    traces = os.path.join(out, "procs")
    os.makedirs(traces, exist_ok=True)
    for name in os.listdir(traces):
        os.unlink(os.path.join(traces, name))
    shm_root = f"/dev/shm/dp-trace-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm_root)
    with open(os.path.join(REPO, "configs", "gpt_tiny_zero3_cpu.json")) as fh:
        cfg = json.load(fh)
    cfg["zero_optimization"] = {"stage": stage}
    cfg["deadpool"] = {"local": {"shm_root": shm_root}}
    config = os.path.join(out, "ds_config.json")
    with open(config, "w") as fh:
        json.dump(cfg, fh)
    metrics = os.path.join(out, "metrics.jsonl")
    timeline = os.path.join(out, "timeline.jsonl")
    path = [BOOT_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    job = Job(script="scripts/pretrain_gpt.py", nnodes=3, nproc_per_node=1, spare_nodes=1, shm_root=shm_root,
              timeline=timeline, config=config, args=("--train-iters", str(iters)), metrics=metrics,
              env_vars={ENV: traces, "PYTHONPATH": os.pathsep.join(path)})

    def worker(launcher_pid: int, wid: str) -> psutil.Process:
        def find() -> psutil.Process | None:
            for p in psutil.Process(launcher_pid).children(recursive=True):
                try:
                    if p.environ().get(WORKER_ID) == wid and p.name() != warm.PARENT_NAME:
                        return p
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            return None
        return wait_until(find, 120, f"worker {wid} under launcher pid {launcher_pid}", interval_s=0.05)

    failed: list[str] = []

    def inject(proc: Any) -> None:
        try:
            wait_for_step(metrics, fault_step, timeout_s=timeout_s, proc=proc)
        except (RuntimeError, TimeoutError) as exc:  # the job's own output says why: kept in job.log
            failed.append(str(exc))
            return
        target = worker(proc.pid, victim)
        at = time.time()
        with open(timeline, "a") as fh:
            fh.write(json.dumps({"event": "fault", "time": at, "worker": victim, "signal": int(signal.SIGKILL),
                                 "source": "injector"}) + "\n")
        target.send_signal(signal.SIGKILL)
        with open(os.path.join(out, "fault.json"), "w") as fh:
            json.dump({"time": at, "worker": victim, "pid": target.pid, "step": fault_step}, fh)

    try:
        res = run_job(job.argv(), timeout_s=timeout_s, while_running=inject, env=job.env())
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    with open(os.path.join(out, "job.log"), "w") as fh:
        fh.write(res.output)
    if failed:
        print(f"no fault injected: {failed[0]}; the job's output: {os.path.join(out, 'job.log')}")
        return 1
    kinds = [e.get("event") for e in read_events(timeline)] if os.path.exists(timeline) else []
    print(f"job: exit {res.returncode} in {res.elapsed_s:.0f}s{' (timed out)' if res.timed_out else ''}; "
          f"timeline: {kinds.count('recover')} recover events; log {os.path.join(out, 'job.log')}")
    return 0 if res.returncode == 0 and not res.timed_out else 1


# -- the report ------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One traced process and its window."""

    pid: int
    role: str
    worker_id: str | None
    rec: dict[str, Any]
    window: tuple[float, float] | None = None


@dataclass
class RoleCount:
    """What ran in one role's windows."""

    role: str
    procs: list[int]
    windows: list[tuple[float, float]]
    product: dict[str, list[str]] = field(default_factory=dict)   # module -> functions (thread-tagged) that ran
    tools: dict[str, list[str]] = field(default_factory=dict)
    imported_only: list[str] = field(default_factory=list)
    edges: list[tuple[str, str, bool]] = field(default_factory=list)  # (caller, callee, called directly)

    @property
    def reader(self) -> list[str]:
        """The modules a reader must open: those that ran, less the leaves and the only-constructed."""
        built = set(self.constructed)
        return sorted(m for m in self.product if m not in LEAVES and m not in built)

    @property
    def constructed(self) -> list[str]:
        """Modules of which only constructors ran (an object built for later, e.g. a differential ring with
        differentials off): a reader sees the call and need not open the module to follow the recovery."""
        out = []
        for m, fns in self.product.items():
            ran = {f.split(" [")[0] for f in fns}
            ran = {f for f in ran if not any(part.startswith("<") for part in f.split("."))}
            if m not in LEAVES and ran and all(f.rsplit(".", 1)[-1] in _CONSTRUCTORS for f in ran):
                out.append(m)
        return sorted(out)

    @property
    def leaves(self) -> list[str]:
        return sorted(m for m in self.product if m in LEAVES)

    def flagged_leaves(self) -> list[tuple[str, str]]:
        """Leaf -> non-leaf calls inside the window (a leaf should hand control back, not drive)."""
        return sorted({(a, b) for a, b, direct in self.edges
                       if direct and a in LEAVES and b in self.product and b not in LEAVES})


_CONSTRUCTORS = {"__init__", "__post_init__", "__new__"}
ENTERED_BEFORE = "(a frame entered before the window)"


def _product(mod: str) -> bool:
    return mod.startswith("deadpool_ext") and not mod.startswith(TOOLS)


def load(out: str, left_out: list[tuple[str, str]] | None = None) -> tuple[list[Proc], float, list[dict[str, Any]]]:
    """The traced processes with their roles, the fault time and the timeline. A trace that is not complete JSON
    (its process was killed while writing it) is left out with a line, and ``(path, why)`` is appended to
    ``left_out`` when given."""
    from ..recovery.timeline import read_events

    with open(os.path.join(out, "fault.json")) as fh:
        fault = json.load(fh)
    events = read_events(os.path.join(out, "timeline.jsonl"))
    roles = {e["pid"]: e["role"] for e in events if e.get("event") == "recover" and "pid" in e}
    procs = []
    traces = os.path.join(out, "procs")
    for name in sorted(os.listdir(traces)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(traces, name)) as fh:
                rec = json.load(fh)
        except ValueError as exc:
            print(f"{os.path.join(traces, name)}: not a complete trace ({exc}); that process is left out")
            if left_out is not None:
                left_out.append((os.path.join(traces, name), f"not a complete trace ({exc})"))
            continue
        argv = " ".join(rec.get("argv") or []).replace(os.sep, ".")  # `-m pkg.mod` reads as pkg/mod.py once run
        pid = int(rec["pid"])
        if "deadpool_ext.launcher.cli" in argv:
            role = "launcher"
        elif pid == fault["pid"]:
            role = "failed"
        elif pid in roles:
            role = roles[pid]
        elif "deadpool_ext.memory.agent" in argv:
            role = "node agent"
        elif rec.get("worker_id"):
            role = "worker (no recover event)"
        else:
            role = "other"
        procs.append(Proc(pid, role, rec.get("worker_id"), rec))
    t_fault = float(fault["time"])
    recovered_at = {e["pid"]: float(e["time"]) for e in events if e.get("event") == "recover" and "pid" in e}
    for p in procs:
        if p.role in ("survivor", "spare"):
            after = recovered_at[p.pid]
            ends = [t for _, _, t in p.rec["steps"] if t > after]
            p.window = (t_fault, ends[0]) if ends else None
    ends = [p.window[1] for p in procs if p.window is not None]
    for p in procs:
        if p.role in ("launcher", "node agent") and ends:
            p.window = (t_fault, max(ends))
    return procs, t_fault, events


JOIN = ("deadpool_ext.rebuild.recover", "Recovery.join_survivors")
"""Where a spare's solo engine build ends and its joining begins: :func:`count`'s ``since`` for the spare's second
figure (the build is the framework's attach, the start-up every worker runs; the recovery's own part follows)."""


def _since(p: Proc, call: tuple[str, str]) -> tuple[float, float] | None:
    assert p.window is not None
    lo = p.window[0]
    first = [t0 for m, f, _, spans in p.rec["calls"] if (m, f) == call for t0, _ in spans if t0 >= lo]
    return (min(first), p.window[1]) if first else None


def count(procs: Iterable[Proc], role: str, since: tuple[str, str] | None = None) -> RoleCount:
    """What ran in the windows of ``role``'s processes (a union over them); ``since`` (module, function): each
    window starts at that function's first call in it instead."""
    mine = [p for p in procs if p.role == role and p.window is not None]
    if since is not None:
        mine = [Proc(p.pid, p.role, p.worker_id, p.rec, _since(p, since)) for p in mine]
        mine = [p for p in mine if p.window is not None]
    rc = RoleCount(role, [p.pid for p in mine], [p.window for p in mine if p.window is not None])
    product: dict[str, set[str]] = defaultdict(set)
    tools: dict[str, set[str]] = defaultdict(set)
    imported: set[str] = set()
    edges: set[tuple[str, str, bool]] = set()
    for p in mine:
        assert p.window is not None
        lo, hi = p.window
        blo, bhi = int(lo / BUCKET_S), int(hi / BUCKET_S)
        for mod, fn, thread, spans in p.rec["calls"]:
            if any(last >= lo and first <= hi for first, last in spans):
                where = "" if thread == "MainThread" else f" [{thread}]"
                (product if _product(mod) else tools)[mod].add(fn + where)
        for mod, b in p.rec["imports"].items():
            if blo <= b <= bhi:
                imported.add(mod)
        for a, b, direct, buckets in p.rec["edges"]:
            if any(blo <= x <= bhi for x in buckets):
                edges.add((a, b, direct))
                if direct and a not in product and a not in tools and any(blo < x < bhi for x in buckets):
                    # its code ran in the window in a frame entered before it (a loop's generator that catches
                    # the failure): a call hook sees only calls, the direct call out of that frame shows it ran
                    # (edges are kept per 50 ms: one in the window's first or last 50 ms is not enough)
                    (product if _product(a) else tools)[a].add(ENTERED_BEFORE)
    rc.product = {m: sorted(f) for m, f in sorted(product.items())}
    rc.tools = {m: sorted(f) for m, f in sorted(tools.items())}
    rc.imported_only = sorted(m for m in imported if m not in product and m not in tools)
    rc.edges = sorted(edges)
    return rc


ROLES = ("survivor", "spare", "launcher")


def _source(mod: str) -> str | None:
    rel = mod.split(".")
    if rel[:2] == ["deadpool_ext", "patches"]:
        rel = rel[1:]
    base = os.path.join(REPO, *rel)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _count(stmt: Any) -> int:
    """Statements in ``stmt``, nested ones included (a loop's body), nested functions and classes left out."""
    import ast

    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return 0
    n = 1
    for c in ast.iter_child_nodes(stmt):
        if isinstance(c, ast.stmt):
            n += _count(c)
        elif not isinstance(c, ast.expr):  # an except handler, a match case: their bodies
            n += sum(_count(x) for x in ast.iter_child_nodes(c) if isinstance(x, ast.stmt))
    return n


def statements(mod: str) -> dict[str, int]:
    """qualname -> how many statements its body has, nested ones included, docstring left out (every function of
    ``mod``)."""
    import ast

    path = _source(mod)
    if path is None:
        return {}
    with open(path) as fh:
        tree = ast.parse(fh.read())
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                out[prefix + child.name] = sum(_count(stmt) for stmt in body)
                walk(child, prefix + child.name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
    walk(tree, "")
    return out


def pass_throughs(c: RoleCount) -> list[str]:
    """The modules to read of which every function that ran has at most two statements (accessors, forwarders): a
    reader opens them only to be sent on. Nested lambdas and comprehensions count with their function."""
    out = []
    for mod in c.reader:
        sizes = statements(mod)
        ran = {f.split(" [")[0] for f in c.product[mod]}
        ran = {f for f in ran if not f.rsplit(".", 1)[-1].startswith("<")}
        if ran and all(sizes.get(f, 99) <= 2 for f in ran):
            out.append(mod)
    return out


def report(out: str, *, as_json: bool = False, functions: bool = False) -> int:
    left_out: list[tuple[str, str]] = []
    procs, t_fault, events = load(out, left_out)
    counts = {r: count(procs, r) for r in ROLES}
    joined = count(procs, "spare", since=JOIN)
    joined.role = "spare, from its join (after its solo engine build)"
    counts[joined.role] = joined
    missing = [r for r in ROLES if not counts[r].procs]
    if as_json:
        print(json.dumps({r: {"processes": c.procs, "windows_s": [round(b - a, 2) for a, b in c.windows],
                              "reader": c.reader, "leaves": c.leaves, "constructed": c.constructed,
                              "tools": sorted(c.tools),
                              "imported_only": c.imported_only, "edges": c.edges,
                              "pass_throughs": pass_throughs(c),
                              "functions": c.product} for r, c in counts.items()}
                          | {"left_out": [{"trace": path, "why": why} for path, why in left_out]}, indent=1))
        return 1 if missing else 0
    print(f"fault at {time.strftime('%H:%M:%S', time.gmtime(t_fault))} UTC; processes: "
          + ", ".join(f"{p.pid} {p.role}{' ' + p.worker_id if p.worker_id else ''}" for p in procs))
    for role, c in counts.items():
        if not c.procs:
            print(f"\n{role}: no process with a complete window (see the timeline and job.log)")
            continue
        span = ", ".join(f"{b - a:.1f}s" for a, b in c.windows)
        print(f"\n== {role} (pids {c.procs}; window {span}): {len(c.reader)} modules to read, "
              f"{len(c.leaves)} leaves, {len(c.constructed)} only constructed, {len(c.product)} product modules ran")
        print("  read:   " + ", ".join(m.removeprefix("deadpool_ext.") for m in c.reader))
        print("  leaves: " + ", ".join(m.removeprefix("deadpool_ext.") for m in c.leaves))
        if c.constructed:
            print("  only constructed (not counted): " + ", ".join(m.removeprefix("deadpool_ext.")
                                                                  for m in c.constructed))
        if c.tools:
            print("  tools and script (not counted): " + ", ".join(m.removeprefix("deadpool_ext.") for m in c.tools))
        if c.imported_only:
            print("  imported only (not counted): " + ", ".join(m.removeprefix("deadpool_ext.")
                                                              for m in c.imported_only))
        thin = pass_throughs(c)
        if thin:
            print("  pass-throughs (each function that ran has <= 2 statements): "
                  + ", ".join(m.removeprefix("deadpool_ext.") for m in thin))
        for a, b in c.flagged_leaves():
            print(f"  ! leaf {a} calls {b} inside the window")
        if functions:
            for mod in c.reader:
                calls = sorted({a for a, b, _ in c.edges if b == mod})
                print(f"  {mod}  <- {', '.join(x.removeprefix('deadpool_ext.') for x in calls) or '(entry)'}")
                print("      " + ", ".join(c.product[mod]))
    return 1 if missing else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deadpool_ext.testing.trace_modules", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch the traced hot-swap, then report")
    r.add_argument("--out", required=True, help="folder for the traces, timeline, metrics and the job's log")
    r.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    r.add_argument("--iters", type=int, default=8, help="optimizer steps of the job")
    r.add_argument("--fault-step", type=int, default=4, help="SIGKILL the victim once this step completed")
    r.add_argument("--victim", default="node1.0", help="the worker id killed")
    r.add_argument("--timeout-s", type=float, default=400.0, help="deadline of the whole job")
    r.add_argument("--functions", action="store_true", help="also list each module's functions and callers")
    s = sub.add_parser("report", help="count the modules of a finished run's traces")
    s.add_argument("out", help="the --out folder of a run")
    s.add_argument("--json", action="store_true", help="machine-readable")
    s.add_argument("--functions", action="store_true", help="also list each module's functions and callers")
    args = p.parse_args(argv)
    if args.cmd == "run":
        if args.fault_step >= args.iters:
            p.error(f"--fault-step {args.fault_step} must be below --iters {args.iters}")
        rc = run(args.out, stage=args.stage, iters=args.iters, fault_step=args.fault_step, victim=args.victim,
                 timeout_s=args.timeout_s)
        if rc:
            return rc
        return report(args.out, functions=args.functions)
    return report(args.out, as_json=args.json, functions=args.functions)


if __name__ == "__main__":
    sys.exit(main())
