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
    """How to pick each next token."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationParams:
    """Per-request limits and sampling."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # Chat replies drop the first token's leading space, as mlx-lm does; a text
    # completion keeps it, so prompt + completion is exactly the decoded tokens.
    trim_leading_space: bool = False
    record_logits: bool = False  # keep each step's logits (tests compare them across runs)
