"""Picking each next token the way mlx_lm.server does, with a per-request random key.

mlx-lm's order, followed exactly so that the same request on the same weights
gives the same tokens as mlx_lm.server:
1. logits processors (mlx-lm's own `make_logits_processors`: logit_bias, then
   the repetition, presence and frequency penalties over the last
   `*_context_size` tokens of prompt + generated text), plus the grammar
   constraint for JSON mode and forced tool calls;
2. log-softmax: these logprobs are what a client asks for with `logprobs`;
3. the sampler: argmax at temperature 0, else mlx-lm's top_p, min_p and top_k
   filters, then a categorical draw at the temperature.

The one departure: mlx-lm's samplers draw from MLX's global random state. A
replica runs many requests at once, so a request's `seed` owns its own key
stream (split exactly as the global state splits, so a seeded request draws
what mlx_lm.server draws after `mx.random.seed(seed)`).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from cluster.engine.logprobs import TokenLogprob
from cluster.engine.request import SamplingParams

MAX_TOP_LOGPROBS = 20
# A token the grammar or logit_bias masks has logprob -inf, which JSON cannot carry; like vLLM's OpenAI
# server, report it as this (a probability that is exactly 0 in float32 anyway).
MIN_LOGPROB = -9999.0


class LogprobsPending:
    """One position's logprob arrays, computed lazily with the token and read back with it."""

    def __init__(self, logprobs: mx.array, token: mx.array, top_n: int):
        self.chosen = mx.take(logprobs, token)
        self.top_ids = self.top_values = None
        if top_n > 0:
            self.top_ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
            self.top_values = logprobs[self.top_ids]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def read(self, token: int) -> TokenLogprob:
        top = ()
        if self.top_ids is not None:
            pairs = zip(self.top_ids.tolist(), (max(v, MIN_LOGPROB) for v in self.top_values.tolist()))
            top = tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))
        return TokenLogprob(token, max(float(self.chosen.item()), MIN_LOGPROB), top)


class TokenPicker:
    """One request's processors, sampler and key stream. Made and used on the model thread."""

    def __init__(self, params: SamplingParams, prompt: list[int], grammar=None):
        self.params = params
        bias = {t: b for t, b in params.logit_bias} or None
        self.processors = make_logits_processors(
            bias, params.repetition_penalty or None, params.repetition_context_size,
            params.presence_penalty or None, params.presence_context_size,
            params.frequency_penalty or None, params.frequency_context_size)
        if grammar is not None:
            self.processors.append(grammar)
        # The tokens the processors look back over: the prompt, then each input as it is fed (the last
        # prompt token is the first decode input).
        self._context = TokenBuffer(prompt[:-1]) if self.processors else None
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed % (1 << 64))  # int64 -> uint64, one to one: distinct seeds, distinct keys

    @property
    def plain(self) -> bool:
        """Greedy with no processors: a batch picks such rows with one argmax."""
        return self.params.greedy and not self.processors

    def process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """Run the processors on one position's [1, vocab] logits; `inputs` is the [1] token fed for it."""
        if not self.processors:
            return logits
        context = self._context.update_and_fetch(inputs)
        for processor in self.processors:
            logits = processor(context, logits)
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        """A [1] token from [1, vocab] logprobs (lazy)."""
        p = self.params
        if p.greedy:
            return mx.argmax(logprobs, axis=-1)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub)

    def pending(self, logprobs: mx.array, token: mx.array) -> Optional[LogprobsPending]:
        """What the client asked to know about this position ([vocab] logprobs, [] token), or None."""
        n = self.params.logprobs
        return None if n is None else LogprobsPending(logprobs, token, min(n, MAX_TOP_LOGPROBS))

    def pick(self, inputs: mx.array, logits: mx.array) -> tuple[mx.array, Optional[LogprobsPending]]:
        """Alone: processors, logprobs, sampler for one position; returns the [1] token and its logprobs."""
        logits = self.process(inputs, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = self.sample(logprobs)
        return y, self.pending(logprobs[0], y[0])


def normalize(logits: mx.array) -> mx.array:
    """Logprobs of [rows, vocab] logits, as mlx-lm computes them."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
