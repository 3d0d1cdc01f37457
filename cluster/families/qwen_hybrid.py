"""Qwen3.5 / Qwen3-Next: gated-delta linear attention (recurrent state) plus full attention.

Layer i is full attention iff (i + 1) % full_attention_interval == 0; every
other layer keeps an ArraysCache of two arrays (conv state, SSM state).
"""

from __future__ import annotations

from cluster.families.specs import FullAttention, Recurrent

MODEL_TYPES = ("qwen3_5", "qwen3_next")


def layout(model, config: dict) -> list:
    interval = config.get("full_attention_interval", 4)
    return [FullAttention() if (i + 1) % interval == 0 else Recurrent(2)
            for i in range(config["num_hidden_layers"])]
