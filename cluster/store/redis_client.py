"""Redis connections, and Redis URLs safe to show.

Every URL that reaches status, logs or an error message goes through `redact`:
a fleet's Redis has a password, and it must not leak through any of them.
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit, urlunsplit

import redis


def connect(url: str, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


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
