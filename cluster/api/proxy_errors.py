"""OpenAI-format errors from Serve's HTTP proxy too, not only from the gateway.

Some answers never come from our gateway, so its front door (front_door.py) cannot
shape them:
- a gateway replica dies with the request in flight: the proxy sends nothing, and
  uvicorn answers a plain-text "Internal Server Error";
- the proxy refuses on its own (no route, its queue full, a timeout): plain text.

This ASGI middleware runs inside the proxy, on every node, through Ray Serve's
documented hook: `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names a function
returning Starlette middlewares for the proxy (set for every Ray process of a
fleet: fleet/ray_env.py locally, deploy/bootstrap/fleet-env.sh on Macs). It
- turns a plain-text error answer into the OpenAI error body, keeping its status
  and headers (Retry-After);
- answers a request the proxy dropped without any response with a 503 and
  Retry-After: the replica was lost before it answered, and a retry reaches the
  replica Serve keeps (the OpenAI SDK retries a 503 by itself).
A response that has started (a stream) cannot be changed; the gateway puts an
in-band error into the stream when it can.

Imported by the proxy process: keep it free of MLX and of our heavy modules.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)

ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "cluster.api.proxy_errors.middlewares"
LOST_RETRY_AFTER_S = 1
CODES = {404: "not_found", 408: "timeout", 413: "request_too_large", 429: "rate_limit_exceeded",
         500: "internal_error", 502: "bad_gateway", 503: "unavailable", 504: "timeout"}


def middlewares() -> list:
    """What Serve's proxy calls (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    from starlette.middleware import Middleware

    return [Middleware(OpenAIErrors)]


def body_for(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": CODES.get(status, "error")}}).encode()


class OpenAIErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        held: dict | None = None  # a plain-text error's start, until its body is known
        body: list[bytes] = []

        async def shaped(message):
            nonlocal started, held
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                    held = message
                    return
                started = True
                return await send(message)
            if message["type"] == "http.response.body" and held is not None:
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    start, held = held, None
                    await _send_as_json(send, start, body)
                    started = True
                return
            return await send(message)

        try:
            await self.app(scope, receive, shaped)
        except Exception:
            if started:
                raise
            log.exception("the proxy failed a request before answering")
        if not started and held is not None:  # a plain-text error whose body never ended: still its status
            await _send_as_json(send, held, body)
            started = True
        if not started:  # dropped without an answer: the replica handling it was lost (or the client left)
            try:
                await _send_json(send, 503, body_for(503, "The server handling this request was lost before it "
                                                          "answered; retry the request."),
                                 [(b"retry-after", str(LOST_RETRY_AFTER_S).encode())])
            except Exception:  # the client is gone: nobody to answer
                pass


async def _send_as_json(send, start: dict, body: list[bytes]) -> None:
    """A held plain-text error (its start message and body parts) as the OpenAI body, same status and headers."""
    text = b"".join(body).decode("utf-8", "replace").strip() or f"HTTP {start['status']}"
    keep = [(k, v) for k, v in start.get("headers") or [] if k.lower() not in (b"content-type", b"content-length")]
    await _send_json(send, start["status"], body_for(start["status"], text), keep)


async def _send_json(send, status: int, payload: bytes, headers: list) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})
