"""Every store value the launcher reads, decoded in one place: size first, then JSON with a depth bound, then the
key's schema. A value that fails is a `BadValue` naming the key and what is allowed (one line, what it echoes
shortened); `StoreValues` reads it as absent and logs that line at most once a minute per key.

Why one bounded decoder: anyone holding the job's token (a worker, a joining machine) can write any key, and
the coordinator's loop must outlive a wrong value there: a nested document exhausting the recursion limit, a
16 MiB blob, a list where an object belongs, ``NaN`` for a time or a name with ``/`` in it. The pure decoders
below are unit-tested without a store (``tests/unit/test_store_values.py``); no function here blocks.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..cluster.assignment import Assignment
from ..store.base import StoreError
from .args import MAX_NODES, MAX_PROCS_PER_NODE, MAX_WORKERS

log = logging.getLogger("deadpool_ext.launcher")

T = TypeVar("T")

NODE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")
"""A node's name (the job's own node0.., spare0.., a joined machine's --join NAME): it becomes part of store keys,
worker ids and a shared-memory directory name."""
WORKER_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}\.[0-9]{1,7}")
"""A worker id: ``<node>.<local index>``."""
MAX_DEPTH = 4
"""Deepest nesting of any value the launcher reads (the assignment: object -> object -> value)."""
SMALL_BYTES = 4096
"""Heartbeats, exit records, join requests and answers, times, policies, the leader record."""
MAX_ASSIGNMENT_BYTES = 32 << 20
"""An assignment of the largest world `deadpool-run` takes (262,144 workers, ~60 bytes each in ranks + nodes)."""
MAX_NAMES = 65536
"""Most node names in one list (dead spares, an assignment's spares), as many as --nnodes takes."""
MAX_RANKS = 262144
"""The largest world ``deadpool-run`` takes (a spare's heartbeat names a rank and a world size within it)."""
MAX_TEXT = 4000
"""Longest free text (a stop message, a refusal reason): what a worker may write as fatal."""
POLICIES = ("fail", "wait", "shrink")
MAX_REPORT = 300
"""Longest error text a survivor's report of a failed collective carries (``suspect/<worker>``)."""
_ECHO = 60


class BadValue(StoreError):
    """A store value the launcher cannot use (its message: the key, what is wrong and what is allowed)."""

    def __init__(self, key: str, what: str) -> None:
        self.key = key
        super().__init__(f"store key {echo(key)}: {what}")


def echo(value: object, limit: int = _ECHO) -> str:
    """`value` for an error line: repr, cut to `limit` characters with the original length said."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _depth(obj: Any, limit: int) -> bool:
    """Whether `obj` nests at most `limit` containers deep (iterative: a deep value cannot exhaust the stack)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def decode_json(key: str, raw: bytes | bytearray, max_bytes: int = SMALL_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """`raw` -> its JSON value: at most `max_bytes`, UTF-8, no NaN/Infinity, nested at most `max_depth` deep.
    `BadValue` for anything else, never another exception."""
    if not isinstance(raw, (bytes, bytearray)):
        raise BadValue(key, f"expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise BadValue(key, f"value of {len(raw)} bytes, at most {max_bytes} allowed")
    try:
        obj = json.loads(bytes(raw).decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise BadValue(key, f"value nested too deeply (at most {max_depth} levels allowed)") from None
    except (UnicodeDecodeError, ValueError) as exc:   # JSONDecodeError, a NaN, an over-long integer literal
        raise BadValue(key, f"not JSON ({echo(str(exc))}): {echo(bytes(raw[:200]))}") from None
    if not _depth(obj, max_depth):
        raise BadValue(key, f"value nested more than {max_depth} levels deep")
    return obj


def _fail(key: str, what: str, got: object) -> BadValue:
    return BadValue(key, f"{what}, got {echo(got)}")


def _int(key: str, field: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _fail(key, f"{field!r} must be an int in [{lo}, {hi}]", v)
    return v


def _num(key: str, field: str, v: object) -> float:
    """A finite number that fits a float (a time, a step, seconds)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(key, f"{field!r} must be a number", v)
    try:
        f = float(v)
    except OverflowError:
        raise _fail(key, f"{field!r} must be a finite number", v) from None
    if not math.isfinite(f):
        raise _fail(key, f"{field!r} must be a finite number", v)
    return f


def _obj(key: str, v: object) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(key, "must be a JSON object", v)
    return v


def _name(key: str, field: str, v: object, pattern: re.Pattern[str] = NODE_RE) -> str:
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise _fail(key, f"{field} must match {pattern.pattern}", v)
    return v


def _text(key: str, field: str, v: object) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise _fail(key, f"{field!r} must be a string of at most {MAX_TEXT} characters", v)
    return v


def _names(key: str, field: str, v: object) -> list[str]:
    if not isinstance(v, list) or len(v) > MAX_NAMES:
        raise _fail(key, f"{field!r} must be a list of at most {MAX_NAMES} node names", v)
    return [_name(key, f"every name in {field!r}", n) for n in v]


# -- one decoder per key -------------------------------------------------------------------------------------
def heartbeat(key: str, raw: bytes) -> dict[str, Any]:
    """``hb/<worker>``: ``{"t", "step", "step_at", "coll", "still_s", "pace"}`` (``rebuild/progress.py``), or a bare
    time from an older worker. Extra fields are kept (a newer worker's)."""
    beat = decode_json(key, raw)
    if not isinstance(beat, dict):
        return {"t": _num(key, "t", beat), "step": -1, "step_at": 0.0, "coll": False, "still_s": 0.0}
    out = dict(beat)
    for field in ("t", "step", "step_at", "still_s"):
        out[field] = _num(key, field, beat.get(field))
    if not isinstance(beat.get("coll"), bool):
        raise _fail(key, "'coll' must be true or false", beat.get("coll"))
    if "pace" in beat:  # [steps, step seconds, collective seconds, measured] (rebuild/progress.py; stragglers)
        p = beat["pace"]
        if not isinstance(p, list) or len(p) != 4 or not isinstance(p[3], bool):
            raise _fail(key, "'pace' must be [steps, step seconds, collective seconds, measured]", p)
        out["pace"] = [_int(key, "pace steps", p[0], 0, 2**53), _num(key, "pace step seconds", p[1]),
                       _num(key, "pace collective seconds", p[2]), p[3]]
    if "prepared" in beat:  # a waiting spare's engine, built ahead for [rank, world size]
        p = beat["prepared"]
        if not isinstance(p, list) or len(p) != 2:
            raise _fail(key, "'prepared' must be [rank, world size]", p)
        out["prepared"] = [_int(key, "prepared rank", p[0], 0, MAX_RANKS - 1),
                           _int(key, "prepared world size", p[1], 1, MAX_RANKS)]
    if "tier3" in beat:  # the newest step it published, verified, as a tier-3 base
        out["tier3"] = _int(key, "tier3", beat["tier3"], 0, 2**53)
    return out


def exit_rc(key: str, raw: bytes) -> int:
    """``exit/<worker>``: ``{"rc": int, "time": t}``, the exit status a launcher saw (negative: the signal)."""
    return _int(key, "rc", _obj(key, decode_json(key, raw)).get("rc"), -255, 255)


def record_time(key: str, raw: bytes) -> float:
    """``dropped/<node>``, ``repaired/<node>``: ``{"time": t, ...}``."""
    return _num(key, "time", _obj(key, decode_json(key, raw)).get("time"))


MAX_LAUNCHES = 1_000_000


def launches(key: str, raw: bytes) -> int:
    """``launched/<host rank>``: ``{"starts": N, "time": t}``, how many times that host's launcher started in this
    job (a restarted one, e.g. its pod restarted by Kubernetes, comes back as a spare: launcher/cli.py)."""
    return _int(key, "starts", _obj(key, decode_json(key, raw)).get("starts"), 1, MAX_LAUNCHES)


def join_nproc(key: str, raw: bytes) -> int:
    """``joined/<name>``: ``{"nproc": N, "time": t}``, a machine asking to join with N processes."""
    return _int(key, "nproc", _obj(key, decode_json(key, raw)).get("nproc"), 1, MAX_PROCS_PER_NODE)


@dataclass(frozen=True, slots=True)
class JoinAck:
    """``join_ack/<name>``: the coordinator's answer to a join request."""

    ok: bool
    why: str = ""
    role: str = ""   # "grow" or "spare" when admitted


def join_ack(key: str, raw: bytes) -> JoinAck:
    d = _obj(key, decode_json(key, raw))
    ok = d.get("ok")
    if not isinstance(ok, bool):
        raise _fail(key, "'ok' must be true or false", ok)
    why = _text(key, "why", d.get("why", ""))
    role = d.get("as", "")
    if role not in ("", "grow", "spare"):
        raise _fail(key, "'as' must be 'grow' or 'spare'", role)
    return JoinAck(ok, why, role)


@dataclass(frozen=True, slots=True)
class Report:
    """``suspect/<worker>``: a survivor's report that a collective of ``generation`` failed (``time``: its clock)."""

    generation: int
    time: float
    what: str


def suspect(key: str, raw: bytes) -> Report:
    """``suspect/<worker>``: ``{"generation": int, "time": t, "what": text of at most MAX_REPORT characters}``;
    nothing else."""
    d = _obj(key, decode_json(key, raw))
    extra = sorted(set(d) - {"generation", "time", "what"})
    if extra:
        raise _fail(key, "unknown field(s) (allowed: generation, time, what)", extra)
    what = d.get("what", "")
    if not isinstance(what, str) or len(what) > MAX_REPORT:
        raise _fail(key, f"'what' must be a string of at most {MAX_REPORT} characters", what)
    return Report(_int(key, "generation", d.get("generation"), 0, 1 << 31), _num(key, "time", d.get("time")), what)


@dataclass(frozen=True, slots=True)
class Trained:
    """``trained/<worker>``: the worker's loop ended in ``generation`` after ``step``; ``committed``: the version
    committed on every rank then (None: none)."""

    generation: int
    step: int
    committed: int | None


def trained(key: str, raw: bytes) -> Trained:
    """``trained/<worker>``: ``{"generation": int, "step": int, "committed": int or null}``; nothing else."""
    d = _obj(key, decode_json(key, raw))
    extra = sorted(set(d) - {"generation", "step", "committed"})
    if extra:
        raise _fail(key, "unknown field(s) (allowed: generation, step, committed)", extra)
    committed = d.get("committed")
    return Trained(_int(key, "generation", d.get("generation"), 0, 1 << 31),
                   _int(key, "step", d.get("step"), 0, 1 << 62),
                   None if committed is None else _int(key, "committed", committed, 0, 1 << 62))


def straggler_config(key: str, raw: bytes) -> dict[str, Any]:
    """``config/straggler``: ``{"action", "factor", "window_s"}``, each as ``deadpool.straggler`` allows it."""
    from .straggler import setting_error

    v = _obj(key, decode_json(key, raw))
    out = {"action": v.get("action"), "factor": v.get("factor"), "window_s": v.get("window_s")}
    for name, why in (("action", setting_error(out["action"], None, None)),
                      ("factor", setting_error(None, out["factor"], None)),
                      ("window_s", setting_error(None, None, out["window_s"]))):
        if why is not None or out[name] is None:
            raise _fail(key, f"{name!r} " + (why or "is missing").split(", got ")[0], v.get(name))
    return out


def policy(key: str, raw: bytes) -> str:
    """``config/no_spare_policy``, ``launcher/no_spare_policy``: one of :data:`POLICIES`."""
    v = decode_json(key, raw)
    if v not in POLICIES:
        raise _fail(key, f"must be one of {', '.join(POLICIES)}", v)
    return str(v)


@dataclass(frozen=True, slots=True)
class JobFastPaths:
    """``config/fast_paths``: what the section the job's engine attached with says of the fast paths."""

    in_place: bool
    build_ahead: bool
    why: str
    """Why a fast path is off ('' when both are on)."""


def fast_paths(key: str, raw: bytes) -> JobFastPaths:
    """``config/fast_paths``: ``{"in_place": bool, "build_ahead": bool, "why": text of at most MAX_REPORT
    characters}``; nothing else."""
    d = _obj(key, decode_json(key, raw))
    extra = sorted(set(d) - {"in_place", "build_ahead", "why"})
    if extra:
        raise _fail(key, "unknown field(s) (allowed: in_place, build_ahead, why)", extra)
    for field in ("in_place", "build_ahead"):
        if not isinstance(d.get(field), bool):
            raise _fail(key, f"{field!r} must be true or false", d.get(field))
    why = d.get("why", "")
    if not isinstance(why, str) or len(why) > MAX_REPORT:
        raise _fail(key, f"'why' must be a string of at most {MAX_REPORT} characters", why)
    return JobFastPaths(d["in_place"], d["build_ahead"], why)


def node_list(key: str, raw: bytes) -> list[str]:
    """``dead_spares``: a list of node names."""
    return _names(key, "value", decode_json(key, raw, max_bytes=MAX_NAMES * 80))


def leader(key: str, raw: bytes) -> dict[str, Any]:
    """``leader``: ``{"host_rank": int, "host": str}`` (``leader.py``)."""
    d = _obj(key, decode_json(key, raw))
    host = d.get("host", "")
    if not isinstance(host, str) or len(host) > 255:
        raise _fail(key, "'host' must be a string of at most 255 characters", host)
    return {"host_rank": _int(key, "host_rank", d.get("host_rank"), 0, MAX_NODES), "host": host}


def fatal_text(key: str, raw: bytes) -> str:
    """``fatal``: UTF-8 text a worker wrote (what cannot be recovered), at most :data:`MAX_TEXT` bytes shown."""
    if not isinstance(raw, (bytes, bytearray)):
        raise BadValue(key, f"expected bytes, got {type(raw).__name__}")
    return bytes(raw[:MAX_TEXT]).decode(errors="replace")


MAX_SLOT_BYTES = 1 << 40
"""A published slot size above this is not a slot size."""


def slot_size(key: str, raw: bytes) -> int:
    """``slots/<rank>``: the rank's snapshot slot bytes (an int in 1..:data:`MAX_SLOT_BYTES`)."""
    return _int(key, "value", decode_json(key, raw), 1, MAX_SLOT_BYTES)


MAX_HELD_BUFFERS = 64
"""A published count of replica buffers above this is not one (replication factor x double buffer)."""


def held_buffers(key: str, raw: bytes) -> int:
    """``held/<rank>``: how many replica buffers the rank holds (an int in 0..:data:`MAX_HELD_BUFFERS`)."""
    return _int(key, "value", decode_json(key, raw), 0, MAX_HELD_BUFFERS)


MAX_CLIENT_JSON_BYTES = 64 << 10
"""The largest client state (as JSON) a script's save may carry in snapshots and in ``client_state/<rank>``."""
MAX_CLIENT_STATE_BYTES = MAX_CLIENT_JSON_BYTES + 1024
"""A ``client_state/<rank>`` record: the client state and the counters beside it."""
CLIENT_STATE_DEPTH = 16
"""Deepest nesting of a script's client state (its own dicts and lists inside the record's two levels)."""
COUNTER_NAMES = ("global_steps", "micro_steps", "global_samples")
"""The engine counters a client-state record names, in the order a step-like key is matched to them (DeepSpeed's
engine attributes; ``integrations/deepspeed/checkpoint_calls.py``)."""


@dataclass(frozen=True, slots=True)
class ClientState:
    """``client_state/<rank>``: the client state the rank's script last gave ``save_checkpoint`` (JSON-able part)
    and the engine's counters then."""

    saved: dict[str, Any]
    at: dict[str, int]


def client_state(key: str, raw: bytes) -> ClientState:
    """``client_state/<rank>``: ``{"saved": object, "at": {counter: int}}`` (counters among
    :data:`COUNTER_NAMES`, ``global_steps`` required); nothing else."""
    d = _obj(key, decode_json(key, raw, MAX_CLIENT_STATE_BYTES, CLIENT_STATE_DEPTH))
    extra = sorted(set(d) - {"saved", "at"})
    if extra:
        raise _fail(key, "unknown field(s) (allowed: saved, at)", extra)
    saved = _obj(key, d.get("saved"))
    at = _obj(key, d.get("at"))
    unknown = sorted(set(at) - set(COUNTER_NAMES))
    if unknown or "global_steps" not in at:
        raise _fail(key, f"'at' must name global_steps and at most {', '.join(COUNTER_NAMES)}", sorted(at))
    return ClientState(saved, {c: _int(key, f"at.{c}", v, 0, 1 << 62) for c, v in at.items()})


def host_index(key: str) -> int | None:
    """``host/<i>``'s index, None for a key that is not one (a lease of a launcher that is not ours)."""
    tail = key.split("/", 1)[-1]
    if not tail.isascii() or not tail.isdigit() or len(tail) > 6 or int(tail) >= MAX_NODES:
        return None
    return int(tail)


@dataclass(frozen=True, slots=True)
class Published:
    """``assignment``: the generation every launcher and worker follows, and the stop message if the job stops."""

    assignment: Assignment
    stop: str | None = None


def assignment(key: str, raw: bytes) -> Published:
    """``assignment`` (``Assignment.to_json``, plus ``stop`` when the coordinator stopped the job). Names are
    checked (they become shared-memory paths and worker ids), ranks must be 0..world_size-1 once each, and every
    worker's node listed."""
    d = _obj(key, decode_json(key, raw, max_bytes=MAX_ASSIGNMENT_BYTES))
    known = {"generation", "world_size", "ranks", "nodes", "spares", "replaced", "master_port", "master_addr",
             "shrunk", "grown", "stop"}
    extra = sorted(set(d) - known)
    if extra:
        raise _fail(key, f"unknown field(s) (allowed: {', '.join(sorted(known))})", extra)
    generation = _int(key, "generation", d.get("generation"), 0, 1 << 31)
    world = _int(key, "world_size", d.get("world_size"), 1, MAX_WORKERS)
    ranks, nodes = d.get("ranks"), d.get("nodes")
    if not isinstance(ranks, dict) or not isinstance(nodes, dict) or len(ranks) != world or set(ranks) != set(nodes):
        raise _fail(key, f"'ranks' and 'nodes' must be objects over the same {world} worker ids", type(ranks).__name__)
    for wid, r in ranks.items():
        _name(key, "a worker id", wid, WORKER_RE)
        _int(key, f"ranks[{wid}]", r, 0, world - 1)
        node = _name(key, f"nodes[{wid}]", nodes[wid])
        if wid.rsplit(".", 1)[0] != node:
            raise _fail(key, f"worker {wid} must be on node {wid.rsplit('.', 1)[0]}", node)
    if len(set(ranks.values())) != world:
        raise _fail(key, f"every rank 0..{world - 1} must be held once", sorted(ranks.values())[:8])
    replaced = d.get("replaced", {})
    if not isinstance(replaced, dict):
        raise _fail(key, "'replaced' must be an object of node names", replaced)
    for failed, spare in replaced.items():
        _name(key, "a node in 'replaced'", failed)
        _name(key, "a node in 'replaced'", spare)
    addr = d.get("master_addr", "127.0.0.1")
    if not isinstance(addr, str) or not 0 < len(addr) <= 255:
        raise _fail(key, "'master_addr' must be a host of 1-255 characters", addr)
    stop = d.get("stop")
    a = Assignment(generation=generation, world_size=world, ranks=dict(ranks), nodes=dict(nodes),
                   spares=tuple(_names(key, "spares", d.get("spares", []))), replaced=dict(replaced),
                   master_port=_int(key, "master_port", d.get("master_port", 0), 0, 65535), master_addr=addr,
                   shrunk=tuple(_names(key, "shrunk", d.get("shrunk", []))),
                   grown=tuple(_names(key, "grown", d.get("grown", []))))
    return Published(a, None if stop is None else _text(key, "stop", stop))


# -- reading through the schemas ------------------------------------------------------------------------------
BAD_VALUE_LOG_S = 60.0
"""A bad value under one key is logged at most this often (the coordinator reads some keys every turn)."""


class StoreValues:
    """The launcher's reads: `get` and `items` decode through a schema above; a bad value reads as absent, with
    one warning line per key per :data:`BAD_VALUE_LOG_S` (the line names the key and what is allowed)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._logged: dict[str, float] = {}
        self.refused = 0

    @property
    def warned(self) -> list[str]:
        """The keys a warning line has named, sorted (a key is named again after :data:`BAD_VALUE_LOG_S`; the table
        is cleared past 4096 keys)."""
        return sorted(self._logged)

    def bad(self, exc: BadValue) -> None:
        self.refused += 1
        key = exc.key[:200]
        now = time.monotonic()
        if now - self._logged.get(key, -math.inf) >= BAD_VALUE_LOG_S:
            if len(self._logged) > 4096:   # a flood of bad keys must not grow this without bound
                self._logged.clear()
            self._logged[key] = now
            log.warning("ignored a bad value in the store: %s", exc)

    def decode(self, key: str, raw: bytes | None, schema: Callable[[str, bytes], T]) -> T | None:
        if raw is None:
            return None
        try:
            return schema(key, raw)
        except BadValue as exc:
            self.bad(exc)
            return None

    def get(self, key: str, schema: Callable[[str, bytes], T]) -> T | None:
        """The decoded value of `key`, None if it is missing or bad (logged)."""
        return self.decode(key, self.store.get(key), schema)

    def items(self, prefix: str, schema: Callable[[str, bytes], T],
              name: re.Pattern[str] = NODE_RE) -> dict[str, T]:
        """``{name: value}`` of the keys ``<prefix><name>`` whose name matches `name` and whose value decodes;
        the others are logged and left out."""
        out: dict[str, T] = {}
        for key, raw in self.store.list(prefix).items():
            tail = key[len(prefix):]
            if not name.fullmatch(tail):
                self.bad(BadValue(key, f"the name after {prefix!r} must match {name.pattern}"))
                continue
            v = self.decode(key, raw, schema)
            if v is not None:
                out[tail] = v
        return out
