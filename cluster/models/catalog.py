"""The built-in models: tiny, deterministic, random-weight mlx-lm models.

They exist so that a fleet, its tests and its benchmarks run offline on any
machine. Each is an ordinary mlx-lm model directory (config.json, safetensors,
tokenizer files), so it loads through the same `mlx_lm.load()` path as a Hugging
Face repo. The weights are random: the output is token soup, but it is
deterministic and depends on the whole context (untied lm_head), which is all
the cache-exactness tests need.

The configs are the ones known to load in mlx-lm 0.32 (see
shared/reference/mlx-facts.md §3.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = 1024
EOS_TOKEN_ID = 2


@dataclass(frozen=True)
class BuiltinModel:
    """One built-in model: its mlx-lm config and how it is presented."""

    name: str
    config: dict[str, Any]
    summary: str
    listed: bool = True  # False for bench-only models too big to build casually
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.config["model_type"]


def _common(**kw: Any) -> dict[str, Any]:
    base = {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }
    base.update(kw)
    return base


_QWEN3 = _common(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256,
    num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
)
_LLAMA = _common(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
    num_hidden_layers=4, intermediate_size=688, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
)
_GEMMA3 = _common(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=256,
    num_hidden_layers=6, intermediate_size=768, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=64,
    sliding_window_pattern=3,
)
_GEMMA3.pop("tie_word_embeddings")  # gemma3_text unties iff lm_head.weight is present
_GEMMA4 = _common(
    model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=256,
    num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, global_head_dim=128, num_kv_shared_layers=2,
    hidden_size_per_layer_input=32, vocab_size_per_layer_input=VOCAB_SIZE,
    rms_norm_eps=1e-6, sliding_window=64, sliding_window_pattern=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"],
    final_logit_softcapping=30.0,
)
_QWEN3_5 = _common(
    model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
    hidden_size=256, num_hidden_layers=8, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    full_attention_interval=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25},
)
_QWEN3_NEXT = _common(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=256,
    num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    full_attention_interval=4, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, shared_expert_intermediate_size=256,
    moe_intermediate_size=128, mlp_only_layers=[], norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=10000000.0, partial_rotary_factor=0.25,
)
# Qwen3-0.6B geometry with the tiny vocabulary: a realistic-shape model for
# benchmarks (442.6M parameters, 1.8 GB in float32). Never used by tests.
_QWEN3_0P6B = dict(
    _QWEN3, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960,
)

# Realistic geometries in bfloat16 for GPU benchmarks (docs/gpu.md). Random weights and the tiny
# vocabulary (the built-in tokenizer's); the layers are the real models' shapes. Built in seconds on a GPU
# (tens of GB on disk), far too big for CI: no test builds them.
_BF16 = {"torch_dtype": "bfloat16"}
_QWEN3_0P6B_BF16 = dict(_QWEN3_0P6B, **_BF16)
# Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 KV heads of 128.
_QWEN3_8B = dict(
    _QWEN3, hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, **_BF16,
)
# Qwen3-Next's attention geometry (3 gated-delta layers to 1 full-attention layer; 16 key / 32 value
# linear heads of 128; 16 query / 2 KV heads of 256) with a dense MLP instead of the experts: ~8B.
_QWEN3_5_HYBRID = dict(
    _QWEN3_5, hidden_size=2048, num_hidden_layers=48, intermediate_size=8192,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, max_position_embeddings=65536, **_BF16,
)
# Gemma 3 4B: 34 layers, hidden 2560, 8 query / 4 KV heads of 256, 5 sliding (1024) to 1 global.
_GEMMA3_4B = dict(
    _GEMMA3, hidden_size=2560, num_hidden_layers=34, intermediate_size=10240,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=65536, **_BF16,
)

BUILTINS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("tiny-dense", _QWEN3, "qwen3, 4 full-attention layers"),
        BuiltinModel("tiny-swa", _GEMMA3, "gemma3_text, sliding window 64 + global layers"),
        BuiltinModel("tiny-hybrid", _QWEN3_5, "qwen3_5, gated-delta + full attention"),
        BuiltinModel("tiny-llama", _LLAMA, "llama, 4 full-attention layers"),
        BuiltinModel("tiny-gemma4", _GEMMA4, "gemma4_text, sliding + global, KV-shared tail"),
        BuiltinModel("tiny-next", _QWEN3_NEXT, "qwen3_next, gated-delta + attention, MoE"),
        BuiltinModel("bench-qwen3-0.6b", _QWEN3_0P6B,
                     "qwen3, Qwen3-0.6B geometry (benchmarks only)", listed=False),
        BuiltinModel("bench-qwen3-0.6b-bf16", _QWEN3_0P6B_BF16,
                     "qwen3, Qwen3-0.6B geometry in bfloat16 (GPU benchmarks only)", listed=False),
        BuiltinModel("bench-qwen3-8b", _QWEN3_8B,
                     "qwen3, Qwen3-8B geometry in bfloat16 (GPU benchmarks only)", listed=False),
        BuiltinModel("bench-hybrid-8b", _QWEN3_5_HYBRID,
                     "qwen3_5, Qwen3-Next attention geometry, dense MLP, bfloat16 (GPU benchmarks only)",
                     listed=False),
        BuiltinModel("bench-gemma3-4b", _GEMMA3_4B,
                     "gemma3_text, Gemma 3 4B geometry in bfloat16 (GPU benchmarks only)", listed=False),
    )
}

DEFAULT_MODEL = "tiny-dense"
