"""DeepSpeed's own resume pattern, served from memory: ``engine.load_checkpoint(dir)`` returns the newest verified
in-memory version when memory holds one newer than ``dir``, with the client state the script would have saved.

A script written as DeepSpeed's tutorials write it resumes like this, and nothing else::

    _, client_sd = engine.load_checkpoint(args.save_dir)       # (None, None) on a fresh start
    step = client_sd["step"] if client_sd else 0
    ...
    client_sd["step"] = step
    engine.save_checkpoint(args.save_dir, client_state=client_sd)

With the ``"deadpool"`` section the runtime wraps both calls on the engine (:class:`CheckpointCalls`):

- ``save_checkpoint`` is DeepSpeed's; the client state it was given (its JSON-able part) and the engine's counters
  then ride in every later snapshot (client-state key :data:`KEY`). A save at step N comes after the snapshot of
  step N, so under ``deadpool-run`` each rank also publishes it in the job's store (``client_state/<rank>``,
  ``launcher/keys.py``): a spare restored to step N takes the newest record of a save at or before N
  (:func:`newest_saved`), not the older one the snapshot carries (or none, when N was the first save). Before
  the script's first save, the snapshots carry the loop's own step-like counters instead, and a survivor
  recovering in place publishes them as they stand (:meth:`CheckpointCalls.state`,
  :meth:`CheckpointCalls.publish_live`, :func:`script_counters`): a restart or a spare counts from where the loop
  was, not from 0.
- ``load_checkpoint`` loads ``dir`` as DeepSpeed does when it holds a checkpoint (not in a spare that takes a lost
  node's place: the survivors restore from memory, and so does it), then asks the memory tiers for a version newer
  than that step (``resume(newer_than=...)``: collective, every rank agrees). When memory wins, it
  returns ``("memory:step<N>", client_state)``, the client state being the one last saved with its step-like keys
  (:func:`rebase`) moved as far as the engine's counters moved. Otherwise DeepSpeed's own return.
- Only the first ``load_checkpoint`` of a process that has not restored yet is served from memory, and only a
  whole resume (``load_module_only``, ``load_optimizer_states=False``, ``load_lr_scheduler_states=False`` or a
  ``custom_load_fn`` are DeepSpeed's alone). The extension's own loads (tier 3) pass through (:meth:`internal`).

Call order: ``CheckpointCalls(engine, runtime)`` at attach (wraps both methods); ``state()`` at every snapshot;
``restore(value)`` with a restored snapshot's client state.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import sysconfig
from collections.abc import Iterator
from typing import Any, TypeGuard

from ...launcher import keys, values
from ...recovery.timeline import write_event

log = logging.getLogger("deadpool_ext")

KEY = "deadpool_ds_client"
"""The client-state key of the script's last saved client state and the counters it was saved at."""

COUNTERS = values.COUNTER_NAMES
"""The engine counters a step-like key of the client state may follow, in the order they are tried."""

STEP_LIKE = re.compile(r"step|iter|sample|batch", re.IGNORECASE)
"""Names of client-state keys that may count what an engine counter counts."""
NOT_A_COUNT = re.compile(r"size|max|min|total|interval|every|per_|limit|num_", re.IGNORECASE)
"""Step-like names of a loop's variables that are settings, not counts (``batch_size``, ``max_steps``)."""

MAX_CLIENT_BYTES = values.MAX_CLIENT_JSON_BYTES
"""A saved client state larger than this (as JSON) is not carried in snapshots (said once)."""

_WHOLE_LOAD = {"load_module_strict": True, "load_optimizer_states": True, "load_lr_scheduler_states": True,
               "load_module_only": False, "custom_load_fn": None}


def counters(engine: Any) -> dict[str, int]:
    return {c: int(getattr(engine, c, 0) or 0) for c in COUNTERS}


