"""Authentic, not only intact: HMAC-SHA256 signatures on the JSON records of a checkpoint.

Checksums in a commit record prove a file is the one the record names; they do not prove who wrote the record:
anyone who can write to the storage can replace a file *and* update its checksum. With a checkpoint key
(a secret shared by the job's ranks and whoever loads or exports its bases), every record the extension
writes (tier-3 commit records, per-rank manifests, the manifests of :mod:`deadpool_ext.persist.atomic`) carries

    "signature": {"alg": "hmac-sha256", "hmac": "<64 hex digits>"}

computed over the record's canonical JSON without the ``signature`` field (:func:`canonical`: sorted keys, no
spaces, ASCII, no NaN), prefixed by the record's kind (so a signed manifest can never pass for a commit record).
A reader given a key refuses a record that is unsigned or whose signature does not match
(:class:`SignatureError`, one line naming the file); a reader without one checks integrity only and says so.

Where the key comes from: an explicit ``key=`` argument wins; otherwise the environment variable the process
reads keys from: :data:`KEY_ENV` (``DEADPOOL_CHECKPOINT_KEY``) unless a runtime attached with ``deadpool.key_env``
naming another (:func:`use_key_env`); its value's UTF-8 bytes, at least :data:`MIN_KEY_BYTES` of them. An empty
variable means no key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Any

from ..config import DEFAULT_KEY_ENV
from .records import BadRecordError, CheckpointTrustError

KEY_ENV = DEFAULT_KEY_ENV
_key_env = KEY_ENV  # process-wide: the variable this process reads the key from (use_key_env), like os.environ
MIN_KEY_BYTES = 16
SIGNATURE = "signature"
ALG = "hmac-sha256"
_HEX256 = re.compile(r"^[0-9a-f]{64}$")

KIND_COMMIT = "deadpool-tier3-commit"
KIND_RANK_MANIFEST = "deadpool-tier3-rank-manifest"
KIND_MANIFEST = "deadpool-manifest"


class SignatureError(CheckpointTrustError):
    """A record is unsigned while a key was given, or its signature does not match the key."""


class KeyConfigError(CheckpointTrustError, ValueError):
    """The checkpoint key given (argument or environment) is unusable."""


def use_key_env(name: str) -> None:
    """Read the key from ``$name`` from now on in this process (``deadpool.key_env``, set when a runtime
    attaches; validated by the config)."""
    global _key_env
    _key_env = name


def key_env() -> str:
    """The environment variable this process reads the checkpoint key from."""
    return _key_env


def checkpoint_key(key: str | bytes | None = None) -> bytes | None:
    """The key to sign and check with: ``key`` if given, else the value of :func:`key_env`, else None."""
    source = "key="
    if key is None:
        key = os.environ.get(_key_env) or None
        source = _key_env
    if key is None:
        return None
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise KeyConfigError(f"{source}: the checkpoint key is {len(raw)} bytes; at least {MIN_KEY_BYTES} are "
                             "needed (use a random secret, e.g. `openssl rand -hex 32`)")
    return raw


def canonical(rec: dict[str, Any], kind: str) -> bytes:
    """What is signed: ``kind`` + newline + the record without its signature as canonical JSON."""
    body = {k: v for k, v in rec.items() if k != SIGNATURE}
    return kind.encode() + b"\n" + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                              allow_nan=False).encode()


def _mac(rec: dict[str, Any], kind: str, key: bytes) -> str:
    return hmac.new(key, canonical(rec, kind), hashlib.sha256).hexdigest()


def sign(rec: dict[str, Any], kind: str, key: bytes | None) -> dict[str, Any]:
    """``rec`` with its signature (unchanged without a key)."""
    if key is None:
        return rec
    return {**{k: v for k, v in rec.items() if k != SIGNATURE}, SIGNATURE: {"alg": ALG, "hmac": _mac(rec, kind, key)}}


def check(rec: dict[str, Any], kind: str | tuple[str, ...], key: bytes | None, where: str) -> bool:
    """With a key: raise :class:`SignatureError` unless ``rec`` carries a signature that matches it as (one of)
    ``kind``; True. Without one: nothing is checked (integrity only); False."""
    if key is None:
        return False
    sig = rec.get(SIGNATURE)
    if sig is None:
        raise SignatureError(f"{where}: not signed, and a checkpoint key is set ({_key_env}); refusing a record the "
                             "key did not sign")
    if not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("hmac"), str) \
            or not _HEX256.fullmatch(sig["hmac"]):
        raise BadRecordError(f"{where}: field 'signature' is not {{\"alg\": \"{ALG}\", \"hmac\": <64 hex digits>}}")
    try:
        expected = [_mac(rec, k, key) for k in ((kind,) if isinstance(kind, str) else kind)]
    except (TypeError, ValueError):  # not serialisable canonically (cannot happen for parsed JSON)
        raise BadRecordError(f"{where}: cannot be serialised canonically to check its signature") from None
    if not any(hmac.compare_digest(e, sig["hmac"]) for e in expected):
        raise SignatureError(f"{where}: signature does not match the checkpoint key (the record was changed after "
                             "it was signed, or signed with another key)")
    return True
