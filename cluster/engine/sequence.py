"""One request's generation, advanced one step at a time.

Alone, a step is one prefill chunk or one decode token, so a scheduler can
interleave many sequences on one model without any of them waiting for another
to finish. In a decode batch (batch.py) the sequence only prefills itself; the
batch runs its decode forwards with everyone else's and hands each token back
through `accept`, which does what a solo step does with it.
The KV cache comes from a `CacheSession`: cold (fresh mlx-lm caches) or
restored from blocks; the session also sees the cache after every forward so it
can capture new blocks before a sliding window rotates them out.

Decode is pipelined like mlx-lm's generate_step: the forward for token t+1 is
queued (async_eval) before token t is read back, so the device never idles on
Python.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from typing import Optional, Protocol

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from cluster.engine import invariant, model_thread
from cluster.engine.constraints import Unservable, tool_call_grammar
from cluster.engine.events import Delta, Event, Finished, Started
from cluster.engine.request import GenerationParams
from cluster.engine.sampling import LogprobsPending, TokenPicker
from cluster.engine.stops import StopMatcher
from cluster.engine.tool_calls import ToolCallSplitter


def detokenizer(tokenizer, trim_leading_space: bool):
    """A fresh streaming detokenizer; with trim_leading_space=False it keeps the first token's space.

    mlx-lm's BPE and SentencePiece streaming detokenizers drop a leading space
    while their text is empty (what a chat reply wants). A text completion must
    be the exact continuation of its prompt, so there their text starts with a
    placeholder that the read offset already skips: it is never empty, and
    nothing is trimmed. (The naive detokenizer decodes with the tokenizer and
    trims nothing.)"""
    detok = tokenizer.detokenizer
    if not trim_leading_space and isinstance(detok, (BPEStreamingDetokenizer, SPMStreamingDetokenizer)):
        detok.text, detok.offset = "\0", 1
    return detok


class CacheSession(Protocol):
    """Where a sequence's KV cache comes from and where its new blocks go."""

    def restore(self) -> tuple[list, int]:
        """Return (mlx-lm cache list, number of prompt tokens already in it)."""

    def next_stop(self, start: int, limit: int, step: int) -> int:
        """End of the next prefill chunk starting at `start` (at most `limit`)."""

    def observe(self, cache: list, fed: list[int]) -> None:
        """Called after every forward; `fed` are the tokens now in the cache."""

    def close(self, cache: Optional[list], fed: list[int], completed: bool) -> None:
        """The sequence is over (finished, failed or cancelled); `cache` is None if a batch held it."""


