"""Constrained decoding (JSON mode, forced tool calls) with llguidance.

llguidance (the Rust engine behind vLLM's and SGLang's structured output)
computes, for each step, which tokens keep the output inside a grammar; the
gateway compiles the request's JSON schema into that grammar and checks it, a
replica only applies it. The mask is a logits processor like mlx-lm's: it runs
after the penalties and before the logprobs and the sampler, so logprobs are
those of the constrained distribution, and EOS is allowed only where the
grammar may end.

The mask needs the previous token's value, so a constrained sequence waits for
each token before queueing the next forward (the unconstrained ones stay
pipelined).
"""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np


class Grammars:
    """Makes grammar processors for one tokenizer; its llguidance tokenizer is built once, on first use."""

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer
        self._ll = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self.hf_tokenizer)
            return self._ll

    def __call__(self, grammar: str) -> "GrammarProcessor":
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return GrammarProcessor(matcher)


class GrammarProcessor:
    """An mlx-lm logits processor: masks every token the grammar does not allow next."""

    def __init__(self, matcher):
        self.matcher = matcher
        self._calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The first call sees the prompt; each later one ends with the token sampled at the previous call.
        if self._calls:
            token = int(tokens[-1].item())
            if not self.matcher.consume_token(token):
                raise ValueError(f"token {token} broke the grammar: {self.matcher.get_error()}")
        self._calls += 1
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(logits.shape[-1], dtype=bool)  # the model's vocab may be wider than the tokenizer's
        n = min(len(bits), logits.shape[-1])
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), logits.dtype))


def tool_call_grammar(tokenizer, tools: list, name: str) -> str:
    """A grammar forcing one call in the model's own markup: of tool `name`, or of any tool for "*".

    Only for JSON tool calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>, mlx-lm's
    `json_tools` parser, the Qwen and Hermes format); other markups are refused at the door."""
    import llguidance

    if getattr(tokenizer.tool_parser, "__module__", "") != "mlx_lm.tool_parsers.json_tools":
        raise ToolChoiceUnsupported("a forced tool_choice needs JSON tool calls (<tool_call>{...}</tool_call>); "
                                    "this model writes its calls in another markup: use tool_choice \"auto\"")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools if name == "*" or t["function"]["name"] == name]
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls})
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    lark = (f"start: {json.dumps(tokenizer.tool_call_start + chr(10))} call {json.dumps(chr(10) + tokenizer.tool_call_end)}\n"
            f"call: %json {json.dumps(schema)}\n")
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Unservable(ValueError):
    """What a request asks of this model that it cannot do (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ToolChoiceUnsupported(Unservable):
    """The client forced a tool call this model's markup cannot be constrained to (a 400)."""

    def __init__(self, message: str):
        super().__init__(message, "tool_choice")
