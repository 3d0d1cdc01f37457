"""Redis connections, and Redis URLs safe to show.

Every URL that reaches status, logs or an error message goes through `redact`:
a fleet's Redis has a password, and it must not leak through any of them.
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit, urlunsplit

import redis


def options(settings=None, timeout_s: Optional[float] = None) -> dict:
    """redis-py keyword arguments from a RedisConfig (or defaults); TLS follows a rediss:// URL."""
    out = {"socket_timeout": timeout_s or (settings.socket_timeout_s if settings else 2.0),
           "socket_connect_timeout": settings.connect_timeout_s if settings else 2.0}
    if settings is not None and settings.password:
        out["password"] = settings.password
    if settings is not None and settings.tls_ca_file:
        out["ssl_ca_certs"] = settings.tls_ca_file
    return out


def connect(url: str, settings=None, timeout_s: Optional[float] = None) -> redis.Redis:
    """A synchronous client (background threads: leases, index updates, status)."""
    return redis.Redis.from_url(url, **options(settings, timeout_s))


def aconnect(url: str, settings=None, timeout_s: Optional[float] = None):
    """An asyncio client (the gateway: never blocks its event loop)."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, **options(settings, timeout_s))


def redact(text: Optional[str]) -> Optional[str]:
    """A Redis URL without its credentials (user and password become ***); other text unchanged."""
    if not text or "://" not in text:
        return text
    out = []
    for word in text.split():
        out.append(_redact_url(word) if "://" in word else word)
    return " ".join(out)


def _redact_url(url: str) -> str:
    trail = url[len(url.rstrip(").,;'\"")):]
    core = url[:len(url) - len(trail)]
    try:
        parts = urlsplit(core)
        if parts.password is None and parts.username is None:
            return url
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)) + trail
    except ValueError:
        return "<redis url>" + trail
