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
import time
import uuid
from concurrent.futures import Executor
from pathlib import Path

from cluster.api.errors import bad_request
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

    async def decode(self, tokens: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, tokens)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _refuse_oversized(self, chars: int, param: str) -> None:
        if chars > SLACK * self.context * self.max_token_bytes:
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens, and the {param} has {chars} "
                f"characters: far more tokens than fit. Please reduce the {param}.", param,
                code="context_length_exceeded")

    def _chat_tokens(self, body) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
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
        if requested is not None and requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{len(prompt) + requested} tokens ({len(prompt)} in the prompt, {requested} for the completion). "
                "Please reduce the prompt or max_tokens.", "max_tokens", code="context_length_exceeded")
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.context} tokens, and the prompt alone has "
                f"{len(prompt)}. Please reduce the prompt.", "messages" if chat else "prompt",
                code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(self.spec.default_max_tokens, room)
        sampling = SamplingParams(temperature=float(body.temperature if body.temperature is not None else 1.0),
                                  top_p=float(body.top_p if body.top_p is not None else 1.0), seed=body.seed)
        params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=body.stop_list(),
                                  trim_leading_space=chat)
        return GenerateRequest(request_id=uuid.uuid4().hex, prompt_tokens=tuple(prompt), params=params)


def _max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any single token decodes to (special tokens included)."""
    ids = [[i] for i in range(len(tokenizer))]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return max(1, max((len(t.encode("utf-8", "replace")) for t in texts), default=1))
