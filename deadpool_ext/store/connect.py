"""``connect(url, token, namespace)``: open a coordination store by URL.

Kept apart from :mod:`deadpool_ext.store.base` so that the ABC never imports its own implementations
(base <- embedded, etcd <- connect).
"""
from __future__ import annotations

from deadpool_ext.store.base import CoordinationStore, check_timeout, parse_store_endpoints
from deadpool_ext.store.embedded import EmbeddedStore
from deadpool_ext.store.etcd import EtcdStore


def connect(url: str, token: str, namespace: str, timeout_s: float = 30.0) -> CoordinationStore:
    """Open the store at `url` for job `namespace`, authenticating with the job's `token`.

    `timeout_s` bounds every single network operation (connect, request, reply); `wait` has its own
    deadline on top. Raises `StoreAuthError` for a wrong token and `StoreError` if nothing answers.
    """
    scheme, endpoints = parse_store_endpoints(url)
    if not isinstance(token, str) or not token:
        raise ValueError("the coordination store needs the job's token (got an empty one)")
    timeout_s = check_timeout(timeout_s, "store timeout_s")
    if scheme == "dp":
        host, port = endpoints[0]
        return EmbeddedStore(host, port, token=token, namespace=namespace, timeout_s=timeout_s)
    return EtcdStore(etcd_http_endpoints(endpoints), token=token, namespace=namespace, timeout_s=timeout_s)


def etcd_http_endpoints(endpoints: list[tuple[str, int]]) -> list[str]:
    """``http://host:port`` gateway endpoints of an etcd URL's members (IPv6 hosts bracketed)."""
    return [f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}" for h, p in endpoints]
