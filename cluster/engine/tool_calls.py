"""Tool calls out of streamed text, with the model's own mlx-lm tool parser.

mlx-lm knows each family's tool-call markup: the tokenizer wrapper it loads
names the start and end markers (`<tool_call>` ... `</tool_call>` for Qwen,
others for Mistral, Gemma, GLM, Kimi...) and a parser for the text between
them. Text outside the markers is the reply's content; a finished call is
parsed and handed out whole (its id made here). A call cut off by max_tokens,
or one its parser refuses, is given back as content: nothing the model wrote
is lost.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


class ToolCallSplitter:
    """Feeds streamed text; returns the content to show and the tool calls completed so far."""

    def __init__(self, start: str, end: str, parser: Callable, tools: Optional[list]):
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self._held = ""  # text that may be (or is) inside a call
        self._inside = False
        self.made_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content, calls = "", []
        while True:
            if not self._inside:
                at = self._held.find(self.start)
                if at < 0:
                    keep = _partial_suffix(self._held, self.start)
                    content += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return content, calls
                content += self._held[:at]
                self._held = self._held[at + len(self.start):]
                self._inside = True
            at = self._held.find(self.end)
            if at < 0:
                return content, calls
            body, self._held = self._held[:at], self._held[at + len(self.end):]
            self._inside = False
            parsed = self._parse(body)
            if parsed is None:
                content += self.start + body + self.end
            else:
                calls.extend(parsed)

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end: an unclosed call is parsed if it can be, else given back as text."""
        held, self._held = self._held, ""
        if not self._inside:
            return held, []
        self._inside = False
        parsed = self._parse(held)
        return (self.start + held, []) if parsed is None else ("", parsed)

    def _parse(self, body: str) -> Optional[list[ToolCall]]:
        try:
            parsed = self.parser(body, self.tools)
        except Exception as e:  # the model wrote something its parser cannot read: keep it as text
            log.info("a tool call did not parse (%s: %s); returned as text", type(e).__name__, e)
            return None
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", {})
            out.append(ToolCall(id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}", name=call["name"],
                                arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        self.made_call = self.made_call or bool(out)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
