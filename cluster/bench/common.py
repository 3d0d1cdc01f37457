"""Shared pieces of the benchmarks: argument parsing, models, timing, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

from cluster.config import default_data_dir


class _DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says its own or has none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] \
                or action.default == argparse.SUPPRESS \
                or "default" in text or not action.option_strings:
            return text
        if isinstance(action.default, list):  # nargs="+": shown as it is typed
            return f"{text} (default: {' '.join(map(str, action.default)).replace('%', '%%')})".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


def parser(description: str, module: str = "") -> argparse.ArgumentParser:
    """A benchmark's parser; `module` (its __name__) names it in usage: `mlx-fleet bench <name>`."""
    prog = f"mlx-fleet bench {module.rsplit('.', 1)[-1]}" if module else None
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_DefaultsShown)
    p.add_argument("--data-dir", type=Path, default=default_data_dir(), help="where built-in models are built")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results here as JSON")
    return p


def environment() -> dict:
    import mlx.core as mx

    return {
        "machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count(),
        "device": str(mx.default_device()), "blas_preload": os.environ.get("LD_PRELOAD", ""),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
    }


def load(name: str, data_dir: Path):
    from cluster.models.loading import load_model

    from cluster.models.resolve import resolve_model

    from cluster.engine.model_thread import warm

    path = resolve_model(name, data_dir)
    model, tok = load_model(path)
    warm(model)  # benchmarks hand it to Schedulers' threads
    return model, tok, path


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest wall time of `repeats` calls (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def write_json(path: Path | None, name: str, results: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), "results": results}, indent=2))
    print(f"wrote {path}")


def prompt_tokens(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7919 + salt * 104729) % 1021 for i in range(n)]