def follows(saved: dict[str, Any], at: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Which top-level keys of a saved client state count what an engine counter counts (pure): an int whose
    name is step-like and whose value is the counter's, or one off it (a loop index saved after ``step()``) ->
    (counter, offset)."""
    out: dict[str, tuple[str, int]] = {}
    for key, value in saved.items():
        if not isinstance(value, int) or isinstance(value, bool) or not STEP_LIKE.search(str(key)):
            continue
        for c in COUNTERS:
            if c in at and abs(value - at[c]) <= 1:
                out[str(key)] = (c, value - at[c])
                break
    return out


def rebase(saved: dict[str, Any], at: dict[str, int], now: dict[str, int]) -> tuple[dict[str, Any], list[str]]:
    """The client state saved at counters ``at`` as the script would have saved it at ``now`` (pure): every
    step-like key (:func:`follows`) moved with its counter, the others as saved. Returns it and the moved keys."""
    out = dict(saved)
    moved = []
    for key, (c, offset) in follows(saved, at).items():
        if c in now:
            out[key] = now[c] + offset
            moved.append(key)
    return out, sorted(moved)


def _jsonable(client_state: Any) -> tuple[dict[str, Any], list[str]]:
    """The JSON-able top-level entries of a client state, and the keys left out."""
    if not isinstance(client_state, dict):
        return {}, []
    kept, dropped = {}, []
    for k, v in client_state.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            dropped.append(str(k))
            continue
        kept[str(k)] = v
    return kept, sorted(dropped)


class CheckpointCalls:
    """See the module docstring."""

    def __init__(self, engine: Any, runtime: Any) -> None:
        self.engine = engine
        self.runtime = runtime
        self._saved: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None
        self._internal = 0
        self._warned: set[str] = set()
        self._roots = _library_roots()  # read once: state() walks the stack at every step until the first save
        self._load = engine.load_checkpoint
        self._save = engine.save_checkpoint
        self._save_sig = inspect.signature(self._save)
        self._load_sig = inspect.signature(self._load)
        engine.load_checkpoint = self.load_checkpoint
        engine.save_checkpoint = self.save_checkpoint

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """The extension's own loads and saves (tier 3) inside: DeepSpeed's, unchanged."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    # -- save --------------------------------------------------------------------------------------------
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        if not self._internal and not self._capturing():
            try:
                bound = self._save_sig.bind(*args, **kwargs)
            except TypeError:
                bound = None
            if bound is not None:
                self._record(bound.arguments.get("client_state"))
        return self._save(*args, **kwargs)

    def publish_live(self, began_at: int) -> None:
        """A survivor about to recover in place whose script has not saved yet: the step-like counters of its
        script's loop as they stand (:func:`script_counters`) published as its client state, with the engine's
        counters now, so that a spare's ``load_checkpoint`` hands back the survivors' counts moved to the restored
        step (:func:`rebase`), not an empty client state (a spare counting from 0 saves and stops on other steps
        than the survivors: their collectives no longer match). ``began_at``: the engine's step counter when the
        failed call began, the count the loop's own counters stood at (a ``step()`` that failed after its update
        moved the engine's, not yet the loop's). Best effort; nothing once the script has saved."""
        if self._saved is not None or self._internal:
            return
        live = script_counters(inspect.currentframe(), self._roots)
        if live:
            _publish(int(getattr(self.engine, "global_rank", 0)), {"saved": live, "at": {"global_steps": began_at}})
            log.info("the script had not called save_checkpoint yet: its loop's counters %s published for a spare's "
                     "load_checkpoint", live)

    def _capturing(self) -> bool:
        ckpt = getattr(self.engine, "checkpoint_engine", None)
        return getattr(ckpt, "_capture", None) is not None  # tier 3's own save (capture mode)

    def _record(self, client_state: Any) -> None:
        kept, dropped = _jsonable(client_state if client_state is not None else {})
        if dropped:
            self._warn_once("dropped", "save_checkpoint: client_state keys %s are not JSON (tensors, objects): a "
                            "restore from memory hands back the others only", dropped)
        if len(json.dumps(kept)) > MAX_CLIENT_BYTES:
            self._warn_once("size", "save_checkpoint: client_state is over %d KiB as JSON: not carried in snapshots, "
                            "a restore from memory hands back an empty client state", MAX_CLIENT_BYTES >> 10)
            kept = {}
        self._saved = {"saved": kept, "at": counters(self.engine)}
        _publish(int(getattr(self.engine, "global_rank", 0)), self._saved)

    def _warn_once(self, what: str, fmt: str, *args: Any) -> None:
        if what not in self._warned and int(getattr(self.engine, "global_rank", 0)) == 0:
            self._warned.add(what)
            log.warning(fmt, *args)

    # -- snapshot -----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """What this step's snapshot carries: the last save's record; before the script's first save, its loop's
        step-like counters as they stand in the step's snapshot (:func:`script_counters`: taken inside the step,
        before the loop counts it, so at the engine's count when the step began), so that a restart's or a spare's
        ``load_checkpoint`` counts from where the loop was, not from 0."""
        if self._saved is not None or self._internal:
            return self._saved
        live = script_counters(inspect.currentframe(), self._roots)
        began = max(0, int(getattr(self.engine, "global_steps", 0) or 0) - 1)
        return {"saved": live, "at": {"global_steps": began}} if live else None

    def restore(self, value: Any) -> None:
        self._restored = value if isinstance(value, dict) else None
        if self._restored is not None:
            self._saved = self._restored  # a later snapshot carries it on

    # -- load ---------------------------------------------------------------------------------------------
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        rt = self.runtime
        why = self._not_from_memory(args, kwargs)
        if why is not None:
            log.debug("load_checkpoint: DeepSpeed's own (%s)", why)
            return self._load(*args, **kwargs)
        bound = self._load_sig.bind(*args, **kwargs)
        load_dir, tag = bound.arguments.get("load_dir"), bound.arguments.get("tag")
        disk: Any = (None, None)
        disk_step: int | None = None
        if _has_checkpoint(load_dir, tag) and not _joins_a_recovery():
            disk = self._load(*args, **kwargs)
            if isinstance(disk, tuple) and disk and disk[0] is not None:
                disk_step = int(self.engine.global_steps)
        step = rt.resume(newer_than=disk_step)  # collective: every rank agrees on the version
        version = rt.restored_version
        if not version or (disk_step is not None and version <= disk_step):
            if int(self.engine.global_rank) == 0 and rt.snapshots is not None:
                log.info("load_checkpoint(%s): %s", load_dir,
                         f"the checkpoint there (step {disk_step}) is the newest" if disk_step is not None
                         else "no checkpoint there and none in memory: a fresh start")
            return disk
        client, moved = self._client_for(step)
        if int(self.engine.global_rank) == 0:
            log.info("load_checkpoint(%s): memory holds step %d, newer than %s: restored from memory; client_state "
                     "as last saved%s", load_dir, step,
                     f"the checkpoint there (step {disk_step})" if disk_step is not None else "anything there",
                     f", {', '.join(moved)} moved to this step" if moved else "")
        write_event(event="continued", framework="deepspeed", how="load_checkpoint", step=int(step),
                    disk_step=disk_step, moved=moved, rank=int(self.engine.global_rank))
        return f"memory:step{step}", client

    def _not_from_memory(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        rt = self.runtime
        if self._internal:
            return "the extension's own load"
        if rt.snapshots is None:
            return "snapshots are off"
        if rt.resume_called:
            return "this process already restored"
        try:
            bound = self._load_sig.bind(*args, **kwargs)
        except TypeError:
            return "arguments DeepSpeed will refuse"
        partial = [k for k, v in _WHOLE_LOAD.items() if k in bound.arguments and bound.arguments[k] != v]
        if partial:
            return f"a partial load ({', '.join(partial)})"
        return None

    def _client_for(self, step: int) -> tuple[dict[str, Any], list[str]]:
        snapshot = [self._restored] if _usable(self._restored) else []
        rec = newest_saved([*snapshot, *_published()], step)
        if rec is None:
            if int(self.engine.global_rank) == 0:
                log.warning("load_checkpoint: restored step %d from memory, but the script had not called "
                            "save_checkpoint before that step and no survivor published its loop's counters, so the "
                            "client state it keeps its own counters in is unknown: an empty one is returned. A "
                            "script that reads its step from client_state then counts from 0 while the engine is at "
                            "step %d. Fix: fall back to engine.global_steps when client_state has no step", step, step)
            return {}, []
        at = {k: int(v) for k, v in rec["at"].items() if isinstance(v, int) and not isinstance(v, bool)}
        return rebase(rec["saved"], at, counters(self.engine))


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    return tuple(os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "purelib", "platlib") if k in paths) + (here,)


def script_counters(frame: Any, roots: tuple[str, ...] | None = None) -> dict[str, int]:
    """The step-like int variables (:data:`STEP_LIKE`, not :data:`NOT_A_COUNT`) of the script's own frames on the
    stack from ``frame`` outwards, the innermost first (a name seen once): frames outside the standard library,
    installed packages and deadpool_ext (``roots``). A loop's counters are its locals, or the module's globals when
    it runs at module level."""
    roots = _library_roots() if roots is None else roots
    out: dict[str, int] = {}
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith("<") and not os.path.abspath(path).startswith(roots):
            for name, value in frame.f_locals.items():
                if (type(value) is int and name not in out and STEP_LIKE.search(name)
                        and not NOT_A_COUNT.search(name) and not name.startswith("_")):
                    out[name] = value
        frame = frame.f_back
    return out


def _usable(rec: Any) -> TypeGuard[dict[str, Any]]:
    """A snapshot's client-state record as ``restore`` got it (the store's are decoded by ``values.client_state``)."""
    return isinstance(rec, dict) and isinstance(rec.get("saved"), dict) and isinstance(rec.get("at"), dict)


def newest_saved(records: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """Of client-state records (``{"saved", "at"}``), the one a restore to ``step`` rebases from (pure): the newest
    save at or before ``step``; else the oldest one after it (every rank went back past it); None: no record."""
    def at(r: dict[str, Any]) -> int:
        v = r["at"].get("global_steps")
        return v if isinstance(v, int) and not isinstance(v, bool) else -1

    before = [r for r in records if 0 <= at(r) <= step]
    if before:
        return max(before, key=at)
    after = [r for r in records if at(r) > step]
    return min(after, key=at) if after else None


def _store() -> Any:
    """The job's store under deadpool-run (None: no launcher's membership, e.g. under torchrun)."""
    from ...rebuild.context import context

    m = context().membership
    return getattr(m, "store", None) if m is not None else None


def _publish(rank: int, record: dict[str, Any]) -> None:
    """This rank's newest save in the job's store (best effort: a save never fails for it)."""
    store = _store()
    if store is None:
        return
    try:
        store.set_json(keys.client_state(rank), record)
    except Exception as exc:
        log.debug("client_state/%d not published: %s", rank, exc)


def _published() -> list[dict[str, Any]]:
    """Every rank's newest save as published (decoded through ``launcher/values.py``; a bad value: skipped)."""
    store = _store()
    if store is None:
        return []
    try:
        raw = store.list(keys.CLIENT_STATES)
    except Exception as exc:
        log.debug("client_state/ not read: %s", exc)
        return []
    out = []
    for key, value in sorted(raw.items()):
        try:
            rec = values.client_state(key, value)
        except values.BadValue as exc:
            log.warning("%s; ignored", exc)
            continue
        out.append({"saved": rec.saved, "at": rec.at})
    return out


def _has_checkpoint(load_dir: Any, tag: Any) -> bool:
    """Whether DeepSpeed would find a checkpoint to load at ``load_dir`` (its ``latest`` file, or the tag)."""
    if not isinstance(load_dir, (str, os.PathLike)):
        return False
    if tag is not None:
        return os.path.isdir(os.path.join(load_dir, str(tag)))
    return os.path.isfile(os.path.join(load_dir, "latest"))


def _joins_a_recovery() -> bool:
    """A spare taking a lost node's place: the survivors restore from memory (their in-place recovery), collective
    for collective with this process's restore; a load from disk first would be collectives they never join."""
    from ...rebuild import worker
    from ...rebuild.context import context

    return context().in_hot_swap or worker.pending_live() is not None
