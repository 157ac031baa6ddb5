"""Coordination store: the small key/value store where launcher, spares and ranks of one job meet.

``connect("dp://host:port" | "etcd://host:port", token, namespace, timeout_s)`` returns a
`CoordinationStore`; the launcher serves the embedded one with `EmbeddedStoreServer`. See docs/store.md.
"""
from __future__ import annotations

from deadpool_ext.store.base import ALLOWED_SCHEMES, CoordinationStore, StoreAuthError, StoreError, StoreTimeout
from deadpool_ext.store.connect import connect
from deadpool_ext.store.embedded import EmbeddedStore, EmbeddedStoreServer
from deadpool_ext.store.etcd import EtcdStore, bootstrap_etcd_auth

__all__ = [
    "ALLOWED_SCHEMES", "CoordinationStore", "StoreError", "StoreAuthError", "StoreTimeout", "connect",
    "EmbeddedStore", "EmbeddedStoreServer", "EtcdStore", "bootstrap_etcd_auth",
]
