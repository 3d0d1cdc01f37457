"""Shared fixtures: offline Hugging Face, the MLX thread guard, built-in models built once per session."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# MLX work off a replica's model thread fails on Metal; in tests it fails everywhere (engine/model_thread.py).
# Fleets started by tests inherit it, so their replicas run guarded too.
os.environ["MLX_FLEET_THREAD_GUARD"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A data dir whose models/ is shared by every test of the session."""
    return tmp_path_factory.mktemp("mlx-fleet-data")


@pytest.fixture(scope="session")
def load_builtin(data_dir):
    """load_builtin(name) -> (model, tokenizer), loaded once per session."""
    from mlx_lm import load

    from cluster.models.resolve import resolve_model

    loaded = {}

    def _load(name: str):
        if name not in loaded:
            loaded[name] = load(str(resolve_model(name, data_dir)))
        return loaded[name]

    return _load
