import pytest

from cluster.families.registry import FAMILIES, UnsupportedModel, layout_for
from cluster.families.specs import FullAttention, QuantizedAttention, Recurrent, SlidingWindow
from cluster.models.resolve import read_config, resolve_model

F, R = FullAttention(), Recurrent(2)
S = SlidingWindow(64)


@pytest.mark.parametrize("name,family,layers", [
    ("tiny-dense", "qwen3", [F] * 4),
    ("tiny-llama", "llama", [F] * 4),
    ("tiny-swa", "gemma3_text", [S, S, F, S, S, F]),
    ("tiny-gemma4", "gemma4_text", [S, S, F, S]),  # 6 layers, the 2 KV-shared ones own no cache
    ("tiny-hybrid", "qwen3_5", [R, R, R, F, R, R, R, F]),
    ("tiny-next", "qwen3_next", [R, R, R, F]),
])
def test_layouts_of_the_builtin_families(load_builtin, data_dir, name, family, layers):
    model, _ = load_builtin(name)
    layout = layout_for(model, read_config(resolve_model(name, data_dir)))
    assert layout.family == family and list(layout.layers) == layers


def test_required_families_are_declared():
    assert {"llama", "qwen3", "gemma3_text", "gemma4_text", "qwen3_5", "qwen3_next"} <= set(FAMILIES)


def test_quantized_codec_replaces_full_attention(load_builtin, data_dir):
    model, _ = load_builtin("tiny-dense")
    layout = layout_for(model, read_config(resolve_model("tiny-dense", data_dir)), "q8", 64)
    assert list(layout.layers) == [QuantizedAttention(8, 64)] * 4


def test_quantized_codec_is_refused_for_sliding_and_recurrent(load_builtin, data_dir):
    for name in ("tiny-swa", "tiny-hybrid"):
        model, _ = load_builtin(name)
        with pytest.raises(UnsupportedModel, match="full attention only") as e:
            layout_for(model, read_config(resolve_model(name, data_dir)), "q4", 64)
        assert "supported:" not in str(e.value) and "kv_codec native or tq8" in str(e.value)  # its family is one


def test_unknown_family_names_what_is_supported(load_builtin):
    model, _ = load_builtin("tiny-dense")
    with pytest.raises(UnsupportedModel) as e:
        layout_for(model, {"model_type": "mamba2"})
    assert "mamba2" in str(e.value) and "qwen3_5" in str(e.value) and "gemma3_text" in str(e.value)


def test_layout_that_disagrees_with_mlx_lm_is_refused(load_builtin, data_dir):
    model, _ = load_builtin("tiny-swa")
    config = {**read_config(resolve_model("tiny-swa", data_dir)), "model_type": "qwen3"}  # claims dense
    with pytest.raises(UnsupportedModel, match="RotatingKVCache"):
        layout_for(model, config)
