"""Build a built-in model directory on first use.

The directory is assembled under a temporary name and renamed into place, so
concurrent builders (two replicas and a gateway starting together) never see a
half-written model: whoever renames first wins and the others discard theirs.
Weights are generated from a fixed seed and saved from the MLX module itself,
which guarantees that `load(strict=True)` finds every parameter.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

from cluster.models.catalog import BuiltinModel
from cluster.models.tokenizer_builder import CHAT_TEMPLATE, build_tokenizer

WEIGHTS_FILE = "model.safetensors"


def is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file()


def build_model(spec: BuiltinModel, path: Path) -> Path:
    """Build `spec` at `path` unless it is already there; return the path."""
    if is_built(path):
        return _refresh_template(path)
    return _assemble(spec, path, weights=True)


def build_tokenizer_dir(spec: BuiltinModel, path: Path) -> Path:
    """Only `spec`'s config and tokenizer at `path` (no weights, no MLX): what a gateway needs."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return _refresh_template(path)
    return _assemble(spec, path, weights=False)


def _refresh_template(path: Path) -> Path:
    """A model built by an earlier version gets today's chat template (it gained tools); nothing else changes.

    Written to a temporary file and renamed, so a concurrent reader sees the old file or the new one."""
    config_file = path / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return path
    if config.get("chat_template") != CHAT_TEMPLATE:
        config["chat_template"] = CHAT_TEMPLATE
        tmp = path / f".tokenizer_config.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, config_file)
    return path


def _assemble(spec: BuiltinModel, path: Path, weights: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if weights:
            _write_weights(spec, tmp)
        (tmp / "config.json").write_text(json.dumps(spec.config, indent=2, sort_keys=True))
        build_tokenizer(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():  # lost the race to a half-built dir? never: rename is atomic
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_weights(spec: BuiltinModel, out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    # from_dict mutates nested dicts (qwen3_5 rope_parameters), so build from a copy.
    config = copy.deepcopy(spec.config)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(spec.seed)
    model = model_cls(args_cls.from_dict(config))
    dtype = getattr(mx, config.get("torch_dtype", "float32"))
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    mx.save_safetensors(str(out / WEIGHTS_FILE), weights, {"format": "mlx"})


def parameter_count(path: Path) -> int:
    """Number of parameters stored in a model directory's safetensors files."""
    import mlx.core as mx

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        total += sum(a.size for a in mx.load(str(f)).values())
    return total
