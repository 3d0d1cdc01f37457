"""Time to first token: a fully cached prompt against the same prompt cold, in one run.

    mlx-fleet bench ttft [--models bench-qwen3-0.6b] [--tokens 2048] [--block-tokens 64] [--json out.json]

Per model, on one prompt of `tokens` tokens (max_tokens=1, greedy):
- cold:     no cache at all (what a cache miss costs);
- capture:  cold, while storing every block (the overhead of filling the cache);
- cached:   the same prompt again, restored from the RAM tier (all but the last
            token, or back to the last checkpoint on hybrids).
The target is cached/cold <= 0.05 on a realistic-shape model.

bench-qwen3-0.6b is the Qwen3-0.6B geometry with random float32 weights (built
on first use, 1.8 GB). Its cold 2k prefill is slow on the CPU backend; on Linux
preload an optimized BLAS for this benchmark:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_CORETYPE=SkylakeX mlx-fleet bench ttft
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from cluster.bench.common import load, parser, prompt_tokens, write_json
from cluster.config import CacheConfig
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Delta, Started
from cluster.engine.sequence import GenerationParams, Sequence
from cluster.kvcache.session import BlockSession
from cluster.kvcache.setup import setup_cache


def first_token(model, tok, prompt, session) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, the token)."""
    seq = Sequence(prompt, GenerationParams(max_tokens=1), model, tok, session, prefill_step=512)
    t0 = time.perf_counter()
    cached = 0
    while True:
        for e in seq.step():
            if isinstance(e, Started):
                cached = e.cached_tokens
            if isinstance(e, Delta):
                elapsed = time.perf_counter() - t0
                while not seq.done:
                    seq.step()
                return elapsed, cached, e.token_ids[0]


def measure(name: str, data_dir: Path, tokens: int, block_tokens: int) -> dict:
    model, tok, path = load(name, data_dir)
    pc = setup_cache(model, tok, path, CacheConfig(block_tokens=block_tokens, ram_bytes=16 << 30),
                     Path(tempfile.mkdtemp())).cache
    prompt = prompt_tokens(tokens)
    first_token(model, tok, prompt[:64], ColdSession(model, pc.new_caches))  # warm up kernels
    cold, _, t_cold = first_token(model, tok, prompt, ColdSession(model, pc.new_caches))
    capture, _, t_capture = first_token(model, tok, prompt, BlockSession(pc, prompt))
    cached, n, t_cached = first_token(model, tok, prompt, BlockSession(pc, prompt))
    assert t_cold == t_capture == t_cached, "cached first token differs from cold"
    return {"model": name, "tokens": tokens, "block_tokens": block_tokens, "cached_tokens": n,
            "cold_s": cold, "capture_s": capture, "cached_s": cached,
            "cached_vs_cold": cached / cold, "capture_overhead": capture / cold - 1,
            "ram_bytes": pc.tier.stats()["ram"]["bytes"]}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="bench-qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-tokens", type=int, default=64)
    a = p.parse_args(argv)
    rows = []
    print(f"{'model':<20}{'tokens':>7}{'cached':>8}{'cold s':>10}{'capture s':>11}{'cached s':>10}"
          f"{'cached/cold':>13}{'capture ovh':>13}")
    for name in a.models.split(","):
        r = measure(name, a.data_dir, a.tokens, a.block_tokens)
        rows.append(r)
        print(f"{r['model']:<20}{r['tokens']:>7}{r['cached_tokens']:>8}{r['cold_s']:>10.3f}{r['capture_s']:>11.3f}"
              f"{r['cached_s']:>10.3f}{r['cached_vs_cold']:>13.4f}{r['capture_overhead']:>12.1%}", flush=True)
    write_json(a.json, "ttft", {"rows": rows})
    return 0
