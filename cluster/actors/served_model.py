"""One served model as the gateway sees it: its tokenizer, context and limits. No MLX here.

The gateway process never imports MLX (on a Mac that would claim a Metal device
for nothing): the tokenizer is the Hugging Face one mlx-lm wraps, read from a
directory holding only the config and tokenizer files (resolve_tokenizer:
built-in models build just their tokenizer, hub models fetch no weights).

Tokenizing and templating a long prompt costs real CPU time, so it runs on a
small thread pool, never on the event loop. Before any of it, a prompt that
cannot possibly fit is refused by its length alone: a token spans at most
`max_token_bytes` bytes and a character is at least one byte, so a text of
more than context x max_token_bytes characters needs more tokens than the
context holds (the factor 2 leaves room for normalizers that drop characters).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import Executor
from pathlib import Path

from cluster.api.errors import bad_request
from cluster.api.structured import response_grammar
from cluster.config import ModelSpec
from cluster.actors.plan import GenerateRequest
from cluster.engine.request import GenerationParams, SamplingParams
from cluster.models.resolve import model_info, read_config, text_config

SLACK = 2


class ServedModel:
    """Tokenizer, context and limits of one model; turns a validated body into a GenerateRequest."""

    def __init__(self, spec: ModelSpec, data_dir: Path, handle, executor: Executor | None = None):
        from transformers import AutoTokenizer

        info = model_info(spec.source, data_dir, spec.max_context)
        config = text_config(read_config(info.path))
        self.spec = spec
        self.name = spec.name
        self.family = info.family
        self.context = info.context_length
        self.vocab_size = int(config.get("vocab_size") or 0)
        self.tokenizer = AutoTokenizer.from_pretrained(str(info.path))
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.handle = handle
        self.executor = executor
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "mlx-fleet",
                "context_length": self.context, "family": self.family}

    # -- prompts (off the event loop) ------------------------------------------------
    async def chat_prompt(self, body) -> list[int]:
        self._refuse_oversized(sum(len(m.text()) for m in body.messages), "messages")
        return await self._off_loop(self._chat_tokens, body)

    async def text_prompt(self, body) -> list[int]:
        if isinstance(body.prompt, str):
            self._refuse_oversized(len(body.prompt), "prompt")
            return await self._off_loop(self._encode, body.prompt)
        bad = [t for t in body.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        return list(body.prompt)

    def token_text(self, token: int) -> str:
        """One token as text (logprobs name tokens so); a token that is part of a character is U+FFFD."""
        text = self._token_texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._token_texts[token] = text
        return text

    async def decode(self, tokens: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, tokens)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _refuse_oversized(self, chars: int, param: str) -> None:
        if chars > SLACK * self.context * self.max_token_bytes:
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens; {chars} characters of {param} "
                f"are far more tokens than fit. Please reduce the {param}.", param,
                code="context_length_exceeded")

    def _chat_tokens(self, body) -> list[int]:
        messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if _tools_on(body) else None
        try:
            tokens = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
        except Exception as e:  # a template may refuse e.g. a role order it does not support
            raise bad_request(f"the chat template of '{self.name}' rejected the messages: {e}", "messages")
        return list(tokens)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- the replica call ---------------------------------------------------------------
    def make_request(self, body, prompt: list[int], chat: bool) -> GenerateRequest:
        if not prompt:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        room = self.context - len(prompt)
        requested = body.requested_max_tokens()
        prompt_param = "messages" if chat else "prompt"
        if requested is not None and requested > room:
            # The field to fix: the prompt when it alone does not fit, else max_tokens.
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{len(prompt) + requested} tokens ({len(prompt)} in the prompt, {requested} for the completion). "
                "Please reduce the prompt or max_tokens.", prompt_param if room < 1 else "max_tokens",
                code="context_length_exceeded")
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens, and the prompt alone has "
                f"{len(prompt)}. Please reduce the prompt.", prompt_param, code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(self.spec.default_max_tokens, room)
        sampling = SamplingParams(
            temperature=float(_or(body.temperature, self.spec.default_temperature)), top_p=float(_or(body.top_p, 1.0)),
            top_k=_or(body.top_k, 0), min_p=float(_or(body.min_p, 0.0)), seed=body.seed,
            logit_bias=self._logit_bias(body.logit_bias),
            repetition_penalty=float(_or(body.repetition_penalty, 0.0)),
            repetition_context_size=_or(body.repetition_context_size, 20),
            presence_penalty=float(_or(body.presence_penalty, 0.0)),
            presence_context_size=_or(body.presence_context_size, 20),
            frequency_penalty=float(_or(body.frequency_penalty, 0.0)),
            frequency_context_size=_or(body.frequency_context_size, 20),
            logprobs=body.logprobs_count(),
            grammar=response_grammar(body.response_format) if chat else None)
        tools, forced = None, None
        if chat and _tools_on(body):
            tools = json.dumps([t.model_dump(exclude_none=True) for t in body.tools])
            choice = body.tool_choice
            forced = choice.function.name if not isinstance(choice, (str, type(None))) else (
                "*" if choice == "required" else None)
        params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=body.stop_list(),
                                  trim_leading_space=chat, tools=tools, tool_choice=forced)
        return GenerateRequest(request_id=uuid.uuid4().hex, prompt_tokens=tuple(prompt), params=params)


    def _logit_bias(self, bias) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (bias or {}).items():
            token = int(key)
            if not 0 <= token < self.vocab_size:
                raise bad_request(f"logit_bias names token {token}, outside the vocabulary [0, {self.vocab_size})",
                                  "logit_bias")
            out.append((token, float(value)))
        return tuple(out)


def _or(value, default):
    return default if value is None else value


def _tools_on(body) -> bool:
    """Tools go into the prompt unless tool_choice is "none" (then the model is not told of them)."""
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def _template_message(m, index: int) -> dict:
    """A message as chat templates expect it: tool-call arguments as objects (mlx_lm.server does the same)."""
    out = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as e:
                raise bad_request(f"messages[{index}]: the arguments of tool call {call.function.name!r} are not "
                                  f"JSON ({e})", "messages")
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any single token decodes to (special tokens included)."""
    ids = [[i] for i in range(len(tokenizer))]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return max(1, max((len(t.encode("utf-8", "replace")) for t in texts), default=1))
