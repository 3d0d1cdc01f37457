"""What each side fetches: a replica the whole model, a gateway only the config and tokenizer."""

import fnmatch

import pytest

from cluster.models import resolve


def test_a_gateway_fetches_no_weights_of_a_hub_model(monkeypatch, tmp_path):
    calls = []

    def snapshot_download(repo, allow_patterns=None, **kw):  # the hub is out of reach here: record the ask
        calls.append((repo, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    assert resolve.resolve_tokenizer("mlx-community/Qwen3-4B-4bit", tmp_path) == tmp_path
    (repo, patterns), = calls
    assert repo == "mlx-community/Qwen3-4B-4bit"

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    for needed in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "merges.txt"):
        assert fetched(needed), needed
    for weight in ("model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                   "pytorch_model.bin"):
        assert not fetched(weight), weight


def test_a_builtin_model_gives_the_gateway_its_tokenizer_without_building_weights(tmp_path):
    path = resolve.resolve_tokenizer("tiny-swa", tmp_path)
    assert (path / "tokenizer.json").is_file() and (path / "config.json").is_file()
    assert not list(path.glob("*.safetensors")) and not (tmp_path / "models" / "tiny-swa").exists()


def test_an_unreachable_hub_repo_names_the_fix(monkeypatch, tmp_path):
    def offline(repo, **kw):
        raise OSError("offline")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(resolve.ModelNotFound, match="check the repo id and the network"):
        resolve.resolve_tokenizer("someone/missing", tmp_path)
