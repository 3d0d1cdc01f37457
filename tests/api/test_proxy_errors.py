"""Serve's proxy answers in OpenAI's error format too: the middleware as plain ASGI, and Ray's hook for it."""

import asyncio
import json

import pytest

from cluster.api.proxy_errors import ENV, IMPORT_PATH, OpenAIErrors, middlewares


def answer(app) -> tuple[int, dict, bytes, int]:
    """Drive one request through the middleware: (status, headers, body, body messages)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(OpenAIErrors(app)({"type": "http", "path": "/v1/chat/completions", "headers": []}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in bodies), len(bodies)


def error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def lost(scope, receive, send):
    """What Serve's proxy does when the replica handling the request dies: returns, having sent nothing."""


async def crashed(scope, receive, send):
    raise RuntimeError("the proxy itself failed")


async def plain_503(scope, receive, send):
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"2")]})
    await send({"type": "http.response.body", "body": b"Request dropped: too many queued", "more_body": True})
    await send({"type": "http.response.body", "body": b" requests."})


async def plain_cut(scope, receive, send):
    """A plain-text refusal whose body never ends (the proxy returns mid-body)."""
    await send({"type": "http.response.start", "status": 429, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"Too many requests", "more_body": True})


async def json_400(scope, receive, send):
    await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": {"message": "ours"}}'})


async def stream(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
        await send({"type": "http.response.body", "body": part, "more_body": part != b"data: [DONE]\n\n"})


@pytest.mark.parametrize("app", [lost, crashed])
def test_a_request_dropped_without_an_answer_gets_a_503_to_retry(app):
    status, headers, body, _ = answer(app)
    assert status == 503 and headers[b"retry-after"] == b"1" and headers[b"content-type"] == b"application/json"
    err = error(body)
    assert err["type"] == "server_error" and err["code"] == "unavailable" and "retry" in err["message"]


def test_a_plain_text_error_of_the_proxy_becomes_openais_keeping_status_and_retry_after():
    status, headers, body, _ = answer(plain_503)
    assert status == 503 and headers[b"retry-after"] == b"2" and int(headers[b"content-length"]) == len(body)
    assert error(body) == {"message": "Request dropped: too many queued requests.", "type": "server_error",
                           "param": None, "code": "unavailable"}


def test_a_plain_text_error_cut_off_mid_body_keeps_its_status():
    status, _, body, parts = answer(plain_cut)
    assert (status, parts) == (429, 1) and error(body)["code"] == "rate_limit_exceeded"
    assert error(body)["message"] == "Too many requests"


def test_json_answers_and_streams_pass_through_untouched():
    assert answer(json_400)[:3] == (400, {b"content-type": b"application/json"}, b'{"error": {"message": "ours"}}')
    status, _, body, parts = answer(stream)
    assert (status, body, parts) == (200, b"data: 1\n\ndata: [DONE]\n\n", 2)


def test_rays_proxy_hook_takes_our_middleware():
    """Ray Serve reads the env var at import and validates what the function returns: a rename in Ray
    fails here, not silently in a fleet."""
    from ray.serve._private import constants
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    assert ENV == "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" and hasattr(constants, ENV)
    module, name = IMPORT_PATH.rsplit(".", 1)
    assert (module, name) == (OpenAIErrors.__module__, middlewares.__name__)
    assert len(validate_http_proxy_callback_return(middlewares())) == 1
