"""API keys: who may use the gateway.

Keys come from a file (one per line; blank lines and `#` comments ignored) and
from MLX_FLEET_API_KEYS (comma-separated); no keys means no authentication.
Only SHA-256 digests are kept in memory, and a presented key is compared with
every digest in constant time, so neither timing nor a memory dump of the
gateway tells a key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Iterable, Optional

KEYS_ENV = "MLX_FLEET_API_KEYS"


class ApiKeysError(ValueError):
    """The keys file cannot be used; the message says how to fix it."""


def read_keys(path: Optional[str | Path], env: Optional[str] = None) -> list[str]:
    """Keys from `path` and from the environment variable's value `env` (default: read it)."""
    keys: list[str] = []
    if path:
        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except OSError as e:
            raise ApiKeysError(f"gateway.api_keys_file: cannot read {p} ({e.strerror}); "
                               "point it at a file with one API key per line") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ApiKeysError(f"gateway.api_keys_file: {p} holds no keys; put one API key per line")
    value = os.environ.get(KEYS_ENV, "") if env is None else env
    keys += [k.strip() for k in value.split(",") if k.strip()]
    short = [k for k in keys if len(k) < 16]
    if short:
        raise ApiKeysError(f"API keys must be at least 16 characters ({len(short)} are shorter); "
                           "generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: Optional[str]) -> bool:
        """Whether an `Authorization: Bearer <key>` header value carries a valid key."""
        if not self._digests:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        presented = hashlib.sha256(key.strip().encode()).digest()
        ok = False
        for d in self._digests:  # every digest, always: the time taken does not depend on which matched
            ok |= hmac.compare_digest(presented, d)
        return ok and scheme.lower() == "bearer"
