"""``connect(url, token, namespace)``: open a coordination store by URL.

Kept apart from :mod:`deadpool_ext.store.base` so that the ABC never imports its own implementations
(base <- embedded, etcd <- connect).
"""
from __future__ import annotations

from deadpool_ext.store.base import CoordinationStore, check_timeout, parse_store_url
from deadpool_ext.store.embedded import EmbeddedStore
from deadpool_ext.store.etcd import EtcdStore


def connect(url: str, token: str, namespace: str, timeout_s: float = 30.0) -> CoordinationStore:
    """Open the store at `url` for job `namespace`, authenticating with the job's `token`.

    `timeout_s` bounds every single network operation (connect, request, reply); `wait` has its own
    deadline on top. Raises `StoreAuthError` for a wrong token and `StoreError` if nothing answers.
    """
    scheme, host, port = parse_store_url(url)
    if not isinstance(token, str) or not token:
        raise ValueError("the coordination store needs the job's token (got an empty one)")
    timeout_s = check_timeout(timeout_s, "store timeout_s")
    if scheme == "dp":
        return EmbeddedStore(host, port, token=token, namespace=namespace, timeout_s=timeout_s)
    hostpart = f"[{host}]" if ":" in host else host
    return EtcdStore(f"http://{hostpart}:{port}", token=token, namespace=namespace, timeout_s=timeout_s)
