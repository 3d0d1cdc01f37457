import hashlib
from pathlib import Path

import pytest

from cluster.models.builder import build_model, parameter_count
from cluster.models.catalog import BUILTINS
from cluster.models.listing import list_builtin_models
from cluster.models.resolve import ModelNotFound, model_info, resolve_model

LISTED = [n for n, m in BUILTINS.items() if m.listed]


def digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())
            if f.is_file() and not f.name.startswith(".")}


def test_build_is_deterministic(tmp_path, data_dir):
    a = resolve_model("tiny-hybrid", data_dir)
    b = build_model(BUILTINS["tiny-hybrid"], tmp_path / "again")
    assert digest(a) == digest(b)
    assert set(digest(a)) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def test_build_is_idempotent(data_dir):
    path = resolve_model("tiny-dense", data_dir)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-dense", data_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid"])
def test_loads_through_mlx_lm_with_untied_head_and_chat_template(load_builtin, name):
    model, tok = load_builtin(name)
    weights = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()))
    assert any(k.endswith("lm_head.weight") for k in weights), "lm_head must be untied"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == {2}
    assert all(0 <= i < 1024 for i in ids)


def test_tokenizer_round_trips_arbitrary_text(load_builtin):
    _, tok = load_builtin("tiny-dense")
    text = "Grüße, 世界! \t tabs\nand émojis 🙂 1234"
    assert tok.decode(tok.encode(text)) == text


def test_parameter_counts_and_families(data_dir):
    rows = {r["name"]: r for r in list_builtin_models(data_dir)}
    assert set(rows) == set(LISTED)
    assert rows["tiny-dense"]["family"] == "qwen3" and rows["tiny-dense"]["parameters"] == 3_672_832
    assert rows["tiny-swa"]["family"] == "gemma3_text" and rows["tiny-hybrid"]["family"] == "qwen3_5"
    assert rows["tiny-hybrid"]["parameters"] == parameter_count(Path(rows["tiny-hybrid"]["path"]))


def test_model_info(data_dir):
    info = model_info("tiny-swa", data_dir)
    assert (info.family, info.context_length, info.builtin) == ("gemma3_text", 8192, True)
    assert model_info("tiny-swa", data_dir, max_context=512).context_length == 512


def test_resolve_errors_name_the_problem(tmp_path, data_dir):
    with pytest.raises(ModelNotFound, match="not a built-in model"):
        resolve_model("no-such-model", data_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"), data_dir)
    with pytest.raises(ModelNotFound, match="could not fetch it from Hugging Face"):
        resolve_model("mlx-community/definitely-not-a-repo-xyz", data_dir)


def test_local_directory_is_used_as_is(data_dir):
    path = resolve_model("tiny-dense", data_dir)
    assert resolve_model(str(path), data_dir) == path.resolve()


def test_models_cli_lists_and_builds(tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cluster.cli", "models", "--json", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert set(rows) == set(LISTED)
    assert rows["tiny-swa"]["family"] == "gemma3_text" and rows["tiny-swa"]["parameters"] == 5_053_440
    assert Path(rows["tiny-swa"]["path"]) == tmp_path / "models" / "tiny-swa"
    assert (tmp_path / "models" / "tiny-swa" / "model.safetensors").is_file()
