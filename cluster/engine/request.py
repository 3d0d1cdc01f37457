"""The gateway -> replica call: token ids and how to generate from them."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.sequence import GenerationParams


@dataclass(frozen=True)
class GenerateRequest:
    """One request as a replica sees it. The gateway has already tokenized and validated it."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    params: GenerationParams
