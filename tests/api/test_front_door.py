"""The front door as plain ASGI: API keys, the body limit on real bytes, and JSON for every error."""

import asyncio
import json

import pytest

from cluster.api.front_door import FrontDoor, FrontDoorSettings
from cluster.api.keys import ApiKeys, ApiKeysError, read_keys

KEY = "k" * 20


async def echo_app(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if body == b"boom":
        raise RuntimeError("a bug below the front door")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


def call(door, path="/v1/models", chunks=(b"",), headers=()):
    """Drive one HTTP request through the ASGI app; return (status, headers, body, chunks read)."""
    pending = list(chunks)
    read = []
    sent = []

    async def receive():
        if not pending:
            return {"type": "http.disconnect"}
        chunk = pending.pop(0)
        read.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": list(headers)}
    asyncio.run(door(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body, len(read)


def test_the_body_limit_counts_real_bytes_and_stops_reading_once_passed():
    door = FrontDoor(echo_app, FrontDoorSettings(max_body_bytes=1000))
    status, headers, body, read = call(door, chunks=[b"x" * 400] * 10)  # no Content-Length: chunked
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert read == 3  # 1200 bytes > 1000: refused at the third chunk, the rest never read
    assert call(door, chunks=[b"y" * 500, b"y" * 500])[:3:2] == (200, b"y" * 1000)  # at the limit: fine


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    door = FrontDoor(echo_app, FrontDoorSettings(max_body_bytes=1000))
    status, _, _, read = call(door, chunks=[b"{}"], headers=[(b"content-length", b"999999")])
    assert (status, read) == (413, 0)


def test_api_keys_guard_everything_but_health():
    door = FrontDoor(echo_app, FrontDoorSettings(keys=ApiKeys([KEY])))
    status, headers, body, read = call(door)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key" and read == 0
    assert headers[b"www-authenticate"] == b"Bearer"
    assert call(door, headers=[(b"authorization", f"Bearer {KEY}".encode())])[0] == 200
    assert call(door, headers=[(b"authorization", f"Bearer {KEY}x".encode())])[0] == 401
    assert call(door, headers=[(b"authorization", f"Basic {KEY}".encode())])[0] == 401
    assert call(door, path="/health")[0] == 200


def test_an_unexpected_exception_below_is_an_openai_500():
    door = FrontDoor(echo_app, FrontDoorSettings())
    status, headers, body, _ = call(door, chunks=[b"boom"])
    err = json.loads(body)["error"]
    assert status == 500 and headers[b"content-type"] == b"application/json"
    assert (err["type"], err["code"]) == ("server_error", "internal_error") and "RuntimeError" in err["message"]


def test_keys_come_from_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# ops\n{KEY}\n\n  {'m' * 20}  \n")
    assert read_keys(f, env=f"{'e' * 20}, ") == [KEY, "m" * 20, "e" * 20]
    assert read_keys(None, env="") == []


@pytest.mark.parametrize("content,says", [("# nothing\n", "holds no keys"), ("short\n", "at least 16")])
def test_bad_key_files_say_how_to_fix_them(tmp_path, content, says):
    f = tmp_path / "keys"
    f.write_text(content)
    with pytest.raises(ApiKeysError, match=says):
        read_keys(f, env="")
    with pytest.raises(ApiKeysError, match="cannot read"):
        read_keys(tmp_path / "missing", env="")
