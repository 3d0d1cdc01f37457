"""Gemma 3/4 text: sliding-window layers (RotatingKVCache, keep=0) interleaved with global layers.

gemma3_text decides per layer from `sliding_window_pattern` (it ignores HF's
layer_types); gemma4_text reads `layer_types` and gives caches only to the
first num_hidden_layers - num_kv_shared_layers layers: the shared tail reuses
them, so its layout is shorter than its layer list.
"""

from __future__ import annotations

from cluster.families.specs import FullAttention, SlidingWindow

MODEL_TYPES = ("gemma3_text", "gemma4_text", "gemma3", "gemma4")


def layout(model, config: dict) -> list:
    # The multimodal gemma3/gemma4 wrap the text model and delegate make_cache to it.
    args = getattr(model, "language_model", model).args
    if config["model_type"] in ("gemma3_text", "gemma3"):
        pattern = args.sliding_window_pattern
        return [FullAttention() if i % pattern == pattern - 1 else SlidingWindow(args.sliding_window)
                for i in range(args.num_hidden_layers)]
    owned = args.num_hidden_layers - args.num_kv_shared_layers
    return [FullAttention() if args.layer_types[i] == "full_attention" else SlidingWindow(args.sliding_window)
            for i in range(owned)]
