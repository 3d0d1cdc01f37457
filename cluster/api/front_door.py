"""The gateway's outermost layer, as plain ASGI: API keys, a body limit on real bytes, JSON for every error.

- API keys (keys.py): every path but /health needs `Authorization: Bearer <key>`
  when keys are configured; 401 otherwise, before the body is read.
- Body size: counted on the bytes actually received, whatever the framing
  (Content-Length or chunked), and answered with 413 the moment the limit is
  passed. A declared Content-Length over the limit is refused before reading.
  The accepted body is buffered (it is at most the limit) and replayed to the app.
- Errors: anything raised below that escaped the app's own handlers becomes an
  OpenAI-format 500 if no response has started. (Once a stream has started, its
  status is sent; the stream itself carries an in-band error.)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Optional

from cluster import metrics
from cluster.api.keys import ApiKeys

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
# The `endpoint` label of the requests metric: a fixed set, so that no client can make new series by asking
# for new URLs (every model card is one route; any path we do not serve is "other").
ENDPOINTS = frozenset({"/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/fleet/status",
                       "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})  # the last four: FastAPI's


def endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


@dataclass
class FrontDoorSettings:
    """Set by the Gateway at start (the ASGI app is built before the config is known)."""

    max_body_bytes: int = 16 << 20
    keys: ApiKeys = field(default_factory=lambda: ApiKeys([]))


def error_body(message: str, type_: str, code: Optional[str], param: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(send, status: int, message: str, type_: str, code: Optional[str],
                     headers: Optional[dict[str, str]] = None) -> None:
    body = error_body(message, type_, code)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class FrontDoor:
    def __init__(self, app, settings: FrontDoorSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if scope.get("path") not in OPEN_PATHS and not self.settings.keys.allows(
                headers.get(b"authorization", b"").decode("latin-1")):
            return await send_error(send, 401, "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>'.",
                                    "invalid_request_error", "invalid_api_key", {"www-authenticate": "Bearer"})
        limit = self.settings.max_body_bytes
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(send, limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._too_large(send, limit)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self._forward(scope, _replay(b"".join(chunks), receive), send)

    async def _forward(self, scope, receive, send) -> None:
        started = False
        state = scope.setdefault("state", {})  # Starlette's request.state: the handler names the model there

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                metrics.inc("mlx_fleet_requests", model=state.get("model", ""), endpoint=endpoint_label(scope.get("path", "")),
                            code=message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("unhandled error in the gateway")
            if started:
                raise
            await send_error(send, 500, f"internal error: {type(e).__name__}", "server_error", "internal_error")

    @staticmethod
    async def _too_large(send, limit: int) -> None:
        await send_error(send, 413, f"Request body is larger than {limit} bytes; send a smaller request.",
                         "invalid_request_error", "request_too_large", {"connection": "close"})


def _replay(body: bytes, receive):
    """A receive() that hands the buffered body over once, then waits on the real one (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
