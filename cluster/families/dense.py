"""Full attention in every layer: one KVCache per layer (mlx-lm's default cache)."""

from __future__ import annotations

from cluster.families.specs import FullAttention

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def layout(model, config: dict) -> list:
    return [FullAttention() for _ in range(config["num_hidden_layers"])]