class Sequence:
    """Generation state of one request."""

    def __init__(self, prompt: list[int], params: GenerationParams, model, tokenizer,
                 session: CacheSession, prefill_step: int = 512, grammars=None):
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        self.prompt = list(prompt)
        self.params = params
        self.model = model
        self.session = session
        self.prefill_step = prefill_step
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = detokenizer(tokenizer, params.trim_leading_space)
        self.stops = StopMatcher(list(params.stop))
        self.tool_calls = None
        if params.tools is not None:
            if not getattr(tokenizer, "has_tool_calling", False):
                raise Unservable("this model's chat template has no tool calling", "tools")
            self.tool_calls = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end,
                                               tokenizer.tool_parser, json.loads(params.tools))
        self.grammar = params.sampling.grammar
        if params.tool_choice is not None:  # compiled here, off the model thread; a bad one fails the request now
            self.grammar = tool_call_grammar(tokenizer, json.loads(params.tools), params.tool_choice)
        if self.grammar is not None and grammars is None:
            raise ValueError("this replica cannot constrain decoding (no grammar support)")
        self._grammar_processor = None
        self.grammars = grammars  # makes the grammar processor of a constrained request (constraints.py)
        self.picker: Optional[TokenPicker] = None  # made on the model thread: it holds MLX arrays
        self.cache: Optional[list] = None
        self.fed: list[int] = []
        self.generated: list[int] = []
        self.logits: list[mx.array] = []
        self.cached_tokens = 0
        self.prefill_sample: Optional[tuple[int, float]] = None  # (tokens, seconds) of the last prefill chunk
        self.begun = False
        self.done = False
        self._next: Optional[tuple[mx.array, Optional[LogprobsPending]]] = None
        self._t0 = time.perf_counter()
        self._t_first: Optional[float] = None

    # -- stepping ---------------------------------------------------------
    def begin(self) -> None:
        """Restore the cached prefix (model thread): the first thing a sequence does."""
        model_thread.check("Sequence.begin")
        if self.grammar is not None and self._grammar_processor is None:
            self.compile_grammar()
        self.picker = TokenPicker(self.params.sampling, self.prompt, self._grammar_processor)
        self.cache, self.cached_tokens = self.session.restore()
        self.fed = self.prompt[: self.cached_tokens]
        self.begun = True

    def compile_grammar(self) -> None:
        """Build the grammar's matcher (no MLX: a replica does it off the model thread, as it can take a
        while for a big schema, and the first one builds the tokenizer's llguidance view)."""
        if self.grammar is not None and self._grammar_processor is None:
            self._grammar_processor = self.grammars(self.grammar)

    @property
    def prefilled(self) -> bool:
        """Every prompt token but the last is in the cache: the next forward yields the first token."""
        return self.begun and len(self.fed) >= len(self.prompt) - 1

    def prefill(self, step: int) -> int:
        """Feed the next prefill chunk of about `step` tokens (cut at block ends); return its length."""
        model_thread.check("Sequence.prefill")
        end = self.session.next_stop(len(self.fed), len(self.prompt) - 1, step)
        chunk = self.prompt[len(self.fed): end]
        t0 = time.perf_counter()
        with invariant.one_query() if len(chunk) == 1 else nullcontext():  # one token: a one-query attention
            self.model(mx.array(chunk)[None], cache=self.cache)
        # The device runs the chunk while the session builds its captures (lazy copies of the updated
        # caches, evaluated by its seal): a capture's Python work then hides behind the forward instead of
        # adding a sync and an idle device to every chunk. The list is let go before the next chunk, whose
        # in-place cache update needs the buffers unshared. The sample below covers the captures too: a
        # recompute captures as well, so it is what the restore-or-recompute choice should predict.
        mx.async_eval([c.state for c in self.cache])
        self.fed.extend(chunk)
        self.session.observe(self.cache, self.fed)
        mx.eval([c.state for c in self.cache])
        self.prefill_sample = (len(chunk), time.perf_counter() - t0)
        return len(chunk)

    def step(self) -> list[Event]:
        """Advance alone by one prefill chunk or one token; return the events it produced."""
        model_thread.check("Sequence.step")
        if not self.begun:
            self.begin()
        if not self.prefilled:
            self.prefill(self.prefill_step)
            return []
        if self._next is None:
            self._next = self._forward(self.prompt[-1])
        y, logprobs = self._next
        nxt = self._forward(y) if self.room_after_next else None
        token = int(y.item())
        if nxt is not None:
            self.fed[-1] = token
        self.session.observe(self.cache, self.fed)
        self._next = nxt
        return self.accept(token, logprobs)

    @property
    def room_after_next(self) -> bool:
        """Whether the token about to be read is not the last one allowed (so it is fed back)."""
        return len(self.generated) + 1 < self.params.max_tokens

    @property
    def pending_prefill(self) -> int:
        """Prompt tokens not yet in the cache (all of them before the restore)."""
        return max(0, len(self.prompt) - (len(self.fed) if self.begun else 0))

    def _forward(self, token) -> tuple[mx.array, Optional[LogprobsPending]]:
        """Feed one token (int or lazy [1] array); return the lazily sampled next token and its logprobs."""
        inputs = mx.array([token]) if isinstance(token, int) else token
        with invariant.one_query():  # on CUDA, attention in a kernel that repeats itself (invariant.py)
            logits = self.model(inputs[None], cache=self.cache)[:, -1, :]
        if self.params.record_logits:
            self.logits.append(logits[0])
        y, logprobs = self.picker.pick(inputs, logits)
        mx.async_eval(y, *(logprobs.arrays() if logprobs else ()))
        self.fed.append(token if isinstance(token, int) else -1)  # fixed up once read back
        return y, logprobs

    def accept(self, token: int, logprobs: Optional[LogprobsPending] = None) -> list[Event]:
        """The next generated token has been read back: the events it makes (Started first)."""
        events: list[Event] = []
        if self._t_first is None:
            self._t_first = time.perf_counter()
            fetched, peer = getattr(self.session, "fetched", (0, None))
            events.append(Started(cached_tokens=self.cached_tokens, prompt_tokens=len(self.prompt),
                                  fetched_tokens=fetched, fetched_from=peer))
        self.generated.append(token)
        info = (logprobs.read(token),) if logprobs is not None else ()
        if token in self.eos:
            return events + self._finish("stop", self._delta(self.stops.feed(self._final_text()), token, info))
        self.detok.add_token(token)
        text = self.stops.feed(self.detok.last_segment)
        if self.stops.stopped:
            return events + self._finish("stop", self._delta(text, token, info))
        if len(self.generated) >= self.params.max_tokens:
            return events + self._finish("length", self._delta(text + self.stops.feed(self._final_text()), token, info))
        return events + [self._delta(text, token, info)]

    def _delta(self, text: str, token: int, info: tuple) -> Delta:
        """Text released by the stop matcher, split into content and tool calls when tools are on."""
        if self.tool_calls is None:
            return Delta(text, (token,), info)
        content, calls = self.tool_calls.feed(text)
        return Delta(content, (token,), info, tuple(calls))

    def _final_text(self) -> str:
        self.detok.finalize()
        return self.detok.last_segment

    def _finish(self, reason: str, delta: Delta) -> list[Event]:
        tail = self.stops.flush()
        if tail:
            delta = self._delta(tail, delta.token_ids[0], ()).merged_after(delta)
        if self.tool_calls is not None:
            content, calls = self.tool_calls.flush()
            delta = Delta(delta.text + content, delta.token_ids, delta.logprobs, delta.tool_calls + tuple(calls))
            if reason == "stop" and self.tool_calls.made_call:
                reason = "tool_calls"
        self.close(completed=True)
        now = time.perf_counter()
        timings = {
            "ttft_s": (self._t_first or now) - self._t0,
            "total_s": now - self._t0,
        }
        return [delta, Finished(reason, len(self.prompt), len(self.generated), self.cached_tokens, timings)]

    def close(self, completed: bool = False) -> None:
        """Hand the cache back to the session once (finish, failure or cancel).

        The cache is None while a decode batch holds this sequence's rows."""
        if self.begun and not self.done:
            fed = [t for t in self.fed if t >= 0]
            cache, self.cache = self.cache, None
            self.session.close(cache, fed, completed)
        self.done = True
