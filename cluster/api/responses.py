"""OpenAI response bodies and SSE framing, for chat and text completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from cluster.engine.events import Delta, Finished
from cluster.engine.logprobs import TokenLogprob
from cluster.engine.tool_calls import ToolCall


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def usage(done: Finished) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


@dataclass
class Reply:
    """Shapes one request's output as chat or text-completion objects."""

    model: str
    chat: bool
    include_usage: bool = False
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: Callable[[int], str] = field(default=lambda t: "", repr=False)  # one token as text (logprobs)
    text_offset: int = 0  # completions logprobs: where the next token's text starts (after any echo)
    _calls_sent: int = field(default=0, repr=False)

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def complete(self, text: str, done: Finished, whole: Optional[Delta] = None) -> dict:
        """The non-streaming body; `whole` carries the reply's logprobs and tool calls."""
        whole = whole or Delta(text, ())
        logprobs = self._logprobs(whole.logprobs) if whole.logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": text if text or not whole.tool_calls else None}
            if whole.tool_calls:
                message["tool_calls"] = [_tool_call(c) for c in whole.tool_calls]
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": done.finish_reason}
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": done.finish_reason}
            body = self._envelope("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(done)
        return body

    def chunk(self, text: Optional[str] = None, finish_reason: Optional[str] = None,
              role: bool = False, event: Optional[Delta] = None) -> str:
        """One SSE chunk with a delta (its text, logprobs and tool calls) and/or a finish reason."""
        logprobs = self._logprobs(event.logprobs) if event is not None and event.logprobs else None
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if event is not None and event.tool_calls:
                delta["tool_calls"] = [dict(_tool_call(c), index=self._calls_sent + i)
                                       for i, c in enumerate(event.tool_calls)]
                self._calls_sent += len(event.tool_calls)
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict:
        """OpenAI's logprobs object: chat's `content` list, or the completions' parallel lists."""
        if self.chat:
            return {"content": [dict(self._token(e.token, e.logprob),
                                     top_logprobs=[self._token(t, lp) for t, lp in e.top]) for e in entries],
                    "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            text = self.token_text(e.token)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def usage_chunk(self, done: Finished) -> str:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(done)
        return sse(body)


def _tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
