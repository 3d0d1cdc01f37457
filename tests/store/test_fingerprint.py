import json
import shutil

import pytest

from cluster.store.fingerprint import WEIGHTS_CACHE, compute_fingerprint, weights_digest

BASE = dict(dtype="float32", kv_codec="native", kv_bits=None, kv_group=None, block_tokens=64, chat_template="T")


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
    {"dtype": "bfloat16"}, {"kv_codec": "q8", "kv_bits": 8, "kv_group": 64}, {"block_tokens": 32},
    {"chat_template": "other"},
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


def test_read_only_model_dir_memoises_under_the_data_dir(model_dir, tmp_path):
    model_dir.chmod(0o555)
    try:
        cache_dir = tmp_path / "fp-cache"
        weights_digest(model_dir, cache_dir)
        if not (model_dir / WEIGHTS_CACHE).exists():  # root may still write: then the model dir is used
            assert list(cache_dir.glob("weights-*.json"))
    finally:
        model_dir.chmod(0o755)
