"""A generated token's logprobs as they travel to the gateway (plain data, no MLX)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the most likely alternatives at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
