"""One streamed chat completion, timed the way a user feels it.

    request sent ──► headers ──► first content chunk ──► ... chunks ... ──► last content chunk ──► usage, [DONE]
    t0                           ttft                    (last - ttft) / (tokens - 1) = ITL         total

TTFT is the time to the first chunk that carries text (not the role chunk a chat
stream opens with). Token counts come from the final usage chunk
(`stream_options.include_usage`), so they are the server's, not an estimate.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

import requests

from cluster.metrics import CACHE_STATES, cache_state  # noqa: F401 (the load test classifies as the fleet does)



@dataclass
class Result:
    status: int = 0
    error: str = ""
    text: str = ""
    ttft_s: Optional[float] = None
    total_s: float = 0.0
    last_s: Optional[float] = None  # when the last content chunk came, from t0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    node: str = ""
    route: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def itl_s(self) -> Optional[float]:
        """Inter-token latency: the time per token after the first, (last content - first content) /
        (tokens - 1), as vLLM's benchmarks define TPOT. Not the gap between chunks: a chunk may carry several
        tokens (a replica gathers them under its message budget), and chunk gaps would overstate it."""
        if self.ttft_s is None or self.last_s is None or self.completion_tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.completion_tokens - 1)

    def route_fields(self) -> dict:
        """`x-fleet-route` as a dict: {"policy": ..., "reason": ..., "local": ..., "fetched": ...}."""
        policy, *pairs = self.route.split() or [""]
        return {"policy": policy, **dict(p.split("=", 1) for p in pairs if "=" in p)}


def stream_chat(session: requests.Session, url: str, body: dict, headers: dict, timeout_s: float) -> Result:
    """POST `body` with stream=True and read it to the end; never raises for HTTP or network trouble."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = Result()
    t0 = time.perf_counter()
    try:
        with session.post(url, json=body, headers=headers, stream=True, timeout=timeout_s) as r:
            out.status, out.node, out.route = r.status_code, r.headers.get("x-fleet-node", ""), r.headers.get("x-fleet-route", "")
            if r.status_code != 200:
                out.error = _error_code(r)
                return out
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"].get("code") or "stream_error"
                    break
                now = time.perf_counter()
                if chunk.get("usage"):
                    _read_usage(out, chunk["usage"])
                text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
                if text:
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    out.last_s = now - t0
                    out.text += text
    except (requests.RequestException, ValueError) as e:
        out.error = type(e).__name__
    finally:
        out.total_s = time.perf_counter() - t0
    return out


def complete_chat(session: requests.Session, url: str, body: dict, headers: dict, timeout_s: float) -> Result:
    """The same request, not streamed: the verifier's cold replay."""
    out = Result()
    t0 = time.perf_counter()
    try:
        r = session.post(url, json={**body, "stream": False}, headers=headers, timeout=timeout_s)
        out.status, out.node, out.route = r.status_code, r.headers.get("x-fleet-node", ""), r.headers.get("x-fleet-route", "")
        if r.status_code != 200:
            out.error = _error_code(r)
        else:
            reply = r.json()
            out.text = reply["choices"][0]["message"]["content"] or ""
            _read_usage(out, reply.get("usage") or {})
    except (requests.RequestException, ValueError, KeyError) as e:
        out.error = type(e).__name__
    finally:
        out.total_s = time.perf_counter() - t0
    return out


def _read_usage(out: Result, usage: dict) -> None:
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.completion_tokens = int(usage.get("completion_tokens") or 0)
    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _error_code(r: requests.Response) -> str:
    try:
        err = r.json()["error"]
        return f"{r.status_code} {err.get('code') or err.get('type')}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} {r.reason}"
