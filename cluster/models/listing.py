"""`mlx-fleet models`: the built-in models, built on demand."""

from __future__ import annotations

from pathlib import Path

from cluster.models.builder import parameter_count
from cluster.models.catalog import BUILTINS
from cluster.models.resolve import resolve_model


def list_builtin_models(data_dir: Path) -> list[dict]:
    rows = []
    for name, spec in BUILTINS.items():
        if not spec.listed:
            continue
        path = resolve_model(name, data_dir)
        rows.append({"name": name, "family": spec.family, "path": str(path),
                     "parameters": parameter_count(path), "summary": spec.summary})
    return rows
