import json
import shutil

import pytest

from cluster.families import codecs
from cluster.families.codecs import codec_descriptor
from cluster.store import fingerprint
from cluster.store.fingerprint import WEIGHTS_CACHE, compute_fingerprint, weights_digest

BASE = dict(dtype="float32", codec=codec_descriptor("native", 64), block_tokens=64, chat_template="T")


@pytest.fixture
def model_dir(tmp_path, data_dir):
    from cluster.models.resolve import resolve_model

    src = resolve_model("tiny-dense", data_dir)
    dst = tmp_path / "m"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    return dst


def ns(model_dir, **over):
    return compute_fingerprint(model_dir, **{**BASE, **over}).namespace


def test_stable_and_path_independent(model_dir, tmp_path):
    first = ns(model_dir)
    assert ns(model_dir) == first
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert ns(copy) == first  # same files elsewhere share blocks


@pytest.mark.parametrize("over", [
    {"dtype": "bfloat16"}, {"codec": codec_descriptor("q8", 64)}, {"block_tokens": 32},
    {"chat_template": "other"}, {"kernels": ["gated-delta-cuda/1"]},
])
def test_every_setting_changes_the_namespace(model_dir, over):
    assert ns(model_dir, **over) != ns(model_dir)


def test_config_weights_and_tokenizer_change_the_namespace(model_dir):
    base = ns(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_theta"] = 1.0
    (model_dir / "config.json").write_text(json.dumps(cfg))
    after_config = ns(model_dir)
    assert after_config != base
    tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 7
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok))
    after_tok = ns(model_dir)
    assert after_tok != after_config
    w = model_dir / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    assert ns(model_dir) != after_tok


def test_weight_hash_is_memoised_next_to_the_model(model_dir):
    digest = weights_digest(model_dir)
    memo = json.loads((model_dir / WEIGHTS_CACHE).read_text())
    assert len(memo) == 1 and next(iter(memo)).startswith("model.safetensors:")
    # A memo entry is trusted for the same (name, size, mtime): prove it is used, not recomputed.
    key = next(iter(memo))
    memo[key] = "0" * 64
    (model_dir / WEIGHTS_CACHE).write_text(json.dumps(memo))
    assert weights_digest(model_dir) != digest


def test_unwritable_model_dir_memoises_under_the_data_dir(model_dir, tmp_path):
    digest = weights_digest(model_dir)
    (model_dir / WEIGHTS_CACHE).unlink()
    (model_dir / WEIGHTS_CACHE).mkdir()  # the memo cannot be written there, even by root
    cache_dir = tmp_path / "fp-cache"
    assert weights_digest(model_dir, cache_dir) == digest
    memos = list(cache_dir.glob("weights-*.json"))
    assert len(memos) == 1 and next(iter(json.loads(memos[0].read_text()))).startswith("model.safetensors:")


def test_the_codec_version_is_part_of_the_namespace(model_dir, monkeypatch):
    before = ns(model_dir)
    assert compute_fingerprint(model_dir, **BASE).parts["kv_codec"] == ["native", 1, None, None]
    monkeypatch.setitem(codecs.CODEC_VERSIONS, "native", 2)  # the codec changed: old blocks must not be read
    assert ns(model_dir, codec=codec_descriptor("native", 64)) != before


def test_a_gpu_that_cannot_be_identified_never_shares_a_placeholder_namespace(monkeypatch):
    import mlx.core as mx

    class Gpu:
        type = mx.DeviceType.gpu

    def broken():
        raise RuntimeError("no device info on this build")

    monkeypatch.setattr(mx, "default_device", lambda: Gpu())
    monkeypatch.setattr(mx, "device_info", broken)
    name = fingerprint.backend()
    assert name.startswith("gpu:") and name not in ("gpu:?", "gpu:", "gpu:None")
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g15s"})
    assert fingerprint.backend() == "gpu:applegpu_g15s"


def test_no_kernel_of_ours_leaves_the_namespace_as_it_was(model_dir):
    """Only a model computed by a kernel of ours (a hybrid on CUDA) gets the part: every other keeps its blocks."""
    assert ns(model_dir, kernels=[]) == ns(model_dir)
    assert "kernels" not in compute_fingerprint(model_dir, **BASE).parts
