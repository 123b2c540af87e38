"""HTTP clients for Factory's own services (rollout server, environment workers, sandbox pool, health checks).

httpx builds a new TLS context for every client, loading the CA bundle each time (a third of a second per client on a
busy 2-core machine), although these clients talk plain HTTP to 127.0.0.1 or a cluster-local address. `client` builds
that context once per process and shares it; verification stays exactly httpx's default.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def client(**kwargs: Any) -> httpx.Client:
    """`httpx.Client(**kwargs)` with the process's shared TLS context (unless `verify` is given)."""
    kwargs.setdefault("verify", _tls())
    return httpx.Client(**kwargs)
