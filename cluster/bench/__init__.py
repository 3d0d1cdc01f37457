"""Benchmarks: scripts that measure against a peer or a limit in the same run."""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "codec": "cluster.bench.codec",
    "ttft": "cluster.bench.ttft",
    "blocksize": "cluster.bench.blocksize",
    "disk": "cluster.bench.disk",
    "lookup": "cluster.bench.lookup",
    "routing": "cluster.bench.routing",
    "migrate": "cluster.bench.migrate",
    "turboquant": "cluster.bench.turboquant",
    "batch": "cluster.bench.batch",
    "gpu": "cluster.bench.gpu",
    "agreement": "cluster.bench.agreement",
    "shard": "cluster.bench.shard",
    "repeat": "cluster.bench.repeat",
    "decode": "cluster.bench.decode",
}


def run_benchmark(name: str, argv: list[str]) -> int:
    import importlib

    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHMARKS)) or '(none yet)'}")
    module = importlib.import_module(BENCHMARKS[name])
    return module.main(argv)
