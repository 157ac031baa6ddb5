"""The tier-3 background writer: one thread per rank that serialises captured files to storage and publishes.

Call order:

1. (training thread, every rank) :meth:`BaseWriter.submit` a :class:`BaseJob` whose files were already copied
   into host memory, so training may overwrite the live tensors at once.
2. (writer thread, every rank) each file: ``torch.save`` (DeepSpeed's own payload and format) streamed
   through :class:`_ChunkSink` in chunks into a temporary name, hashed (xxh3-64) on the way, paced by the
   :class:`~deadpool_ext.persist.throttle.Throttle`, renamed into place; then this rank's manifest.
3. (writer thread, coordinator = global rank 0 only) wait (bounded by ``persist.timeout_s``) until every rank's
   manifest is there, parse each strictly (names, sizes; with a checkpoint key: its signature), check sizes,
   write the commit record (signed with the key), then ``latest``; re-read and verify the new base; only then
   garbage-collect older bases.

The writer never raises into training: a failure (full disk, missed deadline, storage error) is logged naming
the URL, the base is abandoned (never published), and the next base is tried as usual.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from . import sign
from .layout import (
    COMMIT,
    LATEST,
    VersionInfo,
    build_commit,
    check_file_name,
    collect_garbage,
    parse_rank_manifest,
    rank_manifest_name,
    read_record_bytes,
    verify_version,
    where,
)
from .records import CheckpointTrustError
from .storage import Storage, is_disk_full
from .throttle import Throttle

log = logging.getLogger("deadpool_ext")


class BaseAbandoned(RuntimeError):
    """A base could not be written or published in time; it stays invisible."""


@dataclass(slots=True)
class CapturedFile:
    name: str
    """File name inside the version directory (DeepSpeed's own)."""
    state: Any
    """Host copy of what DeepSpeed handed to ``CheckpointEngine.save``; dropped once written."""
    nbytes_estimate: int


@dataclass(slots=True)
class BaseJob:
    version: int
    tag: str
    rank: int
    world_size: int
    coordinator: bool
    files: list[CapturedFile]
    layout: dict[str, Any]
    """Written into the commit record: dp_world_size, zero_stage, ... (what a loader needs to reshard)."""
    root_files: dict[str, bytes] = field(default_factory=dict)
    """Small files for the storage root (DeepSpeed's recovery scripts), written once by the coordinator."""
    submitted_at: float = field(default_factory=time.time)
    deadline: float = 0.0
    on_done: Callable[[BaseJob], None] | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def estimate(self) -> int:
        return sum(f.nbytes_estimate for f in self.files)


class _ChunkSink:
    """File-like target for ``torch.save``: splits big writes into chunks, hashes, paces, checks the deadline."""

    def __init__(self, target: Any, throttle: Throttle, chunk: int, deadline: float, what: str) -> None:
        self.target, self.throttle, self.chunk, self.deadline, self.what = target, throttle, chunk, deadline, what
        self.hash = xxhash.xxh3_64()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for off in range(0, len(view), self.chunk):
            piece = view[off: off + self.chunk]
            self.target.write(piece)
            self.hash.update(piece)
            self.nbytes += len(piece)
            self.throttle.pace(len(piece))
            if time.time() > self.deadline:
                raise BaseAbandoned(f"{self.what}: missed its deadline (persist.timeout_s)")
        return len(view)

    def flush(self) -> None:
        pass


class BaseWriter:
    def __init__(self, storage: Storage, throttle: Throttle, *, chunk_mb: int = 8, poll_s: float = 0.05,
                 verify_after_publish: bool = True, keep_last: int = 2, key: bytes | None = None) -> None:
        self.storage = storage
        self.key = key
        """Checkpoint key (:mod:`deadpool_ext.persist.sign`): manifests and commit records are signed with it,
        and the coordinator merges only rank manifests it signed."""
        self.throttle = throttle
        self.chunk = chunk_mb << 20
        self.poll_s = poll_s
        self.verify_after_publish = verify_after_publish
        self.keep_last = keep_last
        self._q: queue.Queue[BaseJob | None] = queue.Queue()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deadpool-tier3-writer", daemon=True)
        self._thread.start()
        self.history: list[dict[str, Any]] = []

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    def submit(self, job: BaseJob) -> None:
        self._busy.set()
        self._q.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while self._busy.is_set() and time.time() < deadline:
            time.sleep(0.02)
        return not self._busy.is_set()

    def close(self, timeout_s: float) -> bool:
        """Drain (bounded), then stop the thread. Returns False if a base was still in flight at the deadline."""
        drained = self.wait_idle(timeout_s)
        self._q.put(None)
        # a base still in flight at the deadline is left to its daemon thread (it is never published once its own
        # deadline passes); joining it would only add a wait
        self._thread.join(timeout=5.0 if drained else 0.0)
        return drained

    # -- writer thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - one failed base must not kill this daemon thread
                msg = (self.storage.describe_full(f"{job.tag}/", job.estimate * job.world_size)
                       if is_disk_full(exc) else f"{type(exc).__name__}: {exc}")
                job.result.update(ok=False, error=msg)
                log.error("tier 3: base %s abandoned (not published), training continues: %s", job.tag, msg)
            finally:
                job.files.clear()  # drop the host copy even on failure
                self.history.append({"version": job.version, **job.result})
                if job.on_done is not None:
                    job.on_done(job)
                if self._q.empty():
                    self._busy.clear()

    def _run(self, job: BaseJob) -> None:
        t0 = time.time()
        free = self.storage.free_bytes()
        need = job.estimate * job.world_size
        if free is not None and free < need:
            # Cheaper and clearer than failing halfway through the first file.
            raise OSError(28, self.storage.describe_full(f"{job.tag}/", need))
        self.throttle.begin()
        try:
            entries = {}
            for f in job.files:
                entries[f.name] = self._write_file(job, f)
                f.state = None
        finally:
            self.throttle.end()
        write_s = time.time() - t0
        manifest = sign.sign({"files": entries, "rank": job.rank, "tag": job.tag, "version": job.version,
                              "write_s": write_s}, sign.KIND_RANK_MANIFEST, self.key)
        self.storage.write_bytes(f"{job.tag}/{rank_manifest_name(job.rank)}", json.dumps(manifest, indent=1).encode())
        nbytes = sum(e["nbytes"] for e in entries.values())
        job.result.update(ok=True, rank_bytes=nbytes, write_s=write_s,
                          rank_mb_s=nbytes / max(write_s, 1e-9) / (1 << 20), **self.throttle.stats())
        if job.coordinator:
            self._publish(job, t0)

    def _write_file(self, job: BaseJob, f: CapturedFile) -> dict[str, Any]:
        check_file_name(f.name, f"{self.storage.url.rstrip('/')}/{job.tag}")  # what readers accept, nothing else
        rel = f"{job.tag}/{f.name}"
        target = self.storage.open_temp(rel)
        sink = _ChunkSink(target, self.throttle, self.chunk, job.deadline, f"{self.storage.url}/{rel}")
        try:
            torch.save(f.state, sink)  # type: ignore[arg-type]  # torch.save takes any object with write/flush
            target.publish()
        except BaseException:
            target.abort()
            raise
        return {"nbytes": sink.nbytes, "xxh3_64": sink.hash.hexdigest()}

    def _publish(self, job: BaseJob, t0: float) -> None:
        for name, data in job.root_files.items():
            if not self.storage.exists(name):
                self.storage.write_bytes(name, data)
        manifests: dict[int, dict[str, Any]] = {}
        while len(manifests) < job.world_size:
            for r in range(job.world_size):
                if r not in manifests:
                    rel = f"{job.tag}/{rank_manifest_name(r)}"
                    raw = read_record_bytes(self.storage, rel)
                    if raw is None:
                        continue
                    try:  # written atomically: a manifest that is there is complete, so a bad one is final
                        rec = parse_rank_manifest(raw, where(self.storage, rel), key=self.key)
                    except CheckpointTrustError as exc:
                        raise BaseAbandoned(f"{exc}; the base is not published") from None
                    if rec["version"] == job.version and rec["rank"] == r:
                        manifests[r] = rec
            if len(manifests) < job.world_size:
                if time.time() > job.deadline:
                    missing = sorted(set(range(job.world_size)) - set(manifests))
                    raise BaseAbandoned(f"{job.tag}: ranks {missing} did not finish writing before the deadline "
                                        f"(persist.timeout_s); the base is not published")
                time.sleep(self.poll_s)
        for r, man in manifests.items():
            for name, entry in man["files"].items():
                size = self.storage.size(f"{job.tag}/{name}")
                if size != entry["nbytes"]:
                    raise BaseAbandoned(f"{self.storage.url}/{job.tag}/{name}: {size} bytes on storage, rank {r} "
                                        f"wrote {entry['nbytes']}")
        commit = build_commit(job.version, manifests, job.layout, time.time() - t0, key=self.key)
        # The commit record is the single point at which the base becomes visible; `latest` follows it.
        self.storage.write_bytes(f"{job.tag}/{COMMIT}", json.dumps(commit, indent=1, sort_keys=True).encode())
        self.storage.write_bytes(LATEST, job.tag.encode())
        published = time.time()
        job.result.update(published=True, published_at=published, time_to_persist_s=published - job.submitted_at,
                          total_bytes=commit["total_bytes"])
        log.info("tier 3: published base %s (%.1f MB, %.2f s after capture) at %s", job.tag,
                 commit["total_bytes"] / 1e6, published - job.submitted_at, self.storage.url)
        if not self.verify_after_publish:
            return
        errors = verify_version(self.storage, VersionInfo(job.version, job.tag, commit))
        job.result["verify_s"] = time.time() - published
        if errors:
            # Withdraw it: a base that does not read back must never be the one that older bases were freed for.
            self.storage.remove(f"{job.tag}/{COMMIT}")
            raise BaseAbandoned(f"{job.tag} failed read-back verification and was withdrawn: {errors[0]}")
        job.result["deleted"] = collect_garbage(self.storage, self.keep_last, log.info)

