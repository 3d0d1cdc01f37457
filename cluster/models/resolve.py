"""Turn what a user typed after --model into a local mlx-lm model directory.

Three kinds of source, tried in this order:
1. a built-in name: built on first use under <data_dir>/models/<name>;
2. an existing local directory: used as is (it must hold config.json);
3. a Hugging Face repo id (owner/name): fetched through mlx-lm's own download
   path, so a Mac with network serves e.g. mlx-community/Qwen3-4B-4bit.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from cluster.models.builder import build_model, build_tokenizer_dir, is_built
from cluster.models.catalog import BUILTINS

# What a gateway fetches of a hub model: config and tokenizer, never the weights.
TOKENIZER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "*.tiktoken"]

_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(ValueError):
    """The source names no built-in model, local model directory or reachable repo."""


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway and the CLI need to know about a resolved model."""

    path: Path
    family: str
    context_length: int
    builtin: bool


def resolve_model(source: str, data_dir: Path) -> Path:
    """Return a local directory holding the model named by `source`."""
    if source in BUILTINS:
        return build_model(BUILTINS[source], Path(data_dir).expanduser() / "models" / source)
    return _local_or_hub(source, _download)


def resolve_tokenizer(source: str, data_dir: Path) -> Path:
    """A local directory with the model's config and tokenizer files, without fetching or building weights."""
    if source in BUILTINS:
        full = Path(data_dir).expanduser() / "models" / source
        if is_built(full):
            return full
        return build_tokenizer_dir(BUILTINS[source], Path(data_dir).expanduser() / "models" / ".tokenizers" / source)
    return _local_or_hub(source, _download_tokenizer)


def check_source(source: str) -> str:
    """What kind of source it is ("builtin", "local", "hub"), without building, reading weights or
    downloading; raises ModelNotFound for one that cannot be any, so `up` says so before it starts anything."""
    if source in BUILTINS:
        return "builtin"
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model {source!r}: {path} has no config.json; point --model at an mlx-lm model directory")
        return "local"
    if _REPO_RE.match(source) and not source.startswith((".", "/", "~")):
        return "hub"
    listed = [n for n, m in BUILTINS.items() if m.listed]
    near = difflib.get_close_matches(source, listed, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise ModelNotFound(f"model {source!r} is not a built-in model ({', '.join(listed)}), not an existing directory, "
                        f"and not a Hugging Face repo id (owner/name){hint}")


def _local_or_hub(source: str, download) -> Path:
    if check_source(source) == "local":
        return Path(source).expanduser().resolve()
    return download(source)


def _download(repo: str) -> Path:
    from mlx_lm.utils import _download as mlx_download

    return _fetch(repo, lambda: mlx_download(repo))


def _download_tokenizer(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    return _fetch(repo, lambda: snapshot_download(repo, allow_patterns=TOKENIZER_FILES))


def _fetch(repo: str, fetch) -> Path:
    try:
        return Path(fetch())
    except Exception as e:  # hub errors come in many types; all mean "cannot get it"
        raise ModelNotFound(
            f"model {repo!r}: could not fetch it from Hugging Face ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "check the repo id and the network, or pass a local directory"
        ) from None


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def text_config(config: dict) -> dict:
    """Multimodal configs (qwen3_5, gemma3) nest the language model's fields."""
    return {**config, **config.get("text_config", {})}


def model_info(source: str, data_dir: Path, max_context: int | None = None) -> ModelInfo:
    """What the gateway needs: config and tokenizer only (no weights are fetched or built)."""
    path = resolve_tokenizer(source, data_dir)
    config = text_config(read_config(path))
    context = max_context or int(config.get("max_position_embeddings") or 4096)
    return ModelInfo(path=path, family=config["model_type"], context_length=context, builtin=source in BUILTINS)
