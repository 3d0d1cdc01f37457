"""How to generate from a prompt: limits and sampling.

Plain data, no MLX: the gateway builds these and must not need MLX to do so.
(The request that carries them to a replica: actors/plan.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Seeds are OpenAI's int64. Every distinct seed in this range gives its own key
# stream (the seed maps one-to-one onto MLX's 64-bit random key).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token: mlx-lm's logits processors, then its sampler (names and defaults
    follow mlx_lm.server's request fields)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    repetition_penalty: float = 0.0  # 0: off (multiplicative, sign-aware)
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logprobs: Optional[int] = None  # None: none; N >= 0: the chosen token's logprob and the top N
    grammar: Optional[str] = None  # an llguidance grammar (JSON mode, forced tool calls): constrain decoding

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether any logits processor runs (otherwise the logits go straight to the sampler)."""
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty or self.frequency_penalty
                    or self.grammar)


@dataclass(frozen=True)
class GenerationParams:
    """Per-request limits and sampling."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # Chat replies drop the first token's leading space, as mlx-lm does; a text
    # completion keeps it, so prompt + completion is exactly the decoded tokens.
    trim_leading_space: bool = False
    tools: Optional[str] = None  # the request's tools (JSON): parse tool calls out of the reply
    tool_choice: Optional[str] = None  # force a call: "*" (any of the tools) or a tool's name
    record_logits: bool = False  # keep each step's logits (tests compare them across runs)


def params_to_wire(params: GenerationParams) -> dict:
    """Plain data (msgpack-able) for another process: a sharded replica's ranks rebuild the same request."""
    s = params.sampling
    return {"max_tokens": params.max_tokens, "stop": list(params.stop), "trim_leading_space": params.trim_leading_space,
            "tools": params.tools, "tool_choice": params.tool_choice, "record_logits": params.record_logits,
            "sampling": {**{f: getattr(s, f) for f in SamplingParams.__dataclass_fields__ if f != "logit_bias"},
                         "logit_bias": [list(p) for p in s.logit_bias]}}


def params_from_wire(data: dict) -> GenerationParams:
    """The inverse of params_to_wire; a field it does not know is an error, not a silent default."""
    sampling = dict(data["sampling"])
    sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in sampling["logit_bias"])
    return GenerationParams(max_tokens=data["max_tokens"], sampling=SamplingParams(**sampling),
                            stop=tuple(data["stop"]), trim_leading_space=data["trim_leading_space"],
                            tools=data["tools"], tool_choice=data["tool_choice"], record_logits=data["record_logits"])
