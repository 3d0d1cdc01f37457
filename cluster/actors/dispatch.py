"""From a validated OpenAI request to a running generation on some replica.

`ServedModel` owns one model's tokenizer and limits: it turns messages or a
prompt into token ids and refuses what cannot fit the context. `Dispatcher`
sends the request to the model's deployment and waits, with a bound, for a
replica to accept it; a replica that dies before any output reached the client
is replaced by another attempt, so the client never sees that failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from cluster.api.errors import APIError, bad_request, model_not_found, unavailable
from cluster.config import AppConfig, ModelSpec
from cluster.engine.events import Accepted, Delta, Event, Failed, Finished, Started
from cluster.engine.request import GenerateRequest
from cluster.engine.sampling import SamplingParams
from cluster.engine.sequence import GenerationParams
from cluster.models.resolve import model_info, read_config, text_config

log = logging.getLogger(__name__)

ATTEMPTS = 3
_REPLICA_LOST = (RayActorError,)


class ServedModel:
    """One model as the gateway sees it: tokenizer, context and its deployment handle."""

    def __init__(self, spec: ModelSpec, data_dir: Path, handle):
        from mlx_lm.utils import load_tokenizer

        info = model_info(spec.source, data_dir, spec.max_context)
        config = text_config(read_config(info.path))
        self.spec = spec
        self.name = spec.name
        self.family = info.family
        self.context = info.context_length
        self.vocab_size = int(config.get("vocab_size") or 0)
        self.tokenizer = load_tokenizer(info.path, eos_token_ids=config.get("eos_token_id"))
        self.handle = handle
        self.created = int(time.time())

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "mlx-fleet",
                "context_length": self.context, "family": self.family}

    def chat_prompt(self, body) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template may refuse e.g. a role order it does not support
            raise bad_request(f"the chat template of '{self.name}' rejected the messages: {e}", "messages")
        return list(tokens)

    def text_prompt(self, body) -> list[int]:
        if isinstance(body.prompt, str):
            return list(self.tokenizer.encode(body.prompt))
        bad = [t for t in body.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        return list(body.prompt)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def make_request(self, body, prompt: list[int]) -> GenerateRequest:
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
                f"{len(prompt)}. Please reduce the prompt.", "messages" if hasattr(body, "messages") else "prompt",
                code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(self.spec.default_max_tokens, room)
        sampling = SamplingParams(temperature=float(body.temperature if body.temperature is not None else 1.0),
                                  top_p=float(body.top_p if body.top_p is not None else 1.0), seed=body.seed)
        params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=body.stop_list())
        return GenerateRequest(request_id=uuid.uuid4().hex, prompt_tokens=tuple(prompt), params=params)


@dataclass
class Run:
    """A request accepted by a replica: what it said so far and the rest of its stream."""

    node_id: str
    route: str
    buffered: list[Event]
    stream: AsyncIterator[Event]
    response: object
    cached_tokens: int = 0
    _closed: bool = field(default=False, repr=False)

    async def events(self) -> AsyncIterator[Event]:
        for event in self.buffered:
            yield event
        self.buffered = []
        async for event in self.stream:
            yield event

    def headers(self, cached_tokens: int) -> dict[str, str]:
        return {"x-fleet-node": self.node_id, "x-fleet-route": self.route,
                "x-fleet-cached-tokens": str(cached_tokens)}

    def cancel(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.response.cancel()
            except Exception:
                pass


class Dispatcher:
    """Finds each request a replica and hands back its event stream."""

    def __init__(self, config: AppConfig, handles: dict):
        data_dir = Path(config.data_dir).expanduser()
        self.config = config
        self.models = {spec.name: ServedModel(spec, data_dir, handles[spec.name]) for spec in config.models}

    def model(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name, sorted(self.models))
        return served

    async def alive_models(self, timeout_s: float = 2.0) -> dict[str, bool]:
        async def ping(served: ServedModel) -> bool:
            try:
                await asyncio.wait_for(served.handle.ping.remote(), timeout_s)
                return True
            except Exception:
                return False

        results = await asyncio.gather(*(ping(m) for m in self.models.values()))
        return dict(zip(self.models, results))

    async def start(self, served: ServedModel, request: GenerateRequest) -> Run:
        """Send the request and return once it has started (or ended); retry lost replicas."""
        for attempt in range(ATTEMPTS):
            try:
                return await self._attempt(served, request)
            except _REPLICA_LOST as e:
                log.warning("replica lost before %s started (attempt %d): %s", request.request_id, attempt + 1, e)
        raise unavailable(f"no replica of '{served.name}' could take the request; retry shortly",
                          self.config.gateway.retry_after_s)

    async def _attempt(self, served: ServedModel, request: GenerateRequest) -> Run:
        response = served.handle.options(stream=True).generate.remote(request)
        stream = _flatten(response)
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.config.gateway.assign_timeout_s)
        except (asyncio.TimeoutError, BackPressureError, StopAsyncIteration):
            response.cancel()
            raise unavailable(f"no replica of '{served.name}' is available right now; retry shortly",
                              self.config.gateway.retry_after_s)
        except BaseException:
            response.cancel()
            raise
        assert isinstance(first, Accepted), first
        run = Run(node_id=first.node_id, route="pow2", buffered=[], stream=stream, response=response)
        try:
            async for event in stream:
                run.buffered.append(event)
                if isinstance(event, Started):
                    run.cached_tokens = event.cached_tokens
                if isinstance(event, (Started, Finished, Failed)):
                    break
        except BaseException:
            response.cancel()
            raise
        return run

    async def complete(self, served: ServedModel, request: GenerateRequest) -> tuple[Run, str, Finished]:
        """Run to the end for a non-streaming reply; a replica lost midway means a fresh attempt."""
        for attempt in range(ATTEMPTS):
            run = await self.start(served, request)
            try:
                text, done = await _gather(run)
                return run, text, done
            except _REPLICA_LOST as e:
                log.warning("replica lost during %s (attempt %d): %s", request.request_id, attempt + 1, e)
            finally:
                run.cancel()
        raise unavailable(f"replicas of '{served.name}' kept failing; retry shortly", self.config.gateway.retry_after_s)


async def _gather(run: Run) -> tuple[str, Finished]:
    parts: list[str] = []
    async for event in run.events():
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            return "".join(parts), event
        elif isinstance(event, Failed):
            raise APIError(event.status, event.message, type="server_error", code="generation_failed")
    raise RayActorError()  # the stream ended without a verdict: treat as a lost replica


async def _flatten(response) -> AsyncIterator[Event]:
    async for events in response:
        for event in events:
            yield event

