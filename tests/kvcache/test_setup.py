import json
import shutil

from cluster.config import CacheConfig
from cluster.engine.schedule import on_gpu
from cluster.kvcache.setup import UnsupportedCodec, setup_cache
from cluster.models.resolve import resolve_model


def test_unsupported_family_is_served_without_cache(load_builtin, data_dir, tmp_path):
    model, tok = load_builtin("tiny-llama")
    path = tmp_path / "other"
    shutil.copytree(resolve_model("tiny-llama", data_dir), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "olmo2"
    (path / "config.json").write_text(json.dumps(cfg))
    setup = setup_cache(model, tok, path, CacheConfig(), tmp_path)
    assert setup.cache is None and "olmo2" in setup.disabled_reason and "qwen3_5" in setup.disabled_reason


def test_disabled_by_config(load_builtin, data_dir, tmp_path):
    model, tok = load_builtin("tiny-dense")
    setup = setup_cache(model, tok, resolve_model("tiny-dense", data_dir), CacheConfig(enabled=False), tmp_path)
    assert setup.cache is None and setup.disabled_reason == "disabled by configuration"


def test_enabled_cache_reports_its_measured_geometry(load_builtin, data_dir, tmp_path):
    model, tok = load_builtin("tiny-hybrid")
    setup = setup_cache(model, tok, resolve_model("tiny-hybrid", data_dir), CacheConfig(block_tokens=32), tmp_path)
    stats = setup.cache.stats()
    assert stats["block_tokens"] == 32 and stats["checkpoint_every"] == 4
    assert setup.fingerprint.parts["dtype"] == "float32" and setup.fingerprint.parts["block_tokens"] == 32


def test_a_backend_without_quantized_kernels_refuses_q8_at_start_naming_the_alternatives(load_builtin, data_dir,
                                                                                         tmp_path, monkeypatch):
    """MLX's CUDA backend lacks quantized_matmul for some shapes; that cannot happen on the CPU, so it is
    made to happen: the kernel raises as CUDA's does. The replica must not start and fail mid-request."""
    import mlx.core as mx
    import pytest

    from cluster.kvcache.setup import UnsupportedCodec

    def no_kernel(*args, **kwargs):
        raise ValueError("[quantized_matmul] No kernel for shape 4x4x64x4, bits: 8")

    model, tok = load_builtin("tiny-dense")
    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)
    with pytest.raises(UnsupportedCodec) as e:
        setup_cache(model, tok, resolve_model("tiny-dense", data_dir), CacheConfig(kv_codec="q8"), tmp_path)
    from cluster.store.fingerprint import backend

    assert "--kv-codec q8" in str(e.value) and f"the {backend()} backend" in str(e.value)
    assert "--kv-codec native" in str(e.value) and "tq8" in str(e.value) and "No kernel" in str(e.value)
    setup = setup_cache(model, tok, resolve_model("tiny-dense", data_dir), CacheConfig(kv_codec="native"), tmp_path)
    assert setup.cache is not None  # the native codec needs no quantized kernel


def test_blocks_made_with_the_one_query_kernel_never_meet_blocks_made_without(load_builtin, data_dir, tmp_path):
    """With exact_decode_attention on (MLX's CUDA backend), a prompt's last token and generated tokens attend in
    the project's kernel: their blocks are other bytes, so the fingerprint names the kernel. q8 is not turned
    away for it (its quantized cache's attention is not the kernel's and stays mlx-lm's): it starts, or, where
    MLX lacks the quantized kernel for the model's shapes (CUDA, for tiny-dense), refuses at start naming the
    backend, as without the kernel."""
    from cluster.engine import invariant

    model, tok = load_builtin("tiny-dense")
    path = resolve_model("tiny-dense", data_dir)
    was = invariant.routes_one_query()
    try:
        invariant.exact_decode_attention(False)
        off = setup_cache(model, tok, path, CacheConfig(), tmp_path)
        invariant.exact_decode_attention(True)
        on = setup_cache(model, tok, path, CacheConfig(), tmp_path)
        try:
            q8 = setup_cache(model, tok, path, CacheConfig(kv_codec="q8"), tmp_path).cache
        except UnsupportedCodec as e:
            q8 = e
    finally:
        invariant.exact_decode_attention(was)
    assert invariant.EXACT_DECODE_VERSION in on.fingerprint.parts["kernels"]
    assert invariant.EXACT_DECODE_VERSION not in off.fingerprint.parts.get("kernels", [])
    assert on.cache.namespace != off.cache.namespace
    if isinstance(q8, UnsupportedCodec):  # the quantized kernel is missing, not the one-query one
        assert on_gpu() and "quantized_matmul" in str(q8) and "--kv-codec native" in str(q8)
    else:
        assert q8 is not None
